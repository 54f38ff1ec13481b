"""Mid-stream migration on real engines (the 2P2D deployment): the decode engine serving a long
greedy stream is frozen (SIGSTOP) or killed (SIGKILL) at several points of the answer; a proxy
with migration on (``--idle-timeout 2``) carries the answer over to the other pair, and the
client gets the monolithic engine's answer token for token, logprobs included. A non-streamed
answer whose D freezes is retried from the start on the other D (its first byte never came),
through a proxy whose request timeout is three times what a clean answer took just before: a
fixed one was too short on a slow CI machine, where the retry itself ran past it.

The kill comes last, and this module runs after every other user of the 2P2D deployment
(``conftest.pytest_collection_modifyitems``): the killed engine is not started again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from tests.e2e.chaos import Answer, Outcome, ReliabilityTable, Row
from tests.e2e.client import Generation, client
from tests.e2e.conftest import LOG_DIR, Engines
from tests.e2e.engine_metrics import samples
from tests.e2e.observe import observer
from tests.e2e.stack import own_proxy
from tests.e2e.test_equality import assert_same, prompt_ids

pytestmark = pytest.mark.e2e
PROMPT_TOKENS = 300
STREAM_TOKENS = 800
# where the client's answer is when its D stops: at its first token, in the middle, late
POINTS = {"first-token": 1, "middle": 300, "late": 550}
KILL_AT = 300
NONSTREAM_TOKENS = 100
NONSTREAMED = ("non-streamed", "non-streamed-clean")
SEEDS = {
    **{p: 9100 + at for p, at in POINTS.items()},
    "non-streamed": 9200, "non-streamed-clean": 9201, "killed": 9300,
}  # fmt: skip
MIGRATIONS = "pd_migrations_total{"
MIGRATING_ARGS = ("--idle-timeout", "2", "--migration-limit", "2")
# the latest a stream's fault may come (``faulted_stream``): every accepted splice is before
# the oracle's tokens from here on, and they are judged
LATEST_FAULT = STREAM_TOKENS - 50
# the most tokens a wrong splice could repeat or drop: one event's (a token; a few when vLLM
# merges outputs its reader has not taken yet) or the few the rewind generates again. The
# oracle's tokens from LATEST_FAULT on must repeat with no period up to this: if they did,
# an answer shifted by that period would equal the oracle (``references``)
MAX_SHIFT = 25
# the non-streamed case's request timeout: this many times a clean answer's time, at least
TIMEOUT_FACTOR = 3.0
MIN_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
async def references(engines: Engines) -> dict[str, Generation]:
    """Every case's reference answer, asked of the monolithic engine at once (one batch)."""
    cases = {c: STREAM_TOKENS for c in SEEDS} | dict.fromkeys(NONSTREAMED, NONSTREAM_TOKENS)
    got = await asyncio.gather(
        *(reference(engines, prompt_ids(PROMPT_TOKENS, SEEDS[c]), n) for c, n in cases.items())
    )
    refs = dict(zip(cases, got, strict=True))
    for case in (c for c in cases if c not in NONSTREAMED):  # the spliced ones
        found = periods(refs[case].token_ids, LATEST_FAULT, MAX_SHIFT)
        assert not found, (
            f"the oracle of {case!r} repeats with period {found} from token {LATEST_FAULT} on: "
            "a splice that repeated or dropped that many tokens would pass unseen (did the "
            f"tiny model's recipe change?). Tokens: {refs[case].token_ids[LATEST_FAULT:]}"
        )
    return refs


def periods(ids: Sequence[int], start: int, max_shift: int) -> list[int]:
    """The shifts ``p <= max_shift`` by which ``ids`` repeats from ``start`` on (``ids[i] ==
    ids[i + p]`` for every ``i >= start``): an answer spliced at or before ``start`` that
    repeats or drops ``p`` tokens would equal ``ids``."""
    assert len(ids) - start > max_shift, (len(ids), start, max_shift)
    return [
        p for p in range(1, max_shift + 1)
        if all(ids[i] == ids[i + p] for i in range(start, len(ids) - p))
    ]  # fmt: skip


@pytest.fixture(scope="module")
def migrating(engines: Engines) -> Iterator[str]:
    """A proxy of its own on the 2P2D deployment: silence of 2 s on a stream is a broken D."""
    with own_proxy(engines.pd, "proxy-migrating", MIGRATING_ARGS, LOG_DIR / "migration") as url:
        yield url


def _args(engines: Engines, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return dict(
        model=engines.model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )  # fmt: skip


def _ids(tokens: list[str]) -> tuple[int, ...]:
    return tuple(int(t.removeprefix("token_id:")) for t in tokens)


def generation(r: Any) -> Generation:
    """A non-streamed completion (logprobs on, ids as tokens) as a ``Generation``."""
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    return Generation(r.choices[0].text, _ids(lp.tokens), tuple(lp.token_logprobs or []))


async def reference(engines: Engines, prompt: list[int], max_tokens: int) -> Generation:
    return generation(
        await client(engines.mono_url).completions.create(**_args(engines, prompt, max_tokens))
    )


async def serving_decoder(engines: Engines) -> str:
    """The decode engine of the newest transfer (its binding names it)."""
    async with observer(engines.pd.metaserver) as ms:
        listed = (await ms.get("/v1/bindings", params={"limit": 1})).json()["bindings"]
    assert listed, "no binding: the request did not go through P/D"
    name = str(listed[0]["decode_instance_id"])
    assert name in engines.pd.supervisor.procs, name
    return name


async def both_decoders_serve(proxy: str, timeout_s: float = 60.0) -> None:
    """Wait until the proxy counts both decode engines available again: a D frozen by the
    case before failed its health probes meanwhile, and a break with no other D available
    is not continued."""
    deadline = time.monotonic() + timeout_s
    async with observer(proxy) as http:
        while True:
            listed = (await http.get("/v1/instances")).json()["instances"]
            up = [
                i for i in listed
                if i["role"] == "decode" and i["healthy"] and i["circuit"] == "closed"
            ]  # fmt: skip
            if len(up) >= 2:
                return
            assert time.monotonic() < deadline, f"decode instances not back: {listed}"
            await asyncio.sleep(0.2)


def hit(engines: Engines, name: str, sig: signal.Signals) -> None:
    os.killpg(engines.pd.supervisor.procs[name].pid, sig)


async def migrations(proxy: str) -> dict[tuple[str, str], float]:
    """``pd_migrations_total`` by (reason, outcome) (``samples`` gives the label values sorted
    by label name: outcome, reason)."""
    out: dict[tuple[str, str], float] = {}
    for key, value in (await samples(proxy)).items():
        if key.startswith(MIGRATIONS):
            outcome, reason = key.removeprefix(MIGRATIONS).removesuffix("}").split(",")
            out[(reason, outcome)] = value
    return out


def record(
    table: ReliabilityTable, scenario: str, got: Generation, ref: Generation, started: float,
    note: str,
) -> None:  # fmt: skip
    """The answer as a row of the reliability table (docs/reliability.md)."""
    right = got.token_ids == ref.token_ids and got.text == ref.text
    outcome = Outcome.CORRECT if right else Outcome.WRONG
    answer = Answer(outcome, started, time.monotonic(), None, len(got.token_ids))
    table.add(Row(scenario, [answer], {}, note))


async def faulted_stream(
    engines: Engines, proxy: str, prompt: list[int], at: int, sig: signal.Signals
) -> tuple[Generation, str]:
    """Stream ``prompt``'s answer; once the client has ``at`` tokens, send ``sig`` to the D
    serving it (the D is looked up at the first token). Returns what the client got and that
    D's name; a frozen D is thawed once the answer is in."""
    text, tokens, logprobs = "", list[str](), list[float]()
    victim: str | None = None
    hit_at: int | None = None
    try:
        s = await client(proxy).completions.create(
            stream=True, **_args(engines, prompt, STREAM_TOKENS)
        )
        async with s:
            async for chunk in s:
                if not chunk.choices:
                    continue
                ch = chunk.choices[0]
                text += ch.text
                if ch.logprobs and ch.logprobs.tokens:
                    tokens += ch.logprobs.tokens
                    logprobs += [float(x) for x in ch.logprobs.token_logprobs or []]
                if tokens and victim is None:
                    victim = await serving_decoder(engines)
                if victim is not None and hit_at is None and len(tokens) >= at:
                    hit(engines, victim, sig)
                    hit_at = len(tokens)
    finally:
        if victim is not None and sig == signal.SIGSTOP:
            hit(engines, victim, signal.SIGCONT)
    assert victim is not None and hit_at is not None, f"no fault: {len(tokens)} tokens"
    assert hit_at < LATEST_FAULT, f"the fault came too late to matter ({hit_at})"
    return Generation(text, _ids(tokens), tuple(logprobs)), victim


@pytest.mark.parametrize("point", list(POINTS))
async def test_e2e_frozen_decoder_mid_stream_answer_goes_on(
    engines: Engines,
    migrating: str,
    references: dict[str, Generation],
    reliability: ReliabilityTable,
    point: str,
) -> None:
    prompt = prompt_ids(PROMPT_TOKENS, seed=SEEDS[point])
    ref = references[point]
    await both_decoders_serve(migrating)
    before = await migrations(migrating)
    started = time.monotonic()
    got, victim = await faulted_stream(engines, migrating, prompt, POINTS[point], signal.SIGSTOP)
    record(
        reliability, f"D frozen (SIGSTOP) mid-stream, {point}", got, ref, started,
        f"{STREAM_TOKENS}-token greedy stream, D frozen after {POINTS[point]} token(s), "
        "2 s idle timeout; the answer went on from the other pair",
    )  # fmt: skip
    assert_same(got, ref)
    after = await migrations(migrating)
    key = ("timeout", "continued")
    assert after.get(key, 0) - before.get(key, 0) == 1, (before, after)
    assert victim.startswith("decode-")


async def test_e2e_frozen_decoder_non_streamed_answer_is_retried(
    engines: Engines,
    migrating: str,
    references: dict[str, Generation],
    reliability: ReliabilityTable,
) -> None:
    await both_decoders_serve(migrating)
    clean_prompt = prompt_ids(PROMPT_TOKENS, seed=SEEDS["non-streamed-clean"])
    started = time.monotonic()
    clean = await client(migrating).completions.create(
        **_args(engines, clean_prompt, NONSTREAM_TOKENS)
    )
    clean_s = time.monotonic() - started
    assert_same(generation(clean), references["non-streamed-clean"])
    timeout_s = max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * clean_s)
    args = ("--request-timeout", f"{timeout_s:.1f}")
    with own_proxy(engines.pd, "proxy-request-timeout", args, LOG_DIR / "migration") as url:
        await both_decoders_serve(url)
        got = await _frozen_non_streamed(engines, url)
    ref = references["non-streamed"]
    record(
        reliability, "D frozen (SIGSTOP) during a non-streamed answer", got, ref, started,
        f"{NONSTREAM_TOKENS} tokens; retried from the start on the other pair after the "
        f"{timeout_s:.1f} s request timeout ({TIMEOUT_FACTOR:.0f}x a clean answer's "
        f"{clean_s:.1f} s)",
    )  # fmt: skip
    assert_same(got, ref)


async def _frozen_non_streamed(engines: Engines, proxy: str) -> Generation:
    """Ask for the non-streamed case's answer through ``proxy``; freeze its D once its
    binding names it (the newest binding, not the one newest before asking), thaw it once the
    answer is in. The proxy must have retried once, on a timeout."""
    prompt = prompt_ids(PROMPT_TOKENS, seed=SEEDS["non-streamed"])
    c = client(proxy)
    victim: str | None = None
    async with observer(engines.pd.metaserver) as ms:

        async def newest() -> dict[str, Any] | None:
            listed = (await ms.get("/v1/bindings", params={"limit": 1})).json()["bindings"]
            return listed[0] if listed else None

        before = await newest()
        retries = await samples(proxy)
        asking = asyncio.create_task(
            c.completions.create(**_args(engines, prompt, NONSTREAM_TOKENS))
        )
        try:
            for _ in range(400):  # D has it once its binding is written
                b = await newest()
                if b is not None and (before is None or b["transfer_id"] != before["transfer_id"]):
                    assert b["num_prompt_tokens"] == PROMPT_TOKENS, b
                    victim = str(b["decode_instance_id"])
                    break
                assert not asking.done(), "answered before its D was seen"
                await asyncio.sleep(0.025)
            assert victim is not None, "no binding for the request"
            hit(engines, victim, signal.SIGSTOP)
            r = await asking
        finally:
            if victim is not None:
                hit(engines, victim, signal.SIGCONT)
            if not asking.done():
                asking.cancel()
    key = "pd_retries_total{upstream_timeout}"
    after = await samples(proxy)
    assert after.get(key, 0) - retries.get(key, 0) == 1, (retries, after)
    return generation(r)


async def test_e2e_killed_decoder_mid_stream_answer_goes_on(
    engines: Engines,
    migrating: str,
    references: dict[str, Generation],
    reliability: ReliabilityTable,
) -> None:
    """Last: the killed D stays down."""
    prompt = prompt_ids(PROMPT_TOKENS, seed=SEEDS["killed"])
    ref = references["killed"]
    await both_decoders_serve(migrating)
    before = await migrations(migrating)
    started = time.monotonic()
    got, victim = await faulted_stream(engines, migrating, prompt, KILL_AT, signal.SIGKILL)
    record(
        reliability, "D killed (SIGKILL) mid-stream, 2P2D", got, ref, started,
        f"{STREAM_TOKENS}-token greedy stream, D killed after {KILL_AT} tokens; the answer went "
        "on from the other pair",
    )  # fmt: skip
    assert_same(got, ref)
    after = await migrations(migrating)
    moved = sum(v for k, v in after.items() if k[1] == "continued") - sum(
        v for k, v in before.items() if k[1] == "continued"
    )
    assert moved == 1, (before, after)
    assert engines.pd.supervisor.procs[victim].poll() is not None
