"""pdwire.ascend: vllm-ascend's request ids, D's posted body, P's params."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdwire.ascend import (
    BATCH_KEY,
    AscendBinding,
    ascend_decode_leg,
    ascend_prefill_params,
    ascend_request_ids,
    binding_of_record,
    prompt_count,
)
from tests.support.procs import REPO
from tests.support.vllm_src import ASCEND_DEST

LAYERWISE = "vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_layerwise_connector.py"
VLLM_ASCEND = "0.25.1rc1"  # the Makefile's VLLM_ASCEND


def test_ascend_request_ids_follow_vllm_openai_server() -> None:
    assert ascend_request_ids("X", chat=True) == ["chatcmpl-X"]
    assert ascend_request_ids("X", chat=False, prompt="one") == ["cmpl-X-0"]
    assert ascend_request_ids("X", chat=False, prompt=[1, 2, 3]) == ["cmpl-X-0"]  # token ids
    assert ascend_request_ids("X", chat=False, prompt=["a", "b"]) == ["cmpl-X-0", "cmpl-X-1"]
    assert ascend_request_ids("X", chat=False, prompt=[[1], [2], [3]])[-1] == "cmpl-X-2"
    assert prompt_count([]) == 1


def test_ascend_decode_leg_is_what_the_example_proxy_sends() -> None:
    assert ascend_decode_leg("http://m/v1/ascend/metaserver") == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "metaserver": "http://m/v1/ascend/metaserver",
    }


def test_ascend_prefill_params_single_and_batch() -> None:
    a, b = {"request_id": "cmpl-X-0", "remote_block_ids": [[1]]}, {"request_id": "cmpl-X-1"}
    assert ascend_prefill_params(["cmpl-X-0"], [a]) is a
    batch = ascend_prefill_params(["cmpl-X-0", "cmpl-X-1"], [a, b])
    assert batch[BATCH_KEY] == {"cmpl-X-0": a, "cmpl-X-1": b}
    assert {k: v for k, v in batch.items() if k != BATCH_KEY} == a


def test_binding_of_record_drops_the_metaserver_fields() -> None:
    record = (
        b'{"transfer_id":"cmpl-X-0","state":"bound","created_at":1.0,"updated_at":1.0,'
        b'"request_id":"cmpl-X-0","remote_port":36000,"events":[]}'
    )
    assert binding_of_record(record) == {"request_id": "cmpl-X-0", "remote_port": 36000}


def test_ascend_binding_accepts_full_cache_hit_and_refuses_oversize() -> None:
    base = {
        "request_id": "cmpl-X-0",
        "remote_block_ids": [],  # num_external_tokens == 0: D holds the whole prompt
        "remote_block_size": [128],
        "remote_engine_id": "e",
        "remote_host": "10.0.0.1",
        "remote_port": 36000,
        "remote_tp_size": 1,
    }
    assert AscendBinding.model_validate(base).remote_block_ids == []
    with pytest.raises(ValidationError):
        AscendBinding.model_validate({**base, "remote_block_ids": [[0]] * 17})


def _posted_keys(source: str) -> set[str]:
    """The keywords of ``kv_transfer_params = dict(...)`` in ``update_state_after_alloc``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "update_state_after_alloc":
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Assign)
                    and isinstance(sub.targets[0], ast.Name)
                    and sub.targets[0].id == "kv_transfer_params"
                    and isinstance(sub.value, ast.Call)
                ):
                    return {k.arg for k in sub.value.keywords if k.arg}
    raise AssertionError("kv_transfer_params = dict(...) not found")


def test_ascend_binding_fields_match_vllm_ascend_source() -> None:
    """Against the real connector's source: the body D posts has exactly our model's fields.
    ``make test`` fetches the pinned release (the Makefile's VLLM_ASCEND); ``VLLM_ASCEND_SRC``
    points at another checkout instead."""
    root = Path(os.environ.get("VLLM_ASCEND_SRC") or ASCEND_DEST / VLLM_ASCEND)
    assert (root / LAYERWISE).exists(), (
        f"{root / LAYERWISE} is missing: `make test` fetches it "
        f"(tests/support/vllm_src.py vllm-ascend=={VLLM_ASCEND})"
    )
    source = (root / LAYERWISE).read_text()
    assert _posted_keys(source) == set(AscendBinding.model_fields)


def test_ascend_pinned_release_is_the_makefiles() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert f"VLLM_ASCEND := {VLLM_ASCEND}\n" in makefile
