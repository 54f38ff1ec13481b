"""JSON responses built from pre-serialised bytes (no re-encoding on reads)."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import Response

JSON = "application/json"


def json_bytes(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content=body, status_code=status, media_type=JSON, headers=headers)


def json_list(key: str, items: Iterable[bytes]) -> Response:
    parts = list(items)
    body = f'{{"count":{len(parts)},"{key}":['.encode() + b",".join(parts) + b"]}"
    return json_bytes(body)
