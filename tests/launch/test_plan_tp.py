"""pd-launch's plan with different TP sizes for prefill and decode (heterogeneous TP)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.cli import build_parser, options_from
from launch.plan import build_plan, kv_heads_of
from tests.launch.options import KEY_FILE, options


def _side_port(argv: list[str]) -> int:
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return int(cfg["kv_connector_extra_config"]["side_channel_port"])


def test_plan_tp_per_role_reaches_each_engine_and_side_ports_do_not_overlap() -> None:
    plan = build_plan(options(model="m", prefill=2, decode=2, tp_prefill=2, tp_decode=1))
    engines = [c for c in plan.children if c.kind == "engine"]
    tp = {c.name: int(c.argv[c.argv.index("--tensor-parallel-size") + 1]) for c in engines}
    assert tp == {"prefill-0": 2, "prefill-1": 2, "decode-0": 1, "decode-1": 1}
    # rank r of an engine listens on side_channel_port + r: the ranges must be disjoint
    used: set[int] = set()
    for child in engines:
        ports = {_side_port(child.argv) + r for r in range(tp[child.name])}
        assert not ports & used, f"{child.name} reuses side-channel ports {ports & used}"
        used |= ports


def test_plan_cpu_single_rank_engines_keep_their_worker_in_the_engine_core() -> None:
    """One vLLM import fewer per one-rank cpu engine; a TP engine keeps a process per rank, and
    the other devices keep vLLM's own choice."""
    plan = build_plan(options(model="m", prefill=1, decode=1, tp_prefill=2, tp_decode=1))
    env = {c.name: c.env for c in plan.children if c.kind == "engine"}
    assert env["decode-0"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env["prefill-0"]
    cuda = build_plan(options(model="m", device="cuda"))
    assert all("VLLM_ENABLE_V1_MULTIPROCESSING" not in c.env for c in cuda.children)


def test_plan_proxy_args_of_pd_launch_reach_the_proxy_last() -> None:
    args = ["--model", "m", "--proxy-arg=--decode-policy=prefix", "--proxy-arg=--retries=1"]
    opts = options_from(build_parser().parse_args(args), None, KEY_FILE)
    proxy = next(c for c in build_plan(opts).children if c.name == "proxy")
    assert proxy.argv[-2:] == ["--decode-policy=prefix", "--retries=1"]


def test_plan_tp_flags_of_pd_launch() -> None:
    args = build_parser().parse_args(["--model", "m", "--tp-prefill", "2", "--tp-decode", "1"])
    opts = options_from(args, None, KEY_FILE)
    assert (opts.tp_prefill, opts.tp_decode) == (2, 1)
    default = options_from(build_parser().parse_args(["--model", "m"]), None, KEY_FILE)
    assert (default.tp_prefill, default.tp_decode) == (1, 1)


def _model(tmp_path: Path, **config: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_plan_tp_decode_wider_than_prefill_is_planned(tmp_path: Path) -> None:
    """The GQA deployment every accelerator example documents: D with more ranks than P."""
    model = _model(tmp_path, num_attention_heads=32, num_key_value_heads=8)
    plan = build_plan(options(model=model, tp_prefill=1, tp_decode=2))
    engines = {c.name: c.argv for c in plan.children if c.kind == "engine"}
    assert engines["decode-0"][engines["decode-0"].index("--tensor-parallel-size") + 1] == "2"
    assert build_plan(options(model="hub/model-id", tp_prefill=2, tp_decode=4))


@pytest.mark.parametrize(
    ("config", "p_tp", "d_tp", "why"),
    [
        ({"num_key_value_heads": 8}, 2, 3, "one must divide the other"),
        ({"num_key_value_heads": 4}, 1, 3, "D: 4 KV heads do not split over tp 3"),
        ({"num_key_value_heads": 2}, 3, 1, "P: tp 3 is not a multiple of 2 KV heads"),
    ],
)
def test_plan_tp_refuses_a_pairing_that_cannot_push(
    tmp_path: Path, config: dict[str, int], p_tp: int, d_tp: int, why: str
) -> None:
    """Refused at start with the reason, instead of serving with every push failing."""
    model = _model(tmp_path, **config)
    with pytest.raises(ValueError, match=why) as exc:
        build_plan(options(model=model, tp_prefill=p_tp, tp_decode=d_tp))
    assert f"--tp-prefill {p_tp} with --tp-decode {d_tp} cannot disaggregate" in str(exc.value)
    # pull connectors check their own pairings: not refused here
    build_plan(
        options(
            model=model, tp_prefill=p_tp, tp_decode=d_tp, connector="nixl", flow="prefill-first"
        )
    )


def test_plan_tp_reads_mla_and_nested_text_configs(tmp_path: Path) -> None:
    assert kv_heads_of(_model(tmp_path, kv_lora_rank=512, num_key_value_heads=128)) == (128, True)
    nested = _model(tmp_path, text_config={"num_key_value_heads": 4})
    assert kv_heads_of(nested) == (4, False)
    assert kv_heads_of(str(tmp_path / "missing")) == (None, False)
