"""The session's first deployment — the monolithic reference engine and the traced 2P2D
deployment on a Redis of its own — started when the session starts, in the CPU time the unit
tests before it leave idle.

Its processes start at the lowest CPU priority (``nice -n 19``: the unit tests meanwhile keep
the cores they use, the engines load on what is left, and their heartbeats still get a slice
when every core is busy) and go back to the normal priority (``wake``) when the first
end-to-end test asks for them: from then on they are ordinary engines. Five engines starting
at once took 427 s of a CI run's setup; started this way they are ready, or nearly, when the
end-to-end tests begin."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from launch.options import Child
from launch.plan import build_plan
from launch.supervisor import Supervisor, group_members
from tests.e2e.stack import (
    ENGINE_ARGS,
    KV_EVENTS_AT,
    KV_PLACED_S,
    PROXY_ARGS,
    Deployment,
    base_options,
    deploy,
    monolithic_child,
    start,
)
from tests.support.otlp import OtlpReceiver
from tests.support.services import RedisServer

# Fault-free correctness suites: a CI run saw the whole 2-core machine stall for 10 s
# (heartbeats 10 s late), and a Mooncake write then hit the connector's default 10 s deadline,
# a real failure the suites here do not test for. The fault suites keep 10 s.
STALL_TOLERANT_WRITE_TIMEOUT_S = 30
LOWEST = ["nice", "-n", "19"]


def lowest(child: Child) -> Child:
    """``child`` started at the lowest CPU priority (its own children inherit it)."""
    return replace(child, argv=[*LOWEST, *child.argv])


@dataclass
class First:
    model: Path
    redis: RedisServer
    traces: OtlpReceiver
    mono: Supervisor
    mono_url: str
    pd: Deployment | None  # None: no test of the run uses it
    woken: bool = False

    @classmethod
    def start(cls, model: Path, log_dir: Path, with_pd: bool) -> First:
        redis = RedisServer(Path(tempfile.mkdtemp(prefix="pdgate-e2e-redis-")))
        redis.start()
        traces = OtlpReceiver()
        traces.start()
        mono_child = monolithic_child(model)
        mono = start([lowest(mono_child)], log_dir / "mono")
        mono_url = mono_child.health_url.removesuffix("/health")
        if not with_pd:
            return cls(model, redis, traces, mono, mono_url, None)
        # Traced as operators trace: the proxy, vLLM and the connector export OTLP/HTTP.
        quick = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # spans exported within 0.1 s, not 5 s
        opts = base_options(
            model, redis_url=redis.url, prefill=2, decode=2,
            extra_connector_config={"write_timeout_s": STALL_TOLERANT_WRITE_TIMEOUT_S},
            extra_engine_args=(*ENGINE_ARGS, "--otlp-traces-endpoint", traces.url),
            extra_engine_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", **quick},
            extra_proxy_args=(*PROXY_ARGS, "--otlp-traces-endpoint", traces.url),
        )  # fmt: skip
        # engines publish KV events, the metaserver indexes them (tests/e2e/test_kv_routing.py)
        opts = replace(opts, kv_events_base_port=opts.proxy_port + KV_EVENTS_AT)
        plan = build_plan(opts)
        next(c for c in plan.children if c.name == "metaserver").argv.extend(
            ["--kv-placed", str(KV_PLACED_S)]
        )
        next(c for c in plan.children if c.name == "proxy").env.update(quick)
        plan.children[:] = [lowest(c) for c in plan.children]
        pd = deploy(plan, log_dir / "pd")
        return cls(model, redis, traces, mono, mono_url, pd)

    def wake(self) -> None:
        """Every process and thread of the deployment back at the normal priority (Linux keeps
        a priority per thread: each one of each process is set)."""
        if self.woken:
            return
        self.woken = True
        groups = {p.pid for p in self.mono.procs.values()}
        if self.pd is not None:
            groups |= {p.pid for p in self.pd.supervisor.procs.values()}
        failed = []
        for pid in group_members(groups):
            for tid in _threads(pid):
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, 0)
                except OSError as exc:  # gone meanwhile, or not permitted
                    if not isinstance(exc, ProcessLookupError):
                        failed.append(f"{tid}: {exc}")
        if failed:
            print(f"[e2e] {len(failed)} thread(s) kept nice 19: {failed[:3]}", flush=True)

    def stop(self) -> None:
        if self.pd is not None:
            self.pd.supervisor.stop()
        self.mono.stop()
        self.traces.close()
        self.redis.stop()
        shutil.rmtree(self.redis.workdir, ignore_errors=True)


def _threads(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []
