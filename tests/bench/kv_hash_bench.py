"""What the kv policy costs the proxy per request: tokenizing (SmolLM2's tokenizer and chat
template) and hashing the blocks (vLLM's sha256), against the request's own JSON parsing.

    .venv/bin/python tests/bench/kv_hash_bench.py [--sizes 512,2048,8192] [--repeat 200]

Each cell is the median over ``--repeat`` calls in one thread (the proxy runs them in its
worker thread, off the event loop). "parse" is msgspec decoding the request body: what the
proxy already spends on every request, as the baseline in the same run.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402

from launch.smollm2 import make_smollm2  # noqa: E402
from pdwire.block_hash import BlockHasher  # noqa: E402
from proxy.kvroute.tokens import HFTokenizer, token_ids_of  # noqa: E402
from tests.bench.timing import median_s  # noqa: E402

WORDS = "prefill decode cache block layer token engine proxy answer question model".split()


def row(tok: HFTokenizer, hasher: BlockHasher, text: str, repeat: int) -> str:
    chat = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": text}]}  # fmt: skip
    raw = msgspec.json.encode(chat)
    ids = token_ids_of(tok, chat, True)
    assert ids is not None
    parse = median_s(lambda: msgspec.json.decode(raw), repeat)
    encode = median_s(lambda: tok.encode(text, add_special_tokens=True), repeat)
    render = median_s(lambda: token_ids_of(tok, chat, True), repeat)
    hashing = median_s(lambda: hasher.keys(ids), repeat)
    whole = median_s(lambda: hasher.keys(token_ids_of(tok, chat, True) or []), repeat)
    return (
        f"| {len(ids)} | {parse * 1e6:.0f} | {encode * 1e6:.0f} | {render * 1e6:.0f} | "
        f"{hashing * 1e6:.0f} | {whole * 1e6:.0f} | {whole / parse:.0f}× |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048, 8192]
    )
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--models-dir", default=str(REPO / ".cache" / "models"))
    a = p.parse_args(argv)
    model = make_smollm2(Path(a.models_dir), lambda line: print(line, flush=True))
    tok = HFTokenizer(str(model))
    hasher = BlockHasher(a.block_size)
    rng = random.Random(5)
    rows = [
        "| prompt tokens | parse body µs | tokenize text µs | chat template + tokenize µs "
        f"| hash {a.block_size}-token blocks µs | whole lookup (chat) µs | ÷ parse |",
        "|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for size in a.sizes:
        text = " ".join(rng.choice(WORDS) for _ in range(size))
        while len(tok.encode(text, add_special_tokens=True)) > size:
            text = text.rsplit(" ", 1)[0]
        rows.append(row(tok, hasher, text, a.repeat))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
