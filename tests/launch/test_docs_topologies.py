"""Every deployment the docs describe can push: each documented TP pairing (pd-launch commands
in README.md and docs/, `vllm serve` pairs, `helm --set` lines, the chart's example files) goes
through ``pdwire.compat.pairing_problem`` — the function P's scheduler and the proxy use —
with the KV heads of the model it names. A doc or example describing a deployment that would
not disaggregate fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from launch.cli import build_parser, options_from
from pdwire.compat import pairing_problem
from tests.launch.test_docs_flags import PAGES, argv_of, commands

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "charts/pdgate/examples").glob("*.yaml"))
# num_key_value_heads of the models the docs name (their config.json on the model hub)
KV_HEADS = {
    "Qwen3-8B": 8,
    "Qwen2.5-0.5B-Instruct": 2,
    "Llama-3.1-8B-Instruct": 8,
}


def heads_of(model: str) -> int:
    name = model.rstrip("/").rsplit("/", 1)[-1]
    assert name in KV_HEADS, f"the docs name {model}: add its KV heads to KV_HEADS"
    return KV_HEADS[name]


def launch_pairings() -> list[tuple[str, str, int, int]]:
    """(page, model, P tp, D tp) of each documented pd-launch command."""
    found = []
    for page in PAGES:
        for command in commands(page.read_text()):
            program, args = argv_of(command)
            if program != "pd-launch" or not any(a.startswith("--tp-") for a in args):
                continue
            opts = options_from(build_parser().parse_args(args), None)
            found.append((page.name, opts.model, opts.tp_prefill, opts.tp_decode))
    return found


SET = re.compile(r"--set\s+([\w.]+)=(\S+)")


def helm_pairings() -> list[tuple[str, str, int, int]]:
    """(where, model, P tp, D tp) of each `helm install` in the docs and each example file."""
    found = []
    for page in PAGES + [ROOT / "charts/pdgate/README.md"]:
        for command in commands(page.read_text()):
            if (
                not command.lstrip().startswith("helm install")
                or "tensorParallelSize" not in command
            ):
                continue
            values = dict(SET.findall(command))
            found.append(
                (
                    page.name,
                    values.get("model.name", ""),
                    int(values.get("prefill.tensorParallelSize", 1)),
                    int(values.get("decode.tensorParallelSize", 1)),
                )
            )
    for example in EXAMPLES:
        v = yaml.safe_load(example.read_text())
        if v.get("connector", {}).get("kind") == "vllm-ascend":
            continue  # vllm-ascend's own connector checks its pairings
        found.append(
            (
                example.name,
                v["model"]["name"],
                int(v.get("prefill", {}).get("tensorParallelSize", 1)),
                int(v.get("decode", {}).get("tensorParallelSize", 1)),
            )
        )
    return found


def test_docs_topologies_were_found() -> None:
    """The scans above really see the documented deployments (D wider than P among them)."""
    launch, helm = launch_pairings(), helm_pairings()
    assert len(launch) >= 3 and len(helm) >= 4, (launch, helm)
    assert any(d > p for _, _, p, d in launch + helm)


@pytest.mark.parametrize(
    ("where", "model", "p_tp", "d_tp"),
    launch_pairings() + helm_pairings(),
    ids=lambda x: str(x),
)
def test_docs_topology_pushes(where: str, model: str, p_tp: int, d_tp: int) -> None:
    problem = pairing_problem(p_tp, d_tp, heads_of(model), False)
    assert problem is None, f"{where}: {model} with P tp {p_tp} / D tp {d_tp}: {problem}"
