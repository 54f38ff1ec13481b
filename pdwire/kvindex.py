"""The metaserver's KV-event index, as proxies ask it: which instances hold a prompt's blocks
(``POST /v1/kv/match``), and which prompts a proxy just sent where (``POST /v1/kv/placed``).

Keys are block hashes (``pdwire.block_hash``); the index follows the engines' KV events
(``metaserver.kvindex``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from pdwire.fields import Strict
from pdwire.ids import INSTANCE_ID_PATTERN

KV_MATCH_PATH = "/v1/kv/match"
KV_MATCH_MAX_KEYS = 8192
KV_MATCH_MAX_PRODUCT = 65_536  # keys x distinct instances in one match
BlockKey = Annotated[int, Field(ge=0, le=2**64 - 1)]


class KVMatchIn(Strict):
    """A prompt's block keys (``pdwire.block_hash``), first block first, and the instances
    to look them up for."""

    keys: Annotated[list[BlockKey], Field(max_length=KV_MATCH_MAX_KEYS)]
    instances: Annotated[list[Annotated[str, Field(pattern=INSTANCE_ID_PATTERN)]], Field(
        min_length=1, max_length=1024
    )]  # fmt: skip
    placed: bool = Field(
        default=True,
        description="count what proxies placed there lately (false: the engines' events only)",
    )

    @model_validator(mode="after")
    def _bounded(self) -> KVMatchIn:
        work = len(self.keys) * len(set(self.instances))
        if work > KV_MATCH_MAX_PRODUCT:
            raise ValueError(
                f"{len(self.keys)} keys x {len(set(self.instances))} instances is over "
                f"{KV_MATCH_MAX_PRODUCT} (keys x instances)"
            )
        return self


class KVMatchOut(BaseModel):
    matched: dict[str, int] = Field(description="per instance: leading keys it holds")


KV_PLACED_PATH = "/v1/kv/placed"
KV_PLACED_MAX = 64  # placements per call


class KVPlacement(Strict):
    """A prompt's block keys, first block first, and the instance a proxy just sent it to."""

    instance: Annotated[str, Field(pattern=INSTANCE_ID_PATTERN, max_length=128)]
    keys: Annotated[list[BlockKey], Field(min_length=1, max_length=KV_MATCH_MAX_KEYS)]


class KVPlacedIn(Strict):
    """Prompts proxies just sent: their keys count as held there for a few seconds
    (``metaserver.kvindex.index.PLACED_S``), until the engines' own events say so."""

    placed: Annotated[list[KVPlacement], Field(min_length=1, max_length=KV_PLACED_MAX)]
