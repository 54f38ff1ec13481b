"""The timeline page in a real headless browser (Chromium driven by Playwright)
against a running stack: pd-metaserver on a real redis-server with a token for writes and reads,
the real pd-proxy process (decode-first), and the fake vLLM engines of ``tests/fakes`` — D
writes the binding, the proxy long-polls it and sends P, P reports its progress and signals D,
the proxy reports first token and end. The TTFT breakdown panel is checked against the
``GET /v1/breakdown`` answer of the same server, and, on an in-thread metaserver, with an empty
window and with a store that fails. Screenshots are saved under ``.artifacts/`` (and the
paths printed)."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from playwright.async_api import Browser, ConsoleMessage, Page, async_playwright

from metaserver.errors import StoreUnavailable
from metaserver.store import MemoryStore
from metaserver.store.records import StoredInstance
from pdwire.models import BindingState
from tests.fakes import FakeVLLM
from tests.metaserver.conftest import at, binding_spec, decode_instance
from tests.support.procs import REPO, VENV_BIN, Process, free_port, wait_http
from tests.support.services import InThreadMetaserver, MetaserverProcess, RedisServer

pytestmark = pytest.mark.slow  # drives a real headless browser: not in `make test-fast`

TOKEN = "ui-s3cret"
ARTIFACTS = REPO / ".artifacts"
PROMPT = "Explain prefill and decode disaggregation in one long paragraph. " * 6
STATES = {s.value for s in BindingState}
AUTH = {"authorization": f"Bearer {TOKEN}"}
POOL_OF = {
    "binding": "decode", "prefill_queue": "prefill", "prefill_compute": "prefill",
    "push_exposed": "prefill", "decode_first_token": "decode",
}  # fmt: skip


@dataclass
class Stack:
    metaserver: MetaserverProcess
    prefill: FakeVLLM
    decode: FakeVLLM
    proxy_url: str


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("timeline-stack")
    started: list[Any] = []
    token = ["--metaserver-token", TOKEN]
    try:
        ms = MetaserverProcess(
            redis_server.url, "--namespace", "uitest", "--token", TOKEN, "--protect-reads",
            "--ttft-target", "5", log_dir=logs,
        )  # fmt: skip
        started.append(ms)
        p = FakeVLLM("prefill", metaserver=ms.url, log_dir=logs, extra=token)
        started.append(p)
        d = FakeVLLM("decode", metaserver=ms.url, log_dir=logs, extra=token)
        started.append(d)
        port = free_port()
        proxy = Process(
            [
                str(VENV_BIN / "pd-proxy"), "--port", str(port), "--metaserver", ms.url,
                *token, "--prefill", p.url, "--decode", d.url, "--flow", "decode-first",
                "--retries", "0", "--health-interval", "0.2", "--binding-marks",
            ],
            log=logs / "proxy.log",
        )  # fmt: skip
        started.append(proxy)
        wait_http(f"http://127.0.0.1:{port}/health", proc=proxy)
        yield Stack(ms, p, d, f"http://127.0.0.1:{port}")
    finally:
        for s in reversed(started):
            s.stop()


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    # Debian's chromium; where the distribution has none (Ubuntu: snap only) make install
    # puts Playwright's own browser in place and ``None`` launches that one
    exe = shutil.which("chromium")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture
def problems() -> list[str]:
    """The page's console errors; a test that causes some on purpose takes them out."""
    return []


@pytest.fixture
async def page(browser: Browser, problems: list[str]) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1400, "height": 900})
    pg = await context.new_page()

    def on_console(msg: ConsoleMessage) -> None:
        if msg.type == "error" and "401" not in msg.text:  # 401s: before the token is entered
            problems.append(f"{msg.text} ({msg.location.get('url', '')})")

    pg.on("console", on_console)
    pg.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    try:
        yield pg
        assert problems == []  # script errors, CSP violations, failed loads
    finally:
        await context.close()


async def ask(stack: Stack) -> str:
    """One streamed chat completion through the proxy; returns its transfer id (as D got it)."""
    client = openai.AsyncOpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=12,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    finally:
        await client.close()
    assert text.startswith("tok0 ")
    seen = stack.decode.requests()
    kv = next(
        r["body"]["kv_transfer_params"] for r in reversed(seen) if "kv_transfer_params" in r["body"]
    )
    return str(kv["transfer_id"])


async def steps_of(page: Page, tid: str) -> list[str]:
    kinds: list[str] = await page.eval_on_selector_all(
        f'section.transfer[data-tid="{tid}"] .steps li', "els => els.map(e => e.dataset.kind)"
    )
    return kinds


async def wait_for_end(page: Page, tid: str, state: str) -> str:
    box = f'section.transfer[data-tid="{tid}"]'
    await page.wait_for_selector(
        f'{box}[data-state="{state}"] .steps li[data-kind="end"]', state="attached", timeout=15_000
    )
    return box


async def until(page: Page, js: str, timeout_s: float = 15.0) -> None:
    """Poll a JS expression with ``page.evaluate`` (Playwright's ``wait_for_function`` evaluates
    strings with ``eval``, which the page's content security policy rightly refuses)."""
    for _ in range(int(timeout_s * 10)):
        if await page.evaluate(js):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not true within {timeout_s}s: {js}")


def shot_path(name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS / name


async def test_timeline_page_shows_a_transfer_live_with_its_states_in_order(
    stack: Stack, page: Page
) -> None:
    stack.prefill.configure(report_progress=True, push_chunks=2)
    stack.decode.configure(first_token_delay_ms=40, token_delay_ms=15)
    await page.goto(stack.metaserver.url + "/ui/")
    # reads need the token here: the page says so and asks for it
    await page.wait_for_selector("#auth:not([hidden])")
    assert "token" in (await page.text_content("#status") or "")
    await page.fill("#token", TOKEN)
    await page.click("#auth-form button")
    await page.wait_for_selector("#auth", state="hidden")
    tid = await ask(stack)  # asked after the page loaded: the live poll must bring it in
    box = await wait_for_end(page, tid, "done")
    kinds = await steps_of(page, tid)
    states = [k for k in kinds if k in STATES]
    assert states == ["bound", "prefill_started", "pushing", "pushing", "done"], kinds
    assert kinds.index("first_token") < kinds.index("end") and kinds.index("bound") == 0
    assert kinds.index("first_token") > kinds.index("prefill_started")
    assert await page.locator(f"{box} .bar .seg.exposed").count() == 1
    assert await page.locator(f"{box} .bar .seg.first_token").count() == 1
    facts = await page.text_content(f"{box} .facts") or ""
    assert "TTFT" in facts and "exposed" in facts and stack.decode.instance_id in facts
    assert await page.locator(f"{box} .error").count() == 0
    assert not await page.is_visible(f"{box} .steps")
    await page.click(f"{box} .row")  # every step, with actor and detail
    assert await page.is_visible(f"{box} .steps")
    end_text = await page.text_content(f'{box} .steps li[data-kind="end"]') or ""
    assert "proxy" in end_text and "ok" in end_text
    path = shot_path("timeline-done.png")
    await page.screenshot(path=str(path), full_page=True)
    print(f"\ntimeline screenshot: {path}")
    assert path.stat().st_size > 10_000


async def test_timeline_page_shows_a_failed_transfer_with_its_error_and_filters(
    stack: Stack, page: Page
) -> None:
    stack.prefill.configure(refuse_push="block size 32 cannot serve D's 16 (test)")
    await page.goto(stack.metaserver.url + "/ui/")
    await page.fill("#token", TOKEN)
    await page.click("#auth-form button")
    # P refuses: the proxy marks the binding abandoned (why: P's reason) and drops D's leg, so D
    # ends its binding aborted and computes the prompt itself
    tid = await ask(stack)
    box = await wait_for_end(page, tid, "aborted")
    error = await page.text_content(f"{box} .error") or ""
    assert "gave up" in error and "(failed)" in error, error
    assert "P pushed nothing" in error and "block size 32" in error, error
    kinds = await steps_of(page, tid)
    assert [k for k in kinds if k in STATES] == ["bound", "aborted"], kinds
    assert {"abandoned", "first_token", "end"} <= set(kinds)  # D still answered: it says when
    # filters: aborted only, then the decode instance; both go into the address for sharing
    await page.select_option("#f-state", "aborted")
    await until(page, "location.search.includes('state=aborted')")
    await until(
        page,
        "(() => { const all = [...document.querySelectorAll('section.transfer')];"
        " return all.length > 0 && all.every(s => s.dataset.state === 'aborted'); })()",
    )
    await page.select_option("#f-instance", stack.decode.instance_id)
    await until(page, f"location.search.includes('instance={stack.decode.instance_id}')")
    assert await page.locator(box).count() == 1
    assert await page.locator(f"{box} .bar .seg.abandoned").count() == 1
    await page.click(f"{box} .row")
    path = shot_path("timeline-failed.png")
    await page.screenshot(path=str(path), full_page=True)
    print(f"\nfailed-transfer screenshot: {path}")
    await page.select_option("#f-state", "done")
    await until(page, f"!document.querySelector('section.transfer[data-tid=\"{tid}\"]')")


def seconds(text: str) -> float:
    """``412.3 ms`` or ``1.23 s`` (the page's ``ms()``) in seconds."""
    m = re.fullmatch(r"([\d.]+) (ms|s)", text.strip())
    assert m, text
    return float(m[1]) / (1000 if m[2] == "ms" else 1)


async def breakdown_of(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    async with httpx.AsyncClient(headers=headers, timeout=10) as http:
        r = await http.get(url + "/v1/breakdown")
    assert r.status_code == 200, r.text
    got: dict[str, Any] = r.json()
    return got


async def test_timeline_page_shows_the_ttft_breakdown_and_the_pd_advice(
    stack: Stack, page: Page
) -> None:
    stack.prefill.reset()
    stack.prefill.configure(report_progress=True, push_chunks=2)
    for _ in range(3):
        await ask(stack)
    # the proxy posts first_token after the stream: wait until every finished transfer has all
    # five stages, so that the page and this test read the same answer
    for _ in range(100):
        want = await breakdown_of(stack.metaserver.url, AUTH)
        counts = {s["count"] for s in want["stages"].values()}
        if want["transfers"] >= 3 and len(want["stages"]) == 5 and counts == {want["transfers"]}:
            break
        await asyncio.sleep(0.1)
    assert want["missing_stages"] == [] and set(want["stages"]) == set(POOL_OF), want
    advice = want["advice"]
    assert advice["now"] == {"prefill": 1, "decode": 1} and "recommended" in advice, advice
    await page.goto(stack.metaserver.url + "/ui/?live=0")
    await page.fill("#token", TOKEN)
    await page.click("#auth-form button")
    await page.wait_for_selector('#breakdown[data-state="ok"]', timeout=15_000)
    assert await breakdown_of(stack.metaserver.url, AUTH) == want  # nothing moved meanwhile
    panel = "#breakdown"
    facts = await page.text_content(f"{panel} .bd-facts") or ""
    assert f"{want['transfers']} finished transfers" in facts, facts
    assert f"bottleneck {want['bottleneck']}" in facts, facts
    bar = await page.eval_on_selector_all(
        f"{panel} .bd-bar .bd-seg", "s => s.map(e => e.dataset.stage)"
    )
    assert bar == list(want["stages"])
    for name, s in want["stages"].items():
        row = f'{panel} tr.bd-stage[data-stage="{name}"]'
        assert await page.get_attribute(row, "data-pool") == POOL_OF[name]
        assert (await page.text_content(f"{row} code")) == name
        for col, key in (("share", "share"), ("p50", "p50_s"), ("p90", "p90_s")):
            assert (
                float(await page.get_attribute(f"{row} .bd-{col}", "data-value") or "nan") == s[key]
            )
        assert seconds(await page.text_content(f"{row} .bd-p50") or "") == pytest.approx(
            s["p50_s"], abs=5e-5 + s["p50_s"] * 0.005
        )
        assert seconds(await page.text_content(f"{row} .bd-p90") or "") == pytest.approx(
            s["p90_s"], abs=5e-5 + s["p90_s"] * 0.005
        )
        share = await page.text_content(f"{row} .bd-share") or ""
        assert share == f"{round(s['share'] * 100)}%", (name, share)
    for pool in ("prefill", "decode"):
        row = f'{panel} tr.bd-pool[data-pool="{pool}"]'
        now, rec = advice["now"][pool], advice["recommended"][pool]
        assert await page.get_attribute(row, "data-now") == str(now)
        assert await page.get_attribute(row, "data-recommended") == str(rec)
        counts_text = await page.text_content(f"{row} .bd-counts") or ""
        assert counts_text == f"{now} now · {rec} recommended", counts_text
        stages = await page.eval_on_selector_all(
            f'{panel} tr.bd-stage[data-pool="{pool}"]', "s => s.map(e => e.dataset.stage)"
        )
        assert stages == [n for n in want["stages"] if POOL_OF[n] == pool]
    assert (await page.text_content(f"{panel} .bd-reasoning")) == advice["reasoning"]
    assert "of the time to first token" in advice["reasoning"]
    disagg = await page.text_content(f"{panel} .bd-disagg") or ""
    assert advice["disaggregation"]["text"] in disagg and "disaggregation" in disagg
    pays = "no" if advice["disaggregation"]["suggested_min_tokens"] is None else "yes"
    assert await page.get_attribute(f"{panel} .bd-disagg", "data-pays") == pays
    assert await page.locator(f"{panel} .error").count() == 0
    assert await page.locator("section.transfer").count() >= 3  # the timeline is there too
    path = shot_path("timeline-breakdown.png")
    await page.locator(panel).screenshot(path=str(path))
    print(f"\nbreakdown screenshot: {path}")
    assert path.stat().st_size > 5_000


@pytest.fixture
def bare() -> Iterator[InThreadMetaserver]:
    """A metaserver of its own (memory store, open reads): no transfers until a test writes."""
    ms = InThreadMetaserver(token=TOKEN, protect_reads=False)
    try:
        yield ms
    finally:
        ms.stop()


async def test_timeline_page_says_so_when_no_transfer_finished_in_the_window(
    bare: InThreadMetaserver, page: Page
) -> None:
    got = await breakdown_of(bare.url)
    assert got["transfers"] == 0 and got["stages"] == {} and got["advice"] is None, got
    await page.goto(bare.url + "/ui/")
    await page.wait_for_selector('#breakdown[data-state="empty"]', timeout=15_000)
    text = await page.text_content("#breakdown-body") or ""
    assert text.strip() == "no finished transfers in the window"
    assert await page.locator("#breakdown .error, #breakdown .bd-bar").count() == 0
    await page.wait_for_selector("#empty:not([hidden])")  # the timeline: no transfers either
    assert "0 transfers" in (await page.text_content("#status") or "")


async def test_timeline_page_keeps_the_timeline_when_the_breakdown_fails(
    bare: InThreadMetaserver, page: Page, problems: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with httpx.AsyncClient(base_url=bare.url, headers=AUTH, timeout=10) as http:
        for iid, role in (("decode-0", "decode"), ("prefill-0", "prefill")):
            spec = decode_instance(role=role, **at(iid)).model_dump(mode="json")
            assert (await http.put(f"/v1/instances/{iid}", json=spec)).status_code in (200, 201)
        r = await http.put("/v1/bindings/t-ok", content=binding_spec().model_dump_json())
        assert r.status_code == 201, r.text
        for state in ("prefill_started", "done"):
            body = {"state": state, "actor": "prefill-0"}
            r = await http.post("/v1/bindings/t-ok/events", json=body)
            assert r.status_code == 200, r.text
        assert (await breakdown_of(bare.url))["transfers"] == 1  # it would show one

        async def down(self: MemoryStore, role: str | None) -> list[StoredInstance]:
            raise StoreUnavailable("store down (test)")

        monkeypatch.setattr(MemoryStore, "list_instances", down)  # the in-thread server's store
        r = await http.get("/v1/breakdown")
        assert r.status_code == 503 and "store down (test)" in r.text, r.text
        r = await http.get("/v1/bindings")
        assert r.status_code == 200 and [b["transfer_id"] for b in r.json()["bindings"]] == ["t-ok"]
    await page.goto(bare.url + "/ui/?live=0")  # one load: the failures below are all there are
    await page.wait_for_selector('#breakdown[data-state="error"]', timeout=15_000)
    message = await page.text_content("#breakdown .error") or ""
    assert message.startswith("breakdown unavailable: 503") and "store down (test)" in message
    box = await page.wait_for_selector('section.transfer[data-tid="t-ok"][data-state="done"]')
    assert box is not None and await box.is_visible()
    status = await page.text_content("#status") or ""
    assert "1 transfer" in status and not await page.locator("#status.error").count(), status
    # the browser logs each failed load: the two reads of the store outage, and nothing else
    await until(page, "document.body.dataset.loaded === '1'")
    for _ in range(50):
        if sum(u in p for p in problems for u in ("/v1/breakdown", "/v1/instances")) == 2:
            break
        await asyncio.sleep(0.1)
    assert len(problems) == 2 and all("status of 503" in p for p in problems), problems
    problems.clear()
