"""What model an engine really loaded, as a short fingerprint P and D compare before a push.

Two checkpoints of one architecture (a fine-tune, the next training step, a rolling update's
new weights) have the same config shape and the same tensor names and shapes, so neither the
model name nor the safetensors headers tell them apart; their bytes do. The fingerprint is a
SHA-256 over ``config.json`` and, for each weight file (``*.safetensors``, ``*.bin``, ``*.pt``,
``*.gguf``, sorted by name), its name, size, and first ``SAMPLE_BYTES`` — for safetensors the
header (names, dtypes, shapes, offsets) and the start of the first tensors. Reading a few MiB
per file keeps it cheap at start (a 70B checkpoint in 30 files: 30 short reads) while any
retrained weights differ within the first bytes of their first tensor.

A model that is not a local directory (a hub id resolved elsewhere) is fingerprinted by its
name and vLLM's config of it: weaker, and said so by the ``name:`` prefix.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 4 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def of_directory(path: Path, sample_bytes: int = SAMPLE_BYTES) -> str:
    """``sha256:<hex>`` of the model directory ``path`` (see the module's docstring)."""
    h = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        h.update(b"config.json\0" + config.read_bytes())
    weights = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    for weight in weights:
        size = weight.stat().st_size
        h.update(f"\0{weight.name}\0{size}\0".encode())
        with weight.open("rb") as fh:
            h.update(fh.read(sample_bytes))
    return "sha256:" + h.hexdigest()[:32]


def of_model(model: str, hf_config: Any = None) -> str:
    """The fingerprint of what vLLM was asked to serve: a local directory's bytes, else the
    model's name and its config (``hf_config``: transformers' config object, if any)."""
    path = Path(model)
    if path.is_dir():
        return of_directory(path)
    h = hashlib.sha256(model.encode())
    if hf_config is not None and hasattr(hf_config, "to_dict"):
        h.update(json.dumps(hf_config.to_dict(), sort_keys=True, default=str).encode())
    return "name:" + h.hexdigest()[:32]
