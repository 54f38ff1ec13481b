"""The metaserver's load board (``PUT /v1/load/{replica}``): each proxy replica reports its
in-flight load per instance, and reads what the other replicas reported (``metaserver.loadboard``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from pdwire.fields import Strict

LOAD_PATH = "/v1/load/{replica}"
Url = Annotated[str, Field(min_length=1, max_length=512)]


class LoadReport(Strict):
    """One proxy replica's in-flight load per instance url: ``[requests, tokens]`` (P's tokens
    are the uncached ones it computes), the instances whose circuit it has open, and the
    prefill tokens it sent each instance lately (decaying over a minute: the ``kv`` policy's
    ties)."""

    instances: Annotated[dict[Url, tuple[Annotated[int, Field(ge=0, le=1_000_000)], Annotated[
        int, Field(ge=0, le=2**40)]]], Field(max_length=4096)]  # fmt: skip
    open_circuits: Annotated[list[Url], Field(max_length=4096)] = []
    recent: Annotated[dict[Url, Annotated[int, Field(ge=0, le=2**48)]], Field(
        max_length=4096)] = {}  # fmt: skip
    ttl_s: Annotated[float, Field(gt=0, le=60)] = 2.0


class LoadView(BaseModel):
    """What the other replicas reported and have not let expire, summed per instance url."""

    others: dict[str, tuple[int, int]]
    open_circuits: list[str]
    recent: dict[str, int] = {}
    replicas: int = Field(description="replicas reporting, this one included")
