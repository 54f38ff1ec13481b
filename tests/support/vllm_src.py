"""Fetch the Python source of older vLLM releases for the compatibility tests.

vllm-ascend v0.23–v0.25 run on vLLM 0.23–0.25, whose KV-connector API differs from 0.32's;
``tests/connector/test_vllm_versions.py`` runs the connector's scheduler tests against those
releases' own ``Scheduler`` by putting ``.cache/vllm-src/<version>`` first on ``PYTHONPATH``.
Only the pure-Python part of each wheel is kept (its CUDA kernels cannot load here and the
scheduler does not need them).

    python tests/support/vllm_src.py 0.23.0 0.25.1
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEST = REPO / ".cache" / "vllm-src"
SKIP = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu")


def fetch(version: str) -> Path:
    target = DEST / version
    if (target / "vllm" / "__init__.py").exists():
        print(f">> vLLM {version} source: {target} (cached)", flush=True)
        return target
    with tempfile.TemporaryDirectory() as tmp:
        print(
            f">> downloading the vllm=={version} wheel (about 300 MB, no dependencies)", flush=True
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--progress-bar",
                "off",
                "-d",
                tmp,
                f"vllm=={version}",
            ],
            check=True,
        )
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        partial = target.with_name(target.name + ".partial")
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.startswith("vllm/") and not m.endswith(SKIP)]
            z.extractall(partial, members)
        partial.rename(target)
    print(f">> vLLM {version} source: {len(members)} files in {target}", flush=True)
    return target


if __name__ == "__main__":
    for v in sys.argv[1:]:
        fetch(v)
