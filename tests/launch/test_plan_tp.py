"""pd-launch's plan with different TP sizes for prefill and decode (heterogeneous TP)."""

from __future__ import annotations

import json

from launch.cli import build_parser, options_from
from launch.plan import LaunchOptions, build_plan


def _side_port(argv: list[str]) -> int:
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return int(cfg["kv_connector_extra_config"]["side_channel_port"])


def test_plan_tp_per_role_reaches_each_engine_and_side_ports_do_not_overlap() -> None:
    plan = build_plan(LaunchOptions(model="m", prefill=2, decode=2, tp_prefill=2, tp_decode=1))
    engines = [c for c in plan.children if c.kind == "engine"]
    tp = {c.name: int(c.argv[c.argv.index("--tensor-parallel-size") + 1]) for c in engines}
    assert tp == {"prefill-0": 2, "prefill-1": 2, "decode-0": 1, "decode-1": 1}
    # rank r of an engine listens on side_channel_port + r: the ranges must be disjoint
    used: set[int] = set()
    for child in engines:
        ports = {_side_port(child.argv) + r for r in range(tp[child.name])}
        assert not ports & used, f"{child.name} reuses side-channel ports {ports & used}"
        used |= ports


def test_plan_tp_flags_of_pd_launch() -> None:
    args = build_parser().parse_args(["--model", "m", "--tp-prefill", "2", "--tp-decode", "1"])
    opts = options_from(args, None)
    assert (opts.tp_prefill, opts.tp_decode) == (2, 1)
    default = options_from(build_parser().parse_args(["--model", "m"]), None)
    assert (default.tp_prefill, default.tp_decode) == (1, 1)
