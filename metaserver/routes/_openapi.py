"""OpenAPI for routes that read their JSON body themselves (``validation.parse_body``, for one
clear 422): the body's schema by name (``app._BODY_MODELS`` puts it in the components) and the
bearer credential a write asks for."""

from __future__ import annotations

from pydantic import BaseModel

WRITE: dict[str, object] = {"security": [{"bearer": []}]}


def json_body(model: type[BaseModel], *, write: bool = True) -> dict[str, object]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    body: dict[str, object] = {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}
    }
    return {**body, **WRITE} if write else body
