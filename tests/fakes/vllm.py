"""A fake vLLM OpenAI server speaking pdgate's ``kv_transfer_params`` contract.

Roles:
* ``decode``: a request with ``{"do_remote_prefill": true, "transfer_id": T}`` writes the binding
  ``PUT /v1/bindings/T`` to the metaserver (the instance registers itself at start), then waits
  for the prefill side's signal on its side channel (``POST /_fake/kv-stream`` or
  ``/_fake/kv/T``; the KV endpoint's port is this server's HTTP port) before streaming; on
  timeout it recomputes (or fails, by knob). A pull-style request (``remote_engine_id``…) is
  served at once (prefill-first flow).
* ``prefill``: ``{"do_remote_decode": true, "transfer_id": T, "decode": binding}`` signals D's
  side channel (one open channel per D, ``tests/fakes/signals.py``, as the connector's ZeroMQ
  socket; or a ``POST /_fake/kv/T`` each, by knob) and posts ``done`` to the metaserver (with
  the ``report_progress`` knob, first ``prefill_started`` and one ``pushing`` per chunk, and
  ``done`` carrying a push summary, as pdgate's connector does: ``connector/worker/half.py``
  ``_report_pushing``/``_report_end``, the summary in the format of
  ``pdwire/push_summary.py`` ``PushOverlap.message``); without ``decode`` (concurrent
  mode) it first long-polls the binding itself; without a transfer id (prefill-first) it
  answers with ``kv_transfer_params`` for D to pull.
* ``both``: either, by request.

Knobs (``POST /_fake/config`` with a JSON object, or flags): latency, errors, hangs, dropped
connections, and how P and D talk as the connector does (``batch_writes``: metaserver writes
batched as its writer does, ``tests/fakes/batching.py``, 1 sends each alone; ``kv_signal``).
``GET /_fake/requests`` returns what was received; ``GET /_fake/stats`` counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
import random
from collections import deque
from typing import Any

import aiohttp
from aiohttp import web

from pdwire.version import PROTOCOL_VERSION
from tests.fakes import render
from tests.fakes.batching import WriteBatcher
from tests.fakes.signals import SignalChannels


@dataclasses.dataclass
class Knobs:
    tokens: int = 16  # default answer length when the request sets no max_tokens
    first_token_delay_ms: float = 0.0
    token_delay_ms: float = 0.0
    prefill_delay_ms: float = 0.0
    error_status: int = 0  # answer every completion with this status
    error_rate: float = 0.0  # … or a random share of them with 500
    hang: bool = False  # accept and never answer
    drop_after: int = -1  # close the connection after this many streamed events
    stream_error_after: int = -1  # send a vLLM-style error event after this many events
    end_delay_ms: float = 0.0  # between a stream's [DONE] and the end of the response
    kv_timeout_s: float = 5.0
    kv_failure: str = "recompute"  # or "fail"
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens reported
    omit_kv_params: bool = False  # prefill-first: answer without kv_transfer_params
    health_status: int = 200
    health_delay_ms: float = 0.0  # answer /health this late (a busy engine)
    write_binding: bool = True  # decode: write the binding to the metaserver
    refuse_push: str = ""  # prefill: push nothing and say why, as pdgate's connector does
    report_progress: bool = False  # prefill: post prefill_started, pushing per chunk, done+summary
    push_chunks: int = 2  # with report_progress: pushing events (one per prefill chunk)
    batch_writes: int = 64  # metaserver writes per POST /v1/batch at most (1: each alone)
    kv_signal: str = "stream"  # P's done signal: "stream" (one open channel per D) or "post"
    record: bool = True


@dataclasses.dataclass
class Stats:
    requests: int = 0
    active: int = 0
    cancelled: int = 0
    unauthorized: int = 0  # calls refused for want of the API key
    kv_received: int = 0
    kv_timeouts: int = 0
    bindings_written: int = 0
    bindings_failed: int = 0
    signals_sent: int = 0


class FakeVLLM:
    def __init__(
        self,
        role: str,
        port: int,
        host: str,
        metaserver: str | None,
        iid: str,
        metaserver_token: str | None = None,
    ) -> None:
        self.role = role
        self.metaserver_token = metaserver_token
        self.port = port
        self.host = host
        self.metaserver = metaserver.rstrip("/") if metaserver else None
        self.instance_id = iid
        self.knobs = Knobs()
        self.stats = Stats()
        self.received: deque[dict[str, Any]] = deque(maxlen=2000)
        self.aborted: deque[str] = deque(maxlen=2000)
        self.kv_events: dict[str, asyncio.Event] = {}
        self.session: aiohttp.ClientSession | None = None
        self.writes: WriteBatcher | None = None  # the metaserver writes, as the connector sends
        self.signals: SignalChannels | None = None  # P's done signals to D, likewise
        self.background: set[asyncio.Task[Any]] = set()
        self.registered = False
        self.api_key = os.environ.get("VLLM_API_KEY") or None  # as vLLM's --api-key

    # ---- app -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[self._api_key])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/_fake/config", self.config)
        app.router.add_get("/_fake/requests", self.requests)
        app.router.add_get("/_fake/stats", self.get_stats)
        app.router.add_post("/_fake/reset", self.reset)
        app.router.add_post("/_fake/kv/{tid}", self.kv_signal)
        app.router.add_post("/_fake/kv-stream", self.kv_stream)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _api_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """vLLM's ``--api-key`` (``VLLM_API_KEY``), as its ``AuthenticationMiddleware`` has it
        (vllm/entrypoints/serve/middleware/authenticate.py, 0.32): paths under ``/v1``, ``/v2``,
        ``/inference`` and ``/cohere`` need ``Authorization: Bearer <key>``, else 401
        ``{"error": "Unauthorized"}``; ``/health`` and the rest stay open."""
        key = self.api_key
        if key and request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIX):
            scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                hashlib.sha256(given.encode()).digest(), hashlib.sha256(key.encode()).digest()
            )
            if not ok:
                self.stats.unauthorized += 1
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _start(self, app: web.Application) -> None:
        token = self.metaserver_token
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=512),
            headers={"authorization": f"Bearer {token}"} if token else None,
        )
        self.signals = SignalChannels(self.session)
        if self.metaserver:
            self.writes = WriteBatcher(self.session, self.metaserver, lanes=4)
            self._apply_knobs()
            self._spawn(self._heartbeat())

    def _apply_knobs(self) -> None:
        if self.writes is not None:
            self.writes.batch_max = self.knobs.batch_writes

    async def _stop(self, app: web.Application) -> None:
        for task in list(self.background):
            task.cancel()
        if self.signals:
            await self.signals.close()
        if self.session:
            await self.session.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _heartbeat(self) -> None:
        spec = {
            "role": self.role,
            "url": f"http://{self.host}:{self.port}",
            "kv_endpoint": {"host": self.host, "port": self.port},  # the side channel
            "model": render.MODEL,
            "ttl_s": 30,
        }
        assert self.session is not None
        while True:
            ok = False
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.session.put(
                    f"{self.metaserver}/v1/instances/{self.instance_id}", json=spec
                ) as r:
                    await r.read()
                    ok = r.status < 300
            self.registered = self.registered or ok
            await asyncio.sleep(5 if ok else 0.2)

    # ---- control -------------------------------------------------------------------------
    async def config(self, request: web.Request) -> web.Response:
        updates = await request.json()
        for key, value in updates.items():
            if not hasattr(self.knobs, key):
                return web.json_response({"error": f"unknown knob {key}"}, status=400)
            setattr(self.knobs, key, value)
        self._apply_knobs()
        return web.json_response(dataclasses.asdict(self.knobs))

    async def requests(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.received))

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response({**dataclasses.asdict(self.stats), "aborted": list(self.aborted)})

    async def reset(self, request: web.Request) -> web.Response:
        self.knobs = Knobs()
        self._apply_knobs()
        self.stats = Stats()
        self.received.clear()
        self.aborted.clear()
        return web.json_response({})

    async def health(self, request: web.Request) -> web.Response:
        if self.metaserver and not self.registered:
            return web.Response(status=503, text="not registered yet")
        if self.knobs.health_delay_ms:
            await asyncio.sleep(self.knobs.health_delay_ms / 1000)
        return web.Response(status=self.knobs.health_status)

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": render.MODEL, "object": "model", "created": 1, "owned_by": "fake"}]
        return web.json_response({"object": "list", "data": data})

    async def kv_signal(self, request: web.Request) -> web.Response:
        tid = request.match_info["tid"]
        self.kv_events.setdefault(tid, asyncio.Event()).set()
        return web.Response(status=204)

    async def kv_stream(self, request: web.Request) -> web.Response:
        """P's side channel (``tests/fakes/signals.py``): a transfer id per line, for as long
        as P keeps the request open."""
        async for line in request.content:
            if tid := line.strip().decode():
                self.kv_events.setdefault(tid, asyncio.Event()).set()
        return web.Response(status=204)

    # ---- completions ---------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.stats.requests += 1
        self.stats.active += 1
        kv = body.get("kv_transfer_params") or {}
        if self.knobs.record:
            self.received.append(
                {"path": request.path, "body": body, "x_request_id": request.headers.get(
                    "x-request-id"), "authorization": request.headers.get("authorization")}
            )  # fmt: skip
        try:
            return await self._answer(request, body, kv, chat)
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            self.aborted.append(str(kv.get("transfer_id") or request.headers.get("x-request-id")))
            raise
        finally:
            self.stats.active -= 1

    async def _answer(
        self, request: web.Request, body: dict[str, Any], kv: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        k = self.knobs
        if k.hang:
            await asyncio.sleep(3600)
        if k.error_status or (k.error_rate and random.random() < k.error_rate):
            status = k.error_status or 500
            return web.Response(
                status=status, body=render.error_body("injected error", status),
                content_type="application/json",
            )  # fmt: skip
        prefill_leg = bool(kv.get("do_remote_decode"))
        cached = k.cached_tokens
        extra: dict[str, Any] = {}
        if prefill_leg:
            await self._prefill(kv, extra)
        elif kv.get("do_remote_prefill") and kv.get("transfer_id"):
            failed = await self._await_kv(kv, body)
            if failed is not None:
                return failed
        prompt = body.get("prompt") if not chat else body.get("messages")
        prompt_tokens = max(1, len(json.dumps(prompt)) // 4)
        n = int(body.get("n") or 1)
        tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or k.tokens)
        logprobs = bool(body.get("logprobs"))
        if k.first_token_delay_ms:
            await asyncio.sleep(k.first_token_delay_ms / 1000)
        u = render.usage(prompt_tokens, tokens * n, cached)
        if not body.get("stream"):
            data = render.full_body(chat, tokens, n, logprobs, u, extra)
            return web.Response(body=data, content_type="application/json")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        events = render.stream_chunks(chat, tokens, n, logprobs, bool(body.get("return_token_ids")))
        for i, event in enumerate(events):
            if i == k.drop_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            if i == k.stream_error_after:
                err = {"error": {"message": "injected stream error", "code": 500}}
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                await resp.write(render.DONE)
                return resp
            if k.token_delay_ms and i:
                await asyncio.sleep(k.token_delay_ms / 1000)
            await resp.write(event)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(render.usage_event(chat, u))
        await resp.write(render.DONE)
        if k.end_delay_ms:
            await asyncio.sleep(k.end_delay_ms / 1000)
        await resp.write_eof()
        return resp

    async def _prefill(self, kv: dict[str, Any], extra: dict[str, Any]) -> None:
        k = self.knobs
        if k.prefill_delay_ms:
            await asyncio.sleep(k.prefill_delay_ms / 1000)
        tid = kv.get("transfer_id")
        if not tid:  # prefill-first: hand D the pull parameters
            if not k.omit_kv_params:
                extra["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.instance_id,
                    "remote_block_ids": [1, 2, 3],
                    "remote_host": self.host,
                    "remote_port": self.port,
                }
            return
        if k.refuse_push:
            extra["kv_transfer_params"] = {
                "transfer_id": tid, "push": "none", "reason": k.refuse_push
            }  # fmt: skip
            return
        extra["kv_transfer_params"] = {"transfer_id": tid, "push": "started"}
        binding = kv.get("decode")
        assert self.session is not None
        if binding is None:  # concurrent mode: fetch the binding ourselves
            async with self.session.get(
                f"{self.metaserver}/v1/bindings/{tid}", params={"wait": "10"}
            ) as r:
                if r.status != 200:
                    raise web.HTTPInternalServerError(text=f"no binding for {tid}")
                binding = await r.json()
        ep = binding["kv_endpoint"]
        summary = None
        if self.metaserver and k.report_progress:
            summary = await self._report_progress(tid)
        if k.kv_signal == "stream":
            assert self.signals is not None
            self.signals.send(ep["host"], ep["port"], tid)
        else:
            async with self.session.post(f"http://{ep['host']}:{ep['port']}/_fake/kv/{tid}") as r:
                await r.read()
        self.stats.signals_sent += 1
        if self.metaserver:
            detail = None if summary is None else {"bytes_pushed": 4096, "message": summary}
            self._spawn(self._post_event(tid, "done", detail))

    async def _report_progress(self, tid: str) -> str:
        """``prefill_started`` and a ``pushing`` per chunk (bytes so far), each written before
        the next step like the connector's ordered background writer; returns the ``done``
        summary (``PushOverlap.message`` format: the last chunk's push partly exposed)."""
        await self._post_event(tid, "prefill_started")
        chunks = max(1, self.knobs.push_chunks)
        started = asyncio.get_running_loop().time()
        for i in range(chunks):
            await asyncio.sleep(0.02)
            await self._post_event(tid, "pushing", {"bytes_pushed": 4096 * (i + 1) // chunks})
        push_s = asyncio.get_running_loop().time() - started
        return (
            f"push_s={push_s:.6f} exposed_s={push_s / chunks / 2:.6f} "
            f"tail_s={push_s / chunks / 2 + 0.001:.6f} hidden={1 - 0.5 / chunks:.3f} "
            f"writes={chunks} p_end_at=0.000000"
        )

    async def _post_event(
        self, tid: str, state: str, detail: dict[str, Any] | None = None, actor: str = ""
    ) -> None:
        body: dict[str, Any] = {"state": state, "actor": actor or f"prefill:{self.instance_id}"}
        if detail is not None:
            body["detail"] = detail
        assert self.writes is not None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            await self.writes.write("POST", f"/v1/bindings/{tid}/events", body)

    async def _await_kv(self, kv: dict[str, Any], body: dict[str, Any]) -> web.Response | None:
        tid = str(kv["transfer_id"])
        event = self.kv_events.setdefault(tid, asyncio.Event())
        bound: asyncio.Task[None] | None = None
        if self.metaserver and self.knobs.write_binding:
            bound = asyncio.get_running_loop().create_task(self._bind(tid))
        try:
            if bound is not None:
                await asyncio.shield(bound)
            await asyncio.wait_for(event.wait(), self.knobs.kv_timeout_s)
            self.stats.kv_received += 1
        except asyncio.CancelledError:
            # dropped while it bound or waited for its KV: D ends its own binding, as the
            # connector's scheduler does (connector/scheduler/decode.py, ``finished``), and after
            # the binding's own write: the connector's writer keeps one binding's calls in order
            # (pdwire/client/writer.py); an abort overtaking the PUT would leave it bound
            if bound is not None:
                self._spawn(self._abort_after(bound, tid))
            raise
        except TimeoutError:
            self.stats.kv_timeouts += 1
            if self.knobs.kv_failure == "fail":
                return web.Response(
                    status=500, body=render.error_body(f"KV for {tid} never arrived", 500),
                    content_type="application/json",
                )  # fmt: skip
        finally:
            self.kv_events.pop(tid, None)
        return None

    async def _bind(self, tid: str) -> None:
        spec = {
            "request_id": f"req-{tid}",
            "decode_instance_id": self.instance_id,
            "engine_id": self.instance_id,
            "kv_endpoint": {"host": self.host, "port": self.port},
            "block_size": 16,
            "block_ids": [[0]],
            "num_prompt_tokens": 16,
            "protocol": PROTOCOL_VERSION,
        }
        assert self.writes is not None
        status, _ = await self.writes.write("PUT", f"/v1/bindings/{tid}", spec)
        if status < 300:
            self.stats.bindings_written += 1
        else:
            self.stats.bindings_failed += 1

    async def _abort_after(self, bound: asyncio.Task[None], tid: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            await bound
        detail = {"message": "D's request was aborted while it waited for the KV"}
        await self._post_event(tid, "aborted", detail, self.instance_id)


GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.fakes.vllm", description=__doc__)
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metaserver", default=None)
    p.add_argument("--instance-id", default=None)
    p.add_argument("--metaserver-token", default=None, help="bearer token for its writes")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--no-record", action="store_true", help="do not keep received requests")
    args = p.parse_args(argv)
    iid = args.instance_id or f"{args.role}-{args.port}"
    fake = FakeVLLM(args.role, args.port, args.host, args.metaserver, iid, args.metaserver_token)
    fake.knobs.tokens = args.tokens
    fake.knobs.record = not args.no_record
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
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
