"""The chaos suite's instruments: one client request classified precisely (correct, clean
error, wrong, hung, broken, abandoned), a steady request stream, restarting a deployment's
child, and the table of what each scenario measured."""

from __future__ import annotations

import asyncio
import enum
import math
import os
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI

from tests.e2e.pauses import Pauses, within
from tests.e2e.stack import Deployment
from tests.support.procs import wait_http


class Outcome(enum.StrEnum):
    CORRECT = "correct"  # every token equals the monolithic engine's greedy output
    CLEAN_ERROR = "clean error"  # an OpenAI error status or SSE error event with a message
    WRONG = "wrong"  # a token differs (also: a partial answer that is not a prefix)
    HUNG = "hung"  # no end within the bound
    BROKEN = "broken"  # the connection dropped without an error status or event
    ABANDONED = "abandoned"  # the client hung up first (what it got was a correct prefix)


@dataclass
class Answer:
    outcome: Outcome
    started: float  # time.monotonic() when the request was sent
    ended: float
    first_token: float | None = None  # when the first token arrived
    tokens: int = 0
    status: int | None = None  # an error's HTTP status (None: an SSE error event)
    detail: str = ""


@dataclass(frozen=True)
class Ask:
    """One request: the prompt, the reference answer (token ids), how to send it."""

    prompt: list[int]
    ref: tuple[int, ...]
    max_tokens: int
    stream: bool = True
    ignore_eos: bool = False


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


class _HungUp(Exception):
    """The client leaves after the tokens it wanted (``ask``'s ``hang_up_after``)."""


async def ask(
    c: AsyncOpenAI,
    model: str,
    q: Ask,
    *,
    bound_s: float,
    hang_up_s: float | None = None,
    hang_up_after: int | None = None,
    pauses: Pauses | None = None,
) -> Answer:
    """Send ``q`` and classify the answer. ``hang_up_s``: the client gives up after that many
    seconds (the request task is cancelled: its HTTP connection is closed). ``hang_up_after``
    (streams): the client closes the stream once it has that many tokens, wherever the
    request is then — a point in the answer rather than in time, so it lands after the first
    token however fast the machine is. Anything still running at ``bound_s`` is HUNG; with
    ``pauses``, ``bound_s`` is running time (the machine's pauses meanwhile do not count)."""
    got: list[int] = []
    first: list[float] = []
    args: dict[str, Any] = dict(
        model=model, prompt=q.prompt, max_tokens=q.max_tokens, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": q.ignore_eos},
    )  # fmt: skip

    async def go() -> None:
        if not q.stream:
            r = await c.completions.create(**args)
            lp = r.choices[0].logprobs
            first.append(time.monotonic())
            got.extend(_ids(lp.tokens if lp and lp.tokens else []))
            return
        s = await c.completions.create(stream=True, **args)
        async with s:
            async for chunk in s:
                if not chunk.choices:
                    continue
                lp = chunk.choices[0].logprobs
                if lp and lp.tokens:
                    if not first:
                        first.append(time.monotonic())
                    got.extend(_ids(lp.tokens))
                    if hang_up_after is not None and len(got) >= hang_up_after:
                        raise _HungUp  # leaving ``async with s`` closes the connection

    started = time.monotonic()
    abandon = hang_up_s is not None and hang_up_s < bound_s
    limit = hang_up_s if hang_up_s is not None and abandon else bound_s

    def answer(outcome: Outcome, status: int | None = None, detail: str = "") -> Answer:
        if outcome in (Outcome.ABANDONED, Outcome.CLEAN_ERROR) and not _prefix(got, q.ref):
            outcome, detail = Outcome.WRONG, f"partial answer is not a prefix ({detail})"
        return Answer(
            outcome, started, time.monotonic(), first[0] if first else None, len(got), status,
            detail,
        )  # fmt: skip

    try:
        await within(go(), limit, started, None if abandon else pauses)
    except TimeoutError:
        return answer(Outcome.ABANDONED if abandon else Outcome.HUNG)
    except _HungUp:
        return answer(Outcome.ABANDONED)
    except openai.APIConnectionError as exc:  # also APITimeoutError
        return answer(Outcome.BROKEN, detail=f"{type(exc).__name__}: {exc.__cause__!r}")
    except openai.APIStatusError as exc:
        clean = exc.status_code >= 400 and _has_message(exc.body)
        return answer(
            Outcome.CLEAN_ERROR if clean else Outcome.BROKEN, exc.status_code, exc.message
        )
    except openai.APIError as exc:  # an SSE error event
        clean = isinstance(exc.body, dict) and bool(exc.body.get("message")) and bool(exc.message)
        return answer(Outcome.CLEAN_ERROR if clean else Outcome.BROKEN, None, exc.message)
    except httpx.HTTPError as exc:
        return answer(Outcome.BROKEN, detail=repr(exc))
    if tuple(got) != q.ref:
        return answer(Outcome.WRONG, detail=f"got {got[:8]}…, want {list(q.ref[:8])}…")
    return answer(Outcome.CORRECT)


def _prefix(got: list[int], ref: tuple[int, ...]) -> bool:
    return tuple(got) == ref[: len(got)]


def _has_message(body: object) -> bool:
    """An OpenAI error body: ``{"error": {"message": …}}`` (openai hands over the inner dict)."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        return isinstance(inner, dict) and bool(inner.get("message"))
    return False


async def references(
    c: AsyncOpenAI, model: str, prompts: Sequence[list[int]], *, max_tokens: int,
    ignore_eos: bool = False,
) -> list[tuple[int, ...]]:  # fmt: skip
    """The monolithic engine's greedy answers (token ids), computed once per prompt."""
    sem = asyncio.Semaphore(64)

    async def one(p: list[int]) -> tuple[int, ...]:
        async with sem:
            r = await c.completions.create(
                model=model, prompt=p, max_tokens=max_tokens, temperature=0, logprobs=1,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": ignore_eos},
            )  # fmt: skip
            lp = r.choices[0].logprobs
            assert lp is not None and lp.tokens
            return tuple(_ids(lp.tokens))

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def steady_stream(
    send: Callable[[int], Coroutine[Any, Any, Answer]], *, rate_hz: float, duration_s: float
) -> list[Answer]:
    """Start ``send(i)`` every ``1/rate_hz`` seconds for ``duration_s``; all answers."""
    tasks: list[asyncio.Task[Answer]] = []
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < duration_s:
        tasks.append(asyncio.create_task(send(i)))
        i += 1
        await asyncio.sleep(max(0.0, t0 + i / rate_hz - time.monotonic()))
    return list(await asyncio.gather(*tasks))


STALL_S = 2.0  # this process not running that long: a run measured the machine


class StallWatch:
    """How long this process went without running, while it watches: a thread that ticks every
    ``TICK_S`` and keeps the longest gap between two ticks. The machine these suites run on
    (a 2-core VM) has been seen to stop several processes at once for 10-40 s (every log
    silent, engine heartbeats 20 s late, this process's request pacing 3.5 s behind); a
    scenario that ran through such a stall measured the machine, not the system."""

    TICK_S = 0.05

    def __init__(self) -> None:
        self.worst_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            stopping = self._stop.wait(self.TICK_S)
            now = time.monotonic()  # the last gap counts too: a stall may end the watch
            self.worst_s = max(self.worst_s, now - last - self.TICK_S)
            last = now
            if stopping:
                return

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def respawn(dep: Deployment, name: str, argv: list[str] | None = None) -> None:
    """Start child ``name`` again (its process was killed), with its own argv unless given;
    the supervisor stops it with the rest at the end."""
    child = next(c for c in dep.plan.children if c.name == name)
    old = dep.supervisor.procs[name]
    if old.poll() is None:
        raise RuntimeError(f"{name} still runs")
    log = open(dep.supervisor.log_dir / f"{name}.log", "a")
    dep.supervisor._logs.append(log)
    dep.supervisor.procs[name] = subprocess.Popen(
        argv or child.argv, env={**os.environ, **child.env}, stdout=log,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0,
    )  # fmt: skip
    wait_http(child.health_url, timeout=30)


def hang_up_delays(n: int, seed: int, spans: Sequence[tuple[float, float]]) -> list[float]:
    """``n`` delays, an equal share drawn uniformly from each ``(low, high)`` span."""
    rng = random.Random(seed)
    return [rng.uniform(*spans[i % len(spans)]) for i in range(n)]


# ---- the table -----------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    answers: list[Answer]
    kv_free_s: dict[str, float]  # per engine: seconds from the fault until idle (inf: never)
    note: str = ""

    def count(self, outcome: Outcome) -> int:
        return sum(1 for a in self.answers if a.outcome == outcome)

    def free_s(self, role: str) -> float:
        """The slowest engine of a role (``prefill`` / ``decode``); NaN when none was measured."""
        got = [s for name, s in self.kv_free_s.items() if name.startswith(role)]
        return max(got) if got else math.nan

    def outcomes(self) -> Counter[str]:
        return Counter(a.outcome.value for a in self.answers)

    def errors(self) -> Counter[str]:
        return Counter(
            f"{a.status or 'sse'}: {a.detail[:70]}"
            for a in self.answers
            if a.outcome in (Outcome.CLEAN_ERROR, Outcome.BROKEN)
        )


COLUMNS = (
    "scenario", "requests", "correct", "clean errors", "wrong", "hung", "broken",
    "abandoned", "KV free on P (s)", "KV free on D (s)", "note",
)  # fmt: skip


def _secs(x: float) -> str:
    if math.isnan(x):
        return "–"
    return "never" if math.isinf(x) else f"{x:.1f}"


@dataclass
class ReliabilityTable:
    rows: list[Row] = field(default_factory=list)
    header: str = ""

    def add(self, row: Row) -> None:
        self.rows.append(row)

    def markdown(self) -> str:
        lines = [
            "| " + " | ".join(COLUMNS) + " |",
            "|" + "|".join("---" if i == 0 or i == len(COLUMNS) - 1 else "--:"
                           for i in range(len(COLUMNS))) + "|",
        ]  # fmt: skip
        for r in self.rows:
            cells = [
                r.scenario, str(len(r.answers)), str(r.count(Outcome.CORRECT)),
                str(r.count(Outcome.CLEAN_ERROR)), str(r.count(Outcome.WRONG)),
                str(r.count(Outcome.HUNG)), str(r.count(Outcome.BROKEN)),
                str(r.count(Outcome.ABANDONED)), _secs(r.free_s("prefill")),
                _secs(r.free_s("decode")), r.note,
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join([self.header, "", *lines, ""] if self.header else [*lines, ""])

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.markdown())
