"""The connector on other vLLM releases than the installed 0.32: those vllm-ascend v0.23–v0.25
run on (0.23–0.25) and the CUDA image's (0.33). Each one's own ``Scheduler`` drives the
connector's scheduler half through the same tests as 0.32's.

Each version's Python source (``.cache/vllm-src``, fetched by ``make test``) goes first on
``PYTHONPATH`` of a child pytest running ``test_scheduler_{decode,prefill}.py`` and
``test_compat.py``. 0.23–0.25 call ``get_finished`` (no ``get_transfer_results``), hear of
failed loads by block id, and never hand the connector their ``KVCacheManager``.

Each child's JUnit report is judged test by test: every test passes, except the ones named in
``ALLOWED_SKIPS`` for that version, which must skip, for the reason named there."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OTHER = ["0.23.0", "0.24.0", "0.25.1", "0.33.0"]  # the Makefile's VLLM_OTHER
MODULES = [
    "tests/connector/test_scheduler_decode.py",
    "tests/connector/test_scheduler_prefill.py",
    "tests/connector/test_compat.py",
]

NO_MANAGER = "this vLLM never hands the connector its KVCacheManager: silence_s is off"
_SILENT_P = (
    "tests.connector.test_scheduler_decode::"
    "test_decode_load_failed_for_a_silent_p_recomputes_in_other_blocks_until_the_deadline"
)
# version -> {test (JUnit's classname::name): the reason it skips}; every other test passes
ALLOWED_SKIPS: dict[str, dict[str, str]] = {
    "0.23.0": {_SILENT_P: NO_MANAGER},
    "0.24.0": {_SILENT_P: NO_MANAGER},
    "0.25.1": {_SILENT_P: NO_MANAGER},
    "0.33.0": {},
}


@dataclass(frozen=True)
class Outcome:
    probe: subprocess.CompletedProcess[str]
    run: subprocess.CompletedProcess[str] | None  # None: the probe found the wrong vLLM
    report: Path


def outcomes_of(report: Path) -> dict[str, tuple[str, str]]:
    """A JUnit report's tests: ``classname::name`` -> (``passed``, ``skipped``, ``failed`` or
    ``error``; the skip's or failure's message)."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        assert name not in out, f"{name} twice in {report}"
        result = ("passed", "")
        for kind in ("skipped", "failure", "error"):
            found = case.find(kind)
            if found is not None:  # an error in teardown follows a pass: the worst is kept
                result = ("failed" if kind == "failure" else kind, found.get("message") or "")
        out[name] = result
    return out


def _check(version: str, reports: Path) -> Outcome:
    """Import the version's vLLM (it must be the one found), then run the modules on it."""
    src = REPO / ".cache" / "vllm-src" / version
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{REPO}"}
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__, vllm.__file__)"],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    last = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
    report = reports / f"vllm-{version}.xml"
    if not last.startswith(f"{version} {src}"):
        return Outcome(probe, None, report)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", *MODULES],
        env=env, capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    return Outcome(probe, run, report)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Outcome]]]:
    """Every version's check, all started at once: each child pytest is one process that
    spends about half its time waiting (the scheduler tests' threads, their in-process
    metaserver), so four share the machine's two cores without leaving them idle."""
    reports = tmp_path_factory.mktemp("vllm-versions")
    with ThreadPoolExecutor(max_workers=len(OTHER), thread_name_prefix="vllm-version") as pool:
        futures = {v: pool.submit(_check, v, reports) for v in OTHER}
        yield futures
        for f in futures.values():
            f.cancel()


@pytest.mark.slow
@pytest.mark.parametrize("version", OTHER)
def test_connector_scheduler_half_on_other_vllm_releases(
    version: str, outcomes: dict[str, Future[Outcome]]
) -> None:
    src = REPO / ".cache" / "vllm-src" / version
    assert (src / "vllm" / "__init__.py").exists(), (
        f"{src} is missing: `make test` fetches it (tests/support/vllm_src.py {version})"
    )
    out = outcomes[version].result()
    assert out.run is not None, out.probe.stdout + out.probe.stderr
    run = out.run
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    got = outcomes_of(out.report)
    allowed = ALLOWED_SKIPS[version]
    skipped = {t: why for t, (kind, why) in got.items() if kind == "skipped"}
    assert skipped == allowed, f"skipped on vLLM {version}: {skipped}, allowed: {allowed}"
    bad = {t: r for t, r in got.items() if r[0] not in ("passed", "skipped")}
    assert not bad, f"not passed on vLLM {version}: {bad}\n{tail}"
    modules = {
        t.split("::")[0].replace(".", "/") + ".py" for t, r in got.items() if r[0] == "passed"
    }
    assert modules == set(MODULES), f"modules with tests passed on vLLM {version}: {modules}"
