"""The model fingerprint P and D compare (connector/fingerprint.py): the bytes, not the name."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from connector import fingerprint


def _checkpoint(root: Path, seed: int, config: dict[str, int] | None = None) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config or {"hidden_size": 8, "num_layers": 2}))
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(64, 64, generator=g)}, str(root / "model.safetensors"))
    return root


def test_fingerprint_tells_two_checkpoints_of_one_shape_apart(tmp_path: Path) -> None:
    """Same config, same tensor names and shapes (identical safetensors headers), other
    weights: what a rolling update's old and new pods serve."""
    a = fingerprint.of_directory(_checkpoint(tmp_path / "a", seed=1))
    same = fingerprint.of_directory(_checkpoint(tmp_path / "a-copy", seed=1))
    other = fingerprint.of_directory(_checkpoint(tmp_path / "b", seed=2))
    assert a == same and a != other
    assert a.startswith("sha256:") and len(a) == 7 + 32
    cfg = _checkpoint(tmp_path / "c", seed=1, config={"hidden_size": 8, "num_layers": 3})
    assert fingerprint.of_directory(cfg) != a


def test_fingerprint_of_a_name_says_it_is_only_a_name(tmp_path: Path) -> None:
    assert fingerprint.of_model(str(tmp_path / "missing")).startswith("name:")
    local = _checkpoint(tmp_path / "m", seed=3)
    assert fingerprint.of_model(str(local)) == fingerprint.of_directory(local)
