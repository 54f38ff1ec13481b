"""The client's first token from P: decode-first and concurrent, streamed greedy requests.

P's answer (``max_tokens`` 1) holds the answer's first token, and under greedy sampling D's first
token is the same one (``proxy.integrity`` checks it); D reaches it only after it has the
prompt's KV and has run a step of its own. So when P answers before D's first token is in, the
client gets P's token at once — chat: the role chunk, then the content — and D's stream follows
without its first token: ``hook`` drops that token's text and id (checked to be P's) and gives
every later event the stream's ``id``, ``created`` and ``model`` (P's answer's): one answer.

Which requests (``EarlyFirst.of``): streamed; greedy (``judged``); whose answer could go on
elsewhere (a migration tape: anything that fails after P's token went out is a break like any
other mid-stream one); no logprobs, token ids not asked for; and P's token has text of its own
(not a special token, not part of a character). Runs on the event loop, per request.
"""

from __future__ import annotations

import time
from typing import Any

from pdservice.asgi import Send
from proxy.config import Flow
from proxy.errors import UpstreamError
from proxy.flows.base import PrefillAnswer
from proxy.integrity import judged, prefill_first
from proxy.metrics import Metrics
from proxy.migration import Tape
from proxy.rewrite import ClientRequest, decode, encode

FLOWS = frozenset({Flow.DECODE_FIRST, Flow.CONCURRENT})
_CHOICES = b',"choices"'
_HEAD_MAX = 512  # where an event's ``,"choices"`` may start (after id, object, created, model)


class EarlyFirst:
    __slots__ = ("_chat", "_counts", "_head", "_headers", "_pending", "_send", "_tape",
                 "_text", "_token", "at", "sent")  # fmt: skip

    def __init__(
        self,
        req: ClientRequest,
        tape: Tape,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        metrics: Metrics,
    ) -> None:
        self._chat = req.chat
        self._tape = tape
        self._send = send
        self._headers = headers  # the stream's response headers
        self._counts = metrics.early_first_tokens
        self._token: int | None = None
        self._text = ""
        self._head = b""  # the stream's id, object, created and model: every event's start
        self._pending = False  # D's first token is still to be dropped
        self.sent = False
        self.at = 0.0  # perf_counter when P's token went out

    @classmethod
    def of(
        cls,
        req: ClientRequest,
        tape: Tape | None,
        flow: Flow,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        metrics: Metrics,
    ) -> EarlyFirst | None:
        """One for ``req`` when its first token may come from P; else ``None``."""
        body = req.body
        if (
            tape is None
            or flow not in FLOWS
            or not judged(body)
            or body.get("logprobs")
            or body.get("top_logprobs")
            or body.get("return_token_ids")
        ):
            return None
        return cls(req, tape, send, headers, metrics)

    async def offer(self, answer: PrefillAnswer) -> None:
        """Send P's first token, once per request, as the stream's first event(s)."""
        if self.sent:
            return
        first = prefill_first(answer.choices, self._chat)
        text, token = first.text, first.token_id
        if not text or "\ufffd" in text or token is None or not isinstance(answer.id, str):
            self._counts.labels("unsent").inc()
            return
        created = answer.created if isinstance(answer.created, int) else int(time.time())
        model = answer.model if isinstance(answer.model, str) else ""
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        head = {"id": answer.id, "object": obj, "created": created, "model": model}
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
        out = b""
        if self._chat:
            role = {**choice, "delta": {"role": "assistant", "content": ""}}
            out += b"data: " + encode({**head, "choices": [role]}) + b"\n\n"
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["token_ids"] = [token]  # for the tape; hidden from the client
        out += b"data: " + self._tape.take(encode({**head, "choices": [choice]}), True) + b"\n\n"
        self._token, self._text = token, text
        self._head = encode(head)[:-1]
        self._pending = True
        self.sent = True
        await self._send({"type": "http.response.start", "status": 200, "headers": self._headers})
        await self._send({"type": "http.response.body", "body": out, "more_body": True})
        self.at = time.perf_counter()
        self._counts.labels("sent").inc()

    def hook(self, payload: bytes) -> bytes | None:
        """One event of D's stream (``proxy.sse``): its first token dropped, restamped as the
        stream's, recorded on the tape with the ids hidden."""
        if self._pending:
            got = self._first(payload)
            if got is None:
                return None
            payload = got
        if self._head and payload.startswith(b'{"id"'):
            cut = payload.find(_CHOICES, 0, _HEAD_MAX)
            if cut > 0:
                payload = self._head + payload[cut:]
        return self._tape.take(payload, True)

    def _first(self, payload: bytes) -> bytes | None:
        """Until D's first token: D's role chunk dropped (the client has P's), the token's
        text and id taken out of the event that carries it."""
        obj = decode(payload)
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not choices or not isinstance(choices[0], dict):
            return payload  # usage or an error: not a token
        tape = self._tape
        if tape.prompt_ids is None:  # D's, for a continuation should D break later
            ids = obj.get("prompt_token_ids") or choices[0].get("prompt_token_ids")
            if isinstance(ids, list):
                tape.prompt_ids = ids
        ch = choices[0]
        ids = ch.get("token_ids")
        delta = ch.get("delta") if self._chat else None
        text = (
            (delta.get("content") if isinstance(delta, dict) else None)
            if self._chat
            else ch.get("text")
        )
        if not ids:
            if not text and ch.get("finish_reason") is None:
                return None  # the role chunk
            raise self._diverged("D's first event carries no token id")
        if ids[0] != self._token or not isinstance(text, str) or not text.startswith(self._text):
            raise self._diverged(f"D's first token is not P's ({ids[0]} vs {self._token})")
        self._pending = False
        ch["token_ids"] = ids[1:]
        rest = text[len(self._text) :]
        if self._chat:
            assert isinstance(delta, dict)
            delta["content"] = rest
            delta.pop("role", None)
        else:
            ch["text"] = rest
        if not ids[1:] and not rest and ch.get("finish_reason") is None:
            return None
        if "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = None
        ch.pop("prompt_token_ids", None)
        return encode(obj)

    def _diverged(self, why: str) -> UpstreamError:
        """D's stream does not go on from P's token: a break, continued elsewhere from it."""
        self._pending = False
        self._counts.labels("diverged").inc()
        return UpstreamError(why)
