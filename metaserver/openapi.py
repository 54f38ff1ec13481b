"""The metaserver's OpenAPI. Routes read their JSON body themselves (``validation.parse_body``, for
one clear 422), so each names its body's schema (``json_body``) and the bearer credential a
write asks for (``WRITE``); ``schema`` puts those bodies' schemas in the components."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pdwire.ascend import AscendBinding
from pdwire.models import (
    BatchIn,
    BindingSpec,
    EventIn,
    InstanceSpec,
    KVMatchIn,
    KVPlacedIn,
    LoadReport,
    MarkIn,
)

WRITE: dict[str, object] = {"security": [{"bearer": []}]}
BODY_MODELS = (
    BindingSpec,
    EventIn,
    InstanceSpec,
    AscendBinding,
    MarkIn,
    BatchIn,
    KVMatchIn,
    KVPlacedIn,
    LoadReport,
)


def json_body(model: type[BaseModel], *, write: bool = True) -> dict[str, object]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    body: dict[str, object] = {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}
    }
    return {**body, **WRITE} if write else body


def schema(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document (built once), with ``BODY_MODELS`` and the bearer scheme."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for model in BODY_MODELS:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = doc
    return doc
