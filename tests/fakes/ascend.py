"""A fake vllm-ascend OpenAI server whose KV connector is ``MooncakeLayerwiseConnector``.

Derived from vllm-project/vllm-ascend (HEAD 182b75e, 2026-08),
``vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_layerwise_connector.py``:

* request ids: vLLM's OpenAI server names the engine requests ``cmpl-<X-Request-Id>-<i>`` (one
  per prompt of a completions batch) or ``chatcmpl-<X-Request-Id>``; the connector strips the
  engine's 9-character suffix again (``get_external_request_id``), so these are the ids on the
  wire.
* decode (``MooncakeLayerwiseConnectorScheduler.update_state_after_alloc``, consumer branch):
  for ``kv_transfer_params.do_remote_prefill`` it allocates the prompt's blocks and POSTs
  ``{token_ids: [], request_id, do_remote_prefill: false, do_remote_decode: true,
  remote_block_ids, remote_block_size, remote_engine_id, remote_host, remote_port,
  remote_tp_size, remote_pcp_size, remote_dcp_size, remote_cached_tokens}`` to
  ``kv_transfer_params.metaserver`` in the background (``_access_metaserver``: no auth header,
  3 tries on transport errors, the answer's status ignored), then waits until P signals the
  request over the side channel. The side channel is ``KVCacheRecvingLayerThread.run``: a ZMQ
  ROUTER on ``remote_host:remote_port`` taking msgpack tuples ``(b"done_sending_msg", id,
  trans_count, "p_host:p_port")`` / ``(b"failed_sending_msg", id, ...)`` and answering
  ``b"ACK"`` (``update_done_task``: done once ``trans_count`` distinct senders reported). A
  failed transfer fails the request (``kv_load_failure_policy="fail"``); the real engine waits
  for ever when nothing comes, the fake gives up after ``kv_timeout_s`` with a 500.
* prefill (producer branch of ``update_state_after_alloc`` and ``build_connector_meta``): reads
  ``kv_transfer_params["remote_cached_tokens"]`` (missing: the engine fails the request) and the
  ``remote_*`` fields; every engine request of the HTTP request uses that same top-level dict
  (``batch_kv_transfer_params`` is not read by this connector), so each child's push goes to
  the top-level ``remote_block_ids``; after the last layer ``send_done_send_signal`` sends
  ``(DONE_SENDING_MSG, <its own external id>, trans_count, "host:port")`` with a ZMQ REQ to
  ``remote_host:remote_port``, up to 3 tries of 1 s for the ACK. ``request_finished`` returns
  ``(False, None)``: P's answer carries no ``kv_transfer_params``.

Knobs: ``POST /_fake/config``; ``GET /_fake/requests`` what was received, ``GET /_fake/stats``
counters, the metaserver answers D got and the pushes P made (request id → block ids).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import uuid
from collections import deque
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from tests.fakes import render

DONE_SENDING_MSG = b"done_sending_msg"
FAILED_SENDING_MSG = b"failed_sending_msg"
GET_META_MSG = b"get_meta_msg"
BLOCK_SIZE = 128


@dataclasses.dataclass
class Knobs:
    tokens: int = 16
    first_token_delay_ms: float = 0.0
    prefill_delay_ms: float = 0.0
    error_status: int = 0  # answer every completion with this status
    hang: bool = False  # accept and never answer
    drop_after: int = -1  # close the connection after this many streamed events
    kv_timeout_s: float = 5.0
    post_metaserver: bool = True  # decode: post the blocks (off: a connector that never does)
    fail_push: bool = False  # prefill: send FAILED_SENDING_MSG instead of DONE
    record: bool = True


@dataclasses.dataclass
class Stats:
    requests: int = 0
    cancelled: int = 0
    kv_received: int = 0
    kv_failed: int = 0
    kv_timeouts: int = 0
    metaserver_posts: int = 0
    signals_sent: int = 0


def request_ids(x_request_id: str, chat: bool, body: dict[str, Any]) -> list[str]:
    """vLLM's OpenAI server: ``chatcmpl-X`` / ``cmpl-X-<prompt index>``."""
    if chat:
        return [f"chatcmpl-{x_request_id}"]
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt)
    return [f"cmpl-{x_request_id}-{i}" for i in range(len(prompt) if batch else 1)]  # type: ignore[arg-type]


class FakeAscend:
    def __init__(self, role: str, port: int, host: str, kv_port: int, engine_id: str) -> None:
        self.role = role
        self.port = port
        self.host = host
        self.kv_port = kv_port  # D: its side channel (ROUTER); P: the path it names itself by
        self.engine_id = engine_id
        self.knobs = Knobs()
        self.stats = Stats()
        self.received: deque[dict[str, Any]] = deque(maxlen=2000)
        self.aborted: deque[str] = deque(maxlen=2000)
        self.metaserver_answers: deque[list[Any]] = deque(maxlen=2000)
        self.pushes: deque[list[Any]] = deque(maxlen=2000)  # P: [request id, remote_block_ids]
        self.waiting: dict[str, asyncio.Future[bool]] = {}  # D: id → done (True) / failed
        self.senders: dict[str, set[str]] = {}
        self._blocks = itertools.count(1)
        # D's scheduler posts from a ThreadPoolExecutor(32) with a blocking client: at most 32
        # posts in flight per engine, the rest queue (MooncakeLayerwiseConnectorScheduler)
        self._posting = asyncio.Semaphore(32)
        self.session: aiohttp.ClientSession | None = None
        self.zmq = zmq.asyncio.Context()
        self.background: set[asyncio.Task[Any]] = set()
        self._req_sockets: dict[tuple[str, int], list[zmq.asyncio.Socket]] = {}
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(type=tuple)

    # ---- app -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/_fake/config", self.config)
        app.router.add_get("/_fake/requests", self.requests)
        app.router.add_get("/_fake/stats", self.get_stats)
        app.router.add_post("/_fake/reset", self.reset)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if self.role == "decode":
            self._spawn(self._side_channel())

    async def _stop(self, app: web.Application) -> None:
        for task in list(self.background):
            task.cancel()
        if self.session:
            await self.session.close()
        self.zmq.destroy(linger=0)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # ---- control -------------------------------------------------------------------------
    async def config(self, request: web.Request) -> web.Response:
        updates = await request.json()
        for key, value in updates.items():
            if not hasattr(self.knobs, key):
                return web.json_response({"error": f"unknown knob {key}"}, status=400)
            setattr(self.knobs, key, value)
        return web.json_response(dataclasses.asdict(self.knobs))

    async def requests(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.received))

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                **dataclasses.asdict(self.stats),
                "aborted": list(self.aborted),
                "metaserver_answers": list(self.metaserver_answers),
                "pushes": list(self.pushes),
            }
        )

    async def reset(self, request: web.Request) -> web.Response:
        self.knobs = Knobs()
        self.stats = Stats()
        for q in (self.received, self.aborted, self.metaserver_answers, self.pushes):
            q.clear()
        return web.json_response({})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": render.MODEL, "object": "model", "created": 1, "owned_by": "fake"}]
        return web.json_response({"object": "list", "data": data})

    # ---- D's side channel (KVCacheRecvingLayerThread.run) ----------------------------------
    async def _side_channel(self) -> None:
        sock = self.zmq.socket(zmq.ROUTER)
        sock.bind(f"tcp://{self.host}:{self.kv_port}")
        try:
            while True:
                frames = await sock.recv_multipart()
                identity, payload = frames[0], [f for f in frames[1:] if f != b""]
                if len(payload) != 1:
                    continue
                msg = self._dec.decode(payload[0])
                if msg[0] == GET_META_MSG:
                    await sock.send_multipart((identity, b"", self._enc.encode({})))
                    continue
                rid = str(msg[1])
                if msg[0] == DONE_SENDING_MSG:
                    senders = self.senders.setdefault(rid, set())
                    senders.add(str(msg[3]))
                    if len(senders) == int(msg[2]):
                        self.senders.pop(rid, None)
                        self._settle(rid, True)
                elif msg[0] == FAILED_SENDING_MSG:
                    self.senders.pop(rid, None)
                    self._settle(rid, False)
                await sock.send_multipart((identity, b"", b"ACK"))
        finally:
            sock.close(linger=0)

    def _settle(self, rid: str, ok: bool) -> None:
        fut = self.waiting.get(rid)
        if fut is not None and not fut.done():
            fut.set_result(ok)

    # ---- completions ---------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.stats.requests += 1
        x_request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        ids = request_ids(x_request_id, chat, body)
        if self.knobs.record:
            self.received.append(
                {
                    "path": request.path,
                    "body": body,
                    "x_request_id": x_request_id,
                    "ids": ids,
                    "traceparent": request.headers.get("traceparent"),
                }
            )
        try:
            return await self._answer(request, body, ids, chat)
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            self.aborted.extend(ids)
            raise
        finally:
            for rid in ids:
                self.waiting.pop(rid, None)

    async def _answer(
        self, request: web.Request, body: dict[str, Any], ids: list[str], chat: bool
    ) -> web.StreamResponse:
        k = self.knobs
        if k.hang:
            await asyncio.sleep(3600)
        if k.error_status:
            return _error(k.error_status, "injected error")
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            failed = await self._prefill(kv, ids)
            if failed is not None:
                return failed
        elif kv.get("do_remote_prefill"):
            failed = await self._await_kv(kv, body, ids, chat)
            if failed is not None:
                return failed
        prompt = body.get("messages") if chat else body.get("prompt")
        prompt_tokens = max(1, len(json.dumps(prompt)) // 4)
        n = int(body.get("n") or 1) * len(ids)
        tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or k.tokens)
        if k.first_token_delay_ms:
            await asyncio.sleep(k.first_token_delay_ms / 1000)
        u = render.usage(prompt_tokens, tokens * n, None)
        if not body.get("stream"):
            extra = {"kv_transfer_params": None}
            return web.Response(
                body=render.full_body(chat, tokens, n, False, u, extra),
                content_type="application/json",
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i, event in enumerate(render.stream_chunks(chat, tokens, n, False)):
            if i == k.drop_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write(event)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(render.usage_event(chat, u))
        await resp.write(render.DONE)
        await resp.write_eof()
        return resp

    # ---- D: update_state_after_alloc + waiting for the push ---------------------------------
    def _allocate(self, prompt_tokens: int) -> list[list[int]]:
        return [[next(self._blocks) for _ in range(-(-prompt_tokens // BLOCK_SIZE))]]

    async def _await_kv(
        self, kv: dict[str, Any], body: dict[str, Any], ids: list[str], chat: bool
    ) -> web.Response | None:
        prompt = body.get("messages") if chat else body.get("prompt")
        prompts = prompt if (not chat and len(ids) > 1 and isinstance(prompt, list)) else [prompt]
        loop = asyncio.get_running_loop()
        futures = []
        for rid, p in zip(ids, prompts, strict=True):
            fut: asyncio.Future[bool] = loop.create_future()
            self.waiting[rid] = fut
            futures.append(fut)
            message = {
                "token_ids": [],
                "request_id": rid,
                "do_remote_prefill": False,
                "do_remote_decode": True,
                "remote_block_ids": self._allocate(max(1, len(json.dumps(p)) // 4)),
                "remote_block_size": [BLOCK_SIZE],
                "remote_engine_id": self.engine_id,
                "remote_host": self.host,
                "remote_port": self.kv_port,
                "remote_tp_size": 1,
                "remote_pcp_size": 1,
                "remote_dcp_size": 1,
                "remote_cached_tokens": 0,
            }
            if self.knobs.post_metaserver:
                self._spawn(self._access_metaserver(str(kv.get("metaserver")), message))
        try:
            async with asyncio.timeout(self.knobs.kv_timeout_s):
                results = await asyncio.gather(*futures)
        except TimeoutError:
            self.stats.kv_timeouts += 1
            return _error(500, "KV never arrived")
        if not all(results):
            self.stats.kv_failed += 1
            return _error(500, "KV transfer failed (kv_load_failure_policy=fail)")
        self.stats.kv_received += 1
        return None

    async def _access_metaserver(self, url: str, message: dict[str, Any]) -> None:
        """``_access_metaserver``: 3 tries on transport errors; the status is not checked."""
        assert self.session is not None
        async with self._posting:
            for attempt in range(3):
                try:
                    async with self.session.post(url, json=message) as r:
                        await r.read()  # the example proxy answers only once P has finished
                        if self.knobs.record:
                            self.metaserver_answers.append([message["request_id"], r.status])
                    self.stats.metaserver_posts += 1
                    return
                except (aiohttp.ClientError, OSError):
                    if attempt == 2 and self.knobs.record:
                        self.metaserver_answers.append([message["request_id"], 0])

    # ---- P: push, then signal D ------------------------------------------------------------
    async def _prefill(self, kv: dict[str, Any], ids: list[str]) -> web.Response | None:
        required = ("remote_cached_tokens", "remote_host", "remote_port", "remote_block_ids")
        missing = [key for key in required if key not in kv]
        if missing:
            return _error(500, f"kv_transfer_params lacks {missing}")
        if self.knobs.prefill_delay_ms:
            await asyncio.sleep(self.knobs.prefill_delay_ms / 1000)
        for rid in ids:  # every child pushes with the same top-level params
            if self.knobs.record:
                self.pushes.append([rid, kv["remote_block_ids"]])
            await self._signal(str(kv["remote_host"]), int(kv["remote_port"]), rid)
        return None

    async def _signal(self, host: str, port: int, rid: str) -> None:
        """One REQ/ACK exchange per signal, 1 s for the ACK, 3 tries. (The connector opens a
        socket per message; the fake reuses idle REQ sockets per destination: the same bytes
        on the wire, less CPU in a benchmark where the fake shares the cores.)"""
        kind = FAILED_SENDING_MSG if self.knobs.fail_push else DONE_SENDING_MSG
        data = self._enc.encode((kind, rid, 1, f"{self.host}:{self.kv_port}"))
        idle = self._req_sockets.setdefault((host, port), [])
        for _ in range(3):
            if idle:
                sock = idle.pop()
            else:
                sock = self.zmq.socket(zmq.REQ)
                sock.connect(f"tcp://{host}:{port}")
            ok = False
            try:
                await sock.send(data)
                if await sock.poll(1000):
                    ok = await sock.recv() == b"ACK"
            finally:
                if ok:
                    idle.append(sock)
                else:  # a REQ socket that missed its reply cannot send again
                    sock.close(linger=0)
            if ok:
                self.stats.signals_sent += 1
                return
            await asyncio.sleep(0.1)


def _error(status: int, message: str) -> web.Response:
    return web.Response(
        status=status, body=render.error_body(message, status), content_type="application/json"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.fakes.ascend", description=__doc__)
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kv-port", type=int, required=True)
    p.add_argument("--instance-id", dest="engine_id", default=None, help="the engine id")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--no-record", action="store_true", help="do not keep received requests")
    args = p.parse_args(argv)
    fake = FakeAscend(
        args.role, args.port, args.host, args.kv_port, args.engine_id or uuid.uuid4().hex
    )
    fake.knobs.tokens = args.tokens
    fake.knobs.record = not args.no_record
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    web.run_app(
        fake.app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=1.0,
    )


if __name__ == "__main__":
    main()
