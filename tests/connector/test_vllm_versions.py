"""The connector on other vLLM releases than the installed 0.32: those vllm-ascend v0.23–v0.25
run on (0.23–0.25) and the CUDA image's (0.33). Each one's own ``Scheduler`` drives the
connector's scheduler half through the same tests as 0.32's.

Each version's Python source (``.cache/vllm-src``, fetched by ``make test``) goes first on
``PYTHONPATH`` of a child pytest running ``test_scheduler_{decode,prefill}.py`` and
``test_compat.py``. 0.23–0.25 call ``get_finished`` (no ``get_transfer_results``), hear of
failed loads by block id, and never hand the connector their ``KVCacheManager``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


@dataclass(frozen=True)
class Outcome:
    probe: subprocess.CompletedProcess[str]
    run: subprocess.CompletedProcess[str] | None  # None: the probe found the wrong vLLM


def _check(version: str) -> Outcome:
    """Import the version's vLLM (it must be the one found), then run the modules on it."""
    src = REPO / ".cache" / "vllm-src" / version
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{REPO}"}
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__, vllm.__file__)"],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    last = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
    if not last.startswith(f"{version} {src}"):
        return Outcome(probe, None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MODULES],
        env=env, capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    return Outcome(probe, run)


@pytest.fixture(scope="module")
def outcomes() -> Iterator[dict[str, Future[Outcome]]]:
    """Every version's check, started at once and run two at a time: each child pytest is
    one process, mostly on one core, and the machine has two."""
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-version") as pool:
        futures = {v: pool.submit(_check, v) for v in OTHER}
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
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 20, tail
