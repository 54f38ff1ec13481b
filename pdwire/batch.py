"""Several binding writes in one request (``POST /v1/batch``): what a ``BackgroundWriter`` sends
when it has more than one write queued (``pdwire.client``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from pdwire.fields import Strict
from pdwire.ids import ID_BODY

BATCH_PATH = "/v1/batch"
BATCH_MAX_CALLS = 256


class BatchCall(Strict):
    """One write in a batch: the method, path and body its own request would have sent."""

    method: Literal["PUT", "POST"]
    path: Annotated[
        str, Field(max_length=160, pattern=rf"^/v1/bindings/{ID_BODY}(/events|/marks)?$")
    ] = Field(description="PUT /v1/bindings/{id}, POST …/{id}/events or POST …/{id}/marks")
    body: dict[str, Any]


class BatchIn(Strict):
    """Several binding writes in one request (``POST /v1/batch``). Calls about one transfer run
    in their order; calls about different transfers run side by side."""

    calls: Annotated[list[BatchCall], Field(min_length=1, max_length=BATCH_MAX_CALLS)]


class BatchResult(BaseModel):
    status: int = Field(description="the status the call alone would have been answered with")
    body: Any = Field(description="its answer: a binding, an error's detail; null for 204")


class BatchOut(BaseModel):
    results: list[BatchResult] = Field(description="one per call, in the calls' order")
