"""What a non-streamed answer must be before a client sees it: an OpenAI completion.

The proxy sends a client only what it read as the type it expects (``/v1/models``:
``proxy.model_list``). A decode engine's whole answer is checked to be a completion or a chat
completion (its ``object`` and a list of ``choices``; the rest is vLLM's to fill) before it goes
out, and the content type is the proxy's own, not the engine's. A streamed answer is relayed
event by event as its registered engine sends it (``proxy.sse``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class _Completion(msgspec.Struct):
    object: Literal["text_completion", "chat.completion"]
    choices: Annotated[list[msgspec.Raw], msgspec.Meta(min_length=1)]


_completion = msgspec.json.Decoder(_Completion)

JSON = b"application/json"
EVENT_STREAM = b"text/event-stream"


def not_a_completion(raw: bytes) -> str | None:
    """Why ``raw`` is not a completion; ``None`` when it is one."""
    try:
        _completion.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError included
        return f"the answer is not a completion ({exc})"
    return None


def not_an_event_stream(content_type: bytes) -> str | None:
    """Why an answer with this content type is not a streamed completion; ``None`` when it is
    an event stream."""
    if content_type.split(b";", 1)[0].strip().lower() == EVENT_STREAM:
        return None
    return f"the answer is not an event stream ({content_type[:64]!r})"
