"""The proxy in memory: a ``Runtime`` that is never started, wired to ``tests.proxy.mock``'s
doubles and driven through ``CompletionsHandler`` as an ASGI server would — no processes, no
sockets. ``settle()`` then checks that nothing was left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from pdservice.asgi import Message, Scope
from pdwire.params import push_report
from proxy.config import Flow, ProxySettings
from proxy.handler import CompletionsHandler
from proxy.instances import Instance, Role
from proxy.runtime import Runtime
from proxy.watcher import ON_DISCONNECT
from tests.proxy.mock import (
    MockBackend,
    MockEventClient,
    Outcome,
    RecordedAbandon,
    RecordedMark,
    Reply,
)

P_URL = "http://p0:8100"
D_URL = "http://d0:8200"
MS_URL = "http://ms:9000"
BINDING: dict[str, Any] = {"transfer_id": "from-the-metaserver", "decode_instance_id": "d0"}
PUSHED = Reply.completion("x", kv_transfer_params=push_report(None, None))  # P pushed
SSE = Reply.sse(["Hello", " world"])


def never() -> asyncio.Event:
    """A wait that lasts until the leg is cancelled."""
    return asyncio.Event()


def legs(backend: MockBackend) -> list[tuple[str, Outcome]]:
    """Each call's leg and outcome, sorted by leg."""
    return sorted((c.leg, c.outcome) for c in backend.calls)


async def wait_until(check: Callable[[], bool], spins: int = 1000) -> None:
    """Let the loop run until ``check()`` holds (everything is in memory: a few spins)."""
    for _ in range(spins):
        if check():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def sse_text(body: bytes) -> str:
    """The text of a completions event stream (error events left out)."""
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    objs = [msgspec.json.decode(e) for e in events]
    return "".join(o["choices"][0]["text"] for o in objs if "choices" in o)


class Exchange:
    """One client request through the handler. ``hook``: the scope carries the disconnect slot
    of ``proxy.server``'s protocol; otherwise the handler watches ``receive()``."""

    def __init__(
        self,
        handler: CompletionsHandler,
        path: str,
        body: bytes,
        hook: bool,
        extra: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        headers += extra
        self.scope: Scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        if hook:
            self.scope[ON_DISCONNECT] = None
        self._body: bytes | None = body
        self._gone = asyncio.Event()
        self._sent = asyncio.Event()
        self.messages: list[Message] = []
        self.task = asyncio.get_running_loop().create_task(
            handler(self.scope, self._receive, self._send)
        )

    async def _receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        self.messages.append(message)
        sent, self._sent = self._sent, asyncio.Event()
        sent.set()

    def disconnect(self) -> None:
        self._gone.set()
        hook = self.scope.get(ON_DISCONNECT)
        if hook is not None:
            hook()

    async def parts(self, count: int) -> None:
        """Wait until ``count`` body parts were sent to the client."""
        async with asyncio.timeout(1.0):
            while len(self._parts()) < count:
                await self._sent.wait()

    async def done(self) -> Exchange:
        await asyncio.wait_for(self.task, 1.0)
        return self

    def _parts(self) -> list[Message]:
        return [m for m in self.messages if m["type"] == "http.response.body"]

    @property
    def status(self) -> int | None:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return int(starts[0]["status"]) if starts else None

    @property
    def headers(self) -> dict[bytes, bytes]:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return dict(starts[0]["headers"]) if starts else {}

    @property
    def chunks(self) -> list[bytes]:
        return [bytes(m.get("body", b"")) for m in self._parts()]

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def ended(self) -> bool:
        parts = self._parts()
        return bool(parts) and not parts[-1].get("more_body", False)

    def json(self) -> Any:
        return msgspec.json.decode(self.body)


class InMemoryProxy:
    """One P, one D, a metaserver URL; no retries unless asked."""

    def __init__(self, backend: MockBackend, flow: Flow = Flow.DECODE_FIRST, **settings: Any):
        self.backend = backend
        self.event_client = MockEventClient()
        config: dict[str, Any] = {
            "prefill": [P_URL],
            "decode": [D_URL],
            "metaserver": MS_URL,
            "flow": flow,
            "retries": 0,
            "backoff_base_s": 0.0,
            **settings,
        }
        self.settings = ProxySettings(**config)
        self.runtime = rt = Runtime(self.settings)
        rt.registry.reconcile(Role.PREFILL, self.settings.prefill)
        rt.registry.reconcile(Role.DECODE, self.settings.decode)
        rt.wire(backend, self.event_client)
        self.handler = CompletionsHandler(rt)
        self._tasks_before = asyncio.all_tasks()

    @property
    def p(self) -> Instance:
        return self.runtime.registry.all(Role.PREFILL)[0]

    @property
    def d(self) -> Instance:
        return self.runtime.registry.all(Role.DECODE)[0]

    def request(
        self,
        *,
        stream: bool = False,
        chat: bool = False,
        hook: bool = False,
        headers: Sequence[tuple[bytes, bytes]] = (),
        extra: dict[str, Any] | None = None,
    ) -> Exchange:
        body: dict[str, Any] = {"model": "m", "max_tokens": 4, "stream": stream, **(extra or {})}
        if chat:
            body["messages"] = [{"role": "user", "content": "The quick brown fox " * 8}]
        else:
            body["prompt"] = "The quick brown fox " * 8
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return Exchange(self.handler, path, msgspec.json.encode(body), hook, headers)

    async def send(self, *, stream: bool = False) -> Exchange:
        return await self.request(stream=stream).done()

    @property
    def abandoned(self) -> list[RecordedAbandon]:
        """The ``abandoned`` marks the proxy posted: where it gave up on a transfer's KV."""
        return self.event_client.abandoned

    @property
    def marks(self) -> list[RecordedMark]:
        return self.event_client.marks

    def requests(self, outcome: str, status: int) -> float:
        """``pd_requests_total`` of this outcome and status (any endpoint, flow)."""
        rt = self.runtime
        total = 0.0
        for metric in rt.metrics.requests.collect():
            for s in metric.samples:
                if s.labels["outcome"] == outcome and s.labels["status"] == str(status):
                    total += s.value
        return total

    def metric(self, name: str, **labels: str) -> float | None:
        return self.runtime.metrics.registry.get_sample_value(name, labels)

    async def settle(self) -> None:
        """Let cancellations land and events go out, then check that nothing is left: no leg
        running, no task of this test pending, load and in-flight accounting back to zero."""
        for _ in range(3):
            await asyncio.sleep(0)
        rt = self.runtime
        assert rt.events is not None
        await rt.events.drain(1.0)
        assert self.backend.running == []
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() - self._tasks_before if t is not current]
        assert pending == []
        for inst in rt.registry.instances():
            assert (inst.inflight, inst.tokens) == (0, 0), inst
        assert rt.admission.inflight == 0
        assert self.metric("pd_inflight") == 0.0
