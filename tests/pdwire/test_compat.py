"""Which P and D may be paired: TP sizes, KV identity, revision (pdwire/compat.py)."""

from __future__ import annotations

from typing import Any

import pytest

from pdwire.compat import identity_problem, instances_problem, pairing_problem
from pdwire.models import InstanceSpec
from tests.support.identity import KV


def _spec(role: str, tp: int = 1, revision: str | None = None, **kv: Any) -> InstanceSpec:
    identity = KV.model_copy(update=kv) if kv != {"kv": None} else None
    return InstanceSpec(
        role=role,
        url="http://h:1",
        tp_size=tp,
        revision=revision,
        kv=identity,
    )


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads", "mla", "problem"),
    [
        (1, 2, 8, False, None),  # the GQA shape: decode wider
        (2, 1, 8, False, None),
        (1, 16, 8, False, None),  # heads replicated over D's ranks
        (4, 2, None, False, None),  # heads unknown: the sizes alone
        (2, 3, 8, False, "one must divide the other"),
        (1, 3, 8, False, "D: 8 KV heads do not split over tp 3"),
        (3, 1, 2, False, "P: tp 3 is not a multiple of 2 KV heads"),
        (1, 8, 1, True, None),  # MLA: the latent on every rank
    ],
)
def test_compat_tp_pairing(
    p_tp: int, d_tp: int, heads: int | None, mla: bool, problem: str | None
) -> None:
    got = pairing_problem(p_tp, d_tp, heads, mla)
    assert got == problem if problem is None else problem in (got or "")


def test_compat_identity_names_the_first_field_that_differs() -> None:
    assert identity_problem(KV, KV) is None
    other = KV.model_copy(update={"model": "sha256:" + "b" * 32})
    assert identity_problem(KV, other) == (
        f"weights/config differ: P {KV.model} vs D {other.model}"
    )
    fp8 = KV.model_copy(update={"kv_cache_dtype": "fp8"})
    assert identity_problem(KV, fp8) == "kv_cache_dtype differ: P bfloat16 vs D fp8"


def test_compat_instances_revision_identity_and_tp() -> None:
    p = _spec("prefill", 1, "v2")
    assert instances_problem(p, _spec("decode", 2, "v2")) is None
    rev = instances_problem(p, _spec("decode", 1, "v1"))
    assert rev is not None and rev.reason == "revision" and "P v2 vs D v1" in rev.text
    shape = instances_problem(p, _spec("decode", 1, "v2", num_layers=30))
    assert shape is not None and shape.reason == "identity"
    tp = instances_problem(p, _spec("decode", 3, "v2"))
    assert tp is not None and tp.reason == "layout"
    # what an instance did not register is not held against it
    assert instances_problem(p, _spec("decode", 1, None, kv=None)) is None
    assert instances_problem(_spec("prefill", 1, None, kv=None), _spec("decode", 2)) is None
