"""The field types and limits the metaserver's bodies share, and their strict base.

Every request body is a ``Strict`` model: unknown fields are refused and a parsed body is
frozen. The limits bound what one body may carry (a binding's block ids, a TP group's ranks).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MAX_KV_GROUPS = 16
MAX_BLOCKS_PER_GROUP = 65_536
MAX_TP_SIZE = 1024

Name = Annotated[str, Field(min_length=1, max_length=256)]
Host = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._:\[\]-]+$")]
Port = Annotated[int, Field(ge=1, le=65535)]
BlockId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Label = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/+@-]+$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
