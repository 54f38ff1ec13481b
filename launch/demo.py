"""``pd-launch --demo``: one chat completion through the proxy with the official openai client,
then the metaserver's record of that request (bound → pushing → done, with timings)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from launch.credentials import ADMIN_TOKEN
from launch.options import LaunchPlan


def metaserver_auth(plan: LaunchPlan) -> dict[str, str]:
    """What lets the demo read the metaserver (reads need a credential): the launch's admin
    token in roles mode, the single token with ``--token``, nothing when it runs open."""
    o = plan.options
    token = o.token
    if not token and o.credentials_dir:
        token = (Path(o.credentials_dir) / ADMIN_TOKEN).read_text().strip()
    return {"authorization": f"Bearer {token}"} if token else {}


def run_demo(plan: LaunchPlan, out: Callable[[str], None]) -> None:
    from openai import OpenAI

    model = plan.options.model
    name = Path(model).name if Path(model).exists() else model
    client = OpenAI(base_url=plan.proxy_url + "/v1", api_key="unused")
    question = "Explain prefill and decode in one sentence."
    out(f"\n>>> {question}")
    raw = client.chat.completions.with_raw_response.create(
        model=name,
        messages=[{"role": "user", "content": question}],
        max_tokens=48,
        temperature=0,
        extra_headers={"x-request-id": "pdgate-demo-1"},
    )
    reply = raw.parse()
    out(f"<<< {reply.choices[0].message.content!r}")
    tiny = Path(model).name.startswith("tiny-")
    note = "; a tiny random model: the words are noise, the path they took is the point"
    out(
        f"    (usage: {reply.usage.prompt_tokens if reply.usage else '?'} prompt tokens"
        f"{note if tiny else ''})"
    )
    listed = httpx.get(
        plan.metaserver_url + "/v1/bindings",
        params={"limit": 1},
        headers=metaserver_auth(plan),
        timeout=10,
    )
    bindings = listed.json()["bindings"]
    if not bindings:
        out("\nthe metaserver has no binding: this request was not disaggregated")
        return
    b = bindings[0]
    out(
        f"\nmetaserver record of transfer {b['transfer_id']} (GET {plan.metaserver_url}"
        f"/v1/bindings/{b['transfer_id']}):"
    )
    out(
        f"  decode instance {b['decode_instance_id']}, blocks {b['block_ids']}, "
        f"{b['num_prompt_tokens']} prompt tokens, state {b['state']}"
    )
    t0 = b["events"][0]["at"]
    for e in b["events"]:
        detail = {k: v for k, v in (e.get("detail") or {}).items() if v is not None}
        out(
            f"  +{(e['at'] - t0) * 1000:8.1f} ms  {e['state']:<16} by {e['actor']}"
            + (f"  {detail}" if detail else "")
        )
