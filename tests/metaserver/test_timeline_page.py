"""The timeline page in a real headless browser (Chromium driven by Playwright)
against a running stack: pd-metaserver on a real redis-server with a token for writes and reads,
the real pd-proxy process (decode-first), and the fake vLLM engines of ``tests/fakes`` — D
writes the binding, the proxy long-polls it and sends P, P reports its progress and signals D,
the proxy reports first token and end. Screenshots are saved under ``.artifacts/`` (and the
paths printed)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from playwright.async_api import Browser, ConsoleMessage, Page, async_playwright

from pdwire.models import BindingState
from tests.fakes import FakeVLLM
from tests.support.procs import REPO, VENV_BIN, Process, free_port, wait_http
from tests.support.services import MetaserverProcess, RedisServer

pytestmark = pytest.mark.slow  # drives a real headless browser: not in `make test-fast`

TOKEN = "ui-s3cret"
ARTIFACTS = REPO / ".artifacts"
PROMPT = "Explain prefill and decode disaggregation in one long paragraph. " * 6
STATES = {s.value for s in BindingState}


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
            log_dir=logs,
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
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1400, "height": 900})
    pg = await context.new_page()
    problems: list[str] = []

    def on_console(msg: ConsoleMessage) -> None:
        if msg.type == "error" and "401" not in msg.text:  # 401s: before the token is entered
            problems.append(msg.text)

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
    tid = await ask(stack)  # P refuses: the proxy marks the binding failed, D computes alone
    box = await wait_for_end(page, tid, "failed")
    error = await page.text_content(f"{box} .error") or ""
    assert "P pushed nothing" in error and "block size 32" in error, error
    kinds = await steps_of(page, tid)
    assert [k for k in kinds if k in STATES] == ["bound", "failed"], kinds
    assert {"first_token", "end"} <= set(kinds)  # D still answered: the timeline says when
    # filters: failed only, then the decode instance; both go into the address for sharing
    await page.select_option("#f-state", "failed")
    await until(page, "location.search.includes('state=failed')")
    await until(
        page,
        "(() => { const all = [...document.querySelectorAll('section.transfer')];"
        " return all.length > 0 && all.every(s => s.dataset.state === 'failed'); })()",
    )
    await page.select_option("#f-instance", stack.decode.instance_id)
    await until(page, f"location.search.includes('instance={stack.decode.instance_id}')")
    assert await page.locator(box).count() == 1
    assert await page.locator(f"{box} .bar .seg.failed").count() == 1
    await page.click(f"{box} .row")
    path = shot_path("timeline-failed.png")
    await page.screenshot(path=str(path), full_page=True)
    print(f"\nfailed-transfer screenshot: {path}")
    await page.select_option("#f-state", "done")
    await until(page, f"!document.querySelector('section.transfer[data-tid=\"{tid}\"]')")
