"""Body parsing at the HTTP edge: JSON → pydantic model, errors → one 422 shape."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)


class BodyInvalid(Exception):
    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("invalid request body")
        self.errors = errors


def parse_body(model: type[T], raw: bytes) -> T:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _invalid(exc) from None


def parse_obj(model: type[T], obj: object) -> T:
    """``parse_body`` for a body already decoded from JSON (a call inside ``POST /v1/batch``)."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> BodyInvalid:
    return BodyInvalid(
        [
            {"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_context=False, include_input=False)
        ]
    )
