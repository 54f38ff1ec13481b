"""Worker halves: pushed bytes land exactly in D's blocks (in-process transport, CPU layout),
for every (P tp, D tp) where one divides the other (either may be the larger), GQA and MLA;
and vLLM's aggregators see each side's ranks finish once."""

from __future__ import annotations

import itertools

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from tests.connector import cluster as C

TP_PAIRS = [(p, d) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)]
_tid = itertools.count()


def _check_d_blocks(
    d: C.Instance, full: dict[str, torch.Tensor], pairs: list[tuple[int, int]]
) -> None:
    for rank, caches in enumerate(d.caches):
        start, n = d.local(rank)
        for name, tensor in caches.items():
            for pb, db in pairs:
                want = full[name][pb] if d.mla else full[name][pb, start : start + n]
                assert torch.equal(tensor[db], want), (rank, name, pb, db)


def _untouched(d: C.Instance, keep: set[int]) -> bool:
    return all(
        not tensor[b].any()
        for caches in d.caches
        for tensor in caches.values()
        for b in range(d.blocks)
        if b not in keep
    )


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS, ids=[f"p{p}-d{d}" for p, d in TP_PAIRS])
def test_worker_places_kv_exactly_for_every_tp_pair(p_tp: int, d_tp: int, mla: bool) -> None:
    port = C.free_port_range(d_tp)
    d = C.make_instance("d-eng", "kv_consumer", d_tp, mla=mla, port=port)
    p = C.make_instance("p-eng", "kv_producer", p_tp, mla=mla)
    try:
        full = C.fill_prefill(p, seed=p_tp * 10 + d_tp)
        tid = f"t{next(_tid)}"
        pairs = [(0, 9), (1, 10), (2, 11), (5, 3), (6, 4), (7, 20)]  # runs + scattered
        C.expect(d, "dreq", tid, [b for _, b in pairs])
        C.push(p, "preq", tid, C.destination(d, port), [pairs[:3], pairs[3:5], pairs[5:]])
        got = C.poll(d, set(), lambda acc: all("dreq" in r for _, r, _ in acc))
        assert all(not f for _, _, f in got)
        _check_d_blocks(d, full, pairs)
        assert _untouched(d, {b for _, b in pairs})
        # P: every rank reports the finished request exactly once -> aggregator releases once
        agg = KVOutputAggregator(expected_finished_count=p_tp)
        sent = C.poll(p, {"preq"}, lambda acc: all("preq" in s for s, _, _ in acc))
        outs: list[ModelRunnerOutput | None] = [
            ModelRunnerOutput(
                req_ids=[],
                req_id_to_index={},
                kv_connector_output=KVConnectorOutput(finished_sending=s or None),
            )
            for s, _, _ in sent
        ]
        merged = agg.aggregate(outs)
        assert merged is not None and merged.kv_connector_output is not None
        assert merged.kv_connector_output.finished_sending == {"preq"}
        pushing = [w for w in p.workers if w.sender and w.sender.transfers.get("preq")]
        assert pushing == []  # forgotten after release
    finally:
        C.close(p, d)


def test_worker_d_aggregator_needs_every_d_rank() -> None:
    port = C.free_port_range(2)
    d = C.make_instance("d-eng", "kv_consumer", 2, port=port)
    p = C.make_instance("p-eng", "kv_producer", 4)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tagg", [4, 5])
        C.push(p, "preq", "tagg", C.destination(d, port), [[(0, 4), (1, 5)]])
        got = C.poll(d, set(), lambda acc: all("dreq" in r for _, r, _ in acc))
        agg = KVOutputAggregator(expected_finished_count=2)
        first = agg.aggregate(
            [
                ModelRunnerOutput(
                    req_ids=[],
                    req_id_to_index={},
                    kv_connector_output=KVConnectorOutput(finished_recving=got[0][1]),
                ),
                ModelRunnerOutput(
                    req_ids=[],
                    req_id_to_index={},
                    kv_connector_output=KVConnectorOutput(finished_recving=set()),
                ),
            ]
        )
        assert first is not None and first.kv_connector_output is not None
        assert not first.kv_connector_output.finished_recving  # rank 1 not yet reported
        second = agg.aggregate(
            [
                ModelRunnerOutput(
                    req_ids=[],
                    req_id_to_index={},
                    kv_connector_output=KVConnectorOutput(finished_recving=set()),
                ),
                ModelRunnerOutput(
                    req_ids=[],
                    req_id_to_index={},
                    kv_connector_output=KVConnectorOutput(finished_recving=got[1][1]),
                ),
            ]
        )
        assert second is not None and second.kv_connector_output is not None
        assert second.kv_connector_output.finished_recving == {"dreq"}
    finally:
        C.close(p, d)
