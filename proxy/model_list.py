"""``GET /v1/models``: an engine's model list, parsed and built anew before a client sees it.

The proxy never relays an engine's body it did not read as the type it expects: a registered
URL may name any service that answers HTTP, and passing its body through turned the proxy into
a window onto it. Fields are those of vLLM's ``ModelCard`` (``vllm/entrypoints/openai``);
anything else an answer carries is dropped.
"""

from __future__ import annotations

from typing import Annotated, Literal

import aiohttp
import msgspec

_Text = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class ModelCard(msgspec.Struct, kw_only=True):
    id: _Text
    object: Literal["model"] = "model"
    created: Annotated[int, msgspec.Meta(ge=0)]
    owned_by: Annotated[str, msgspec.Meta(max_length=512)]
    root: _Text | None = None
    parent: _Text | None = None
    max_model_len: Annotated[int, msgspec.Meta(ge=1)] | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: Annotated[list[ModelCard], msgspec.Meta(max_length=1024)]


MAX_BYTES = 1 << 20  # a list of a thousand models fits many times over
_decode = msgspec.json.Decoder(ModelList)
_encode = msgspec.json.Encoder()


async def read_capped(content: aiohttp.StreamReader, limit: int = MAX_BYTES) -> bytes | None:
    """The whole body, or ``None`` once it grows past ``limit``."""
    body = bytearray()
    async for chunk in content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def rebuilt(body: bytes | None) -> bytes | None:
    """``body`` as a model list, re-encoded from its parsed fields; ``None`` when it is not
    one."""
    if body is None:
        return None
    try:
        return _encode.encode(_decode.decode(body))
    except msgspec.DecodeError:  # ValidationError included
        return None
