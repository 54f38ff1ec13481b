"""``connector.kind: vllm-ascend``: the engines run vllm-ascend's MooncakeLayerwiseConnector with
the config vllm-ascend documents, the proxy runs ascend-layerwise, the metaserver vets D's posts
against the decode headless Service."""

from __future__ import annotations

import copy
import json
from typing import Any

import helm_python as helm
from vllm.config import KVTransferConfig

from metaserver.ascend.pool import PoolEntry
from metaserver.cli import load_settings as load_metaserver_settings
from proxy.cli import load_settings as load_proxy_settings
from tests.chart.rendering import FULLNAME, NAMESPACE, SCENARIOS, arg_after, container, render

VALUES: dict[str, Any] = copy.deepcopy(SCENARIOS["ascend-2p1d-tp"])
VALUES["connector"] = {"kind": "vllm-ascend", "sideChannelPort": 36000}


def test_chart_vllm_ascend_engines_get_the_documented_kv_transfer_config(
    chart: helm.Chart,
) -> None:
    r = render(VALUES, chart=chart)
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        c = container(r.get("StatefulSet", f"{FULLNAME}-{role}"))
        cfg = json.loads(arg_after(c["args"], "--kv-transfer-config"))
        assert cfg == {
            "kv_connector": "MooncakeLayerwiseConnector",
            "kv_role": kv_role,
            "kv_port": "36000",
            "kv_connector_extra_config": {
                "prefill": {"dp_size": 1, "tp_size": 2},
                "decode": {"dp_size": 1, "tp_size": 4},
            },
        }
        KVTransferConfig(**cfg)  # vLLM's own validation of the flag's value


def test_chart_vllm_ascend_proxy_and_metaserver_flags(chart: helm.Chart) -> None:
    r = render(VALUES, chart=chart)
    proxy_args = container(r.get("Deployment", f"{FULLNAME}-proxy"))["args"]
    proxy = load_proxy_settings(proxy_args)
    assert proxy.flow.value == "ascend-layerwise"
    urls = proxy.ascend_urls()
    assert urls("pd-1").split("?")[0] == f"http://{FULLNAME}-metaserver:8300/v1/ascend/metaserver"
    ms_args = container(r.get("Deployment", f"{FULLNAME}-metaserver"))["args"]
    ms = load_metaserver_settings(ms_args)
    (entry,) = [PoolEntry.parse(e) for e in ms.ascend_decode]
    assert entry == PoolEntry(f"{FULLNAME}-decode.{NAMESPACE}.svc.cluster.local", 36000, 36003)


def test_chart_default_connector_keeps_pdgate(chart: helm.Chart) -> None:
    r = render(SCENARIOS["ascend-2p1d-tp"], chart=chart)
    ms_args = container(r.get("Deployment", f"{FULLNAME}-metaserver"))["args"]
    assert not any(a.startswith("--ascend-decode") for a in ms_args)
    c = container(r.get("StatefulSet", f"{FULLNAME}-decode"))
    assert json.loads(arg_after(c["args"], "--kv-transfer-config"))["kv_connector"] == (
        "PdgateConnector"
    )
