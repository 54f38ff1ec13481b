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
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OTHER = ["0.23.0", "0.24.0", "0.25.1", "0.33.0"]  # the Makefile's VLLM_OTHER
MODULES = [
    "tests/connector/test_scheduler_decode.py",
    "tests/connector/test_scheduler_prefill.py",
    "tests/connector/test_compat.py",
]


@pytest.mark.slow
@pytest.mark.parametrize("version", OTHER)
def test_connector_scheduler_half_on_other_vllm_releases(version: str) -> None:
    src = REPO / ".cache" / "vllm-src" / version
    assert (src / "vllm" / "__init__.py").exists(), (
        f"{src} is missing: `make test` fetches it (tests/support/vllm_src.py {version})"
    )
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{REPO}"}
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__, vllm.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    last = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else ""
    assert last.startswith(f"{version} {src}"), probe.stdout + probe.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MODULES],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 20, tail
