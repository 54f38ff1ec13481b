"""The chart's Grafana dashboard parses, and every series it queries is one the code exports:
the proxy's and the metaserver's registries, and the connector's series table (what each engine's
``/metrics`` carries through vLLM's hooks)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from connector import stats
from metaserver.metrics import Metrics as MetaserverMetrics
from proxy.metrics import Metrics as ProxyMetrics
from tests.chart.rendering import NAMESPACE, Rendered

DASHBOARD = Path(__file__).resolve().parents[2] / "charts/pdgate/files/grafana-dashboard.json"
# a metric name in PromQL: not a function (followed by "("), a label or a keyword
NAME = re.compile(r"(?<![\w:\"$])((?:vllm:)?pd(?:gate)?_[A-Za-z0-9_:]*)(?=\{|\[|\)|\s|$)")


def _exposed(registry: CollectorRegistry) -> set[str]:
    """The sample names each family of ``registry`` puts on ``/metrics``, children or not."""
    out: set[str] = set()
    for family in registry.collect():
        name = family.name
        if family.type == "counter":
            out.add(name + "_total")
        elif family.type == "histogram":
            out.update(name + s for s in ("_bucket", "_sum", "_count"))
        else:
            out.add(name)
    return out


def exported_names() -> set[str]:
    names = _exposed(ProxyMetrics(list).registry) | _exposed(MetaserverMetrics().registry)
    return names | stats.exposed_names()


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def queried_names(dash: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [
        v["query"]["query"] for v in dash["templating"]["list"] if "query" in v.get("query", {})
    ]
    return {m.group(1) for e in exprs for m in NAME.finditer(e)}


def test_dashboard_queries_only_series_the_code_exports() -> None:
    queried = queried_names(_dashboard())
    assert len(queried) > 30  # the pattern finds them (a regression here hides everything)
    missing = queried - exported_names()
    assert not missing, sorted(missing)


def test_dashboard_has_connector_and_autoscaling_panels() -> None:
    queried = queried_names(_dashboard())
    connector = {n for n in queried if n.startswith("vllm:pdgate_")}
    # every connector series is on a panel (histograms through their buckets)
    wanted = {s.exposed[0] for s in stats.SERIES}
    assert wanted <= connector, sorted(wanted - connector)
    for name in (
        "pd_binding_waits",
        "pd_transfers_inflight",
        "pd_transfer_oldest_age_seconds",
        "pdgate_metaserver_prefill_queue_seconds_bucket",
        "pdgate_metaserver_transfers_in_flight",
    ):
        assert name in queried, name


def test_dashboard_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = _dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, p["title"]
        cells |= mine
        assert all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]


def test_dashboard_name_pattern_reads_promql() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(vllm:pdgate_push_seconds_bucket{namespace="x"}'
        "[5m]))) + sum(pd_binding_waits) - max(pdgate_metaserver_transfer_oldest_age_seconds)"
    )
    found = {m.group(1) for m in NAME.finditer(expr)}
    assert found == {
        "vllm:pdgate_push_seconds_bucket",
        "pd_binding_waits",
        "pdgate_metaserver_transfer_oldest_age_seconds",
    }


def _families(registry: CollectorRegistry) -> dict[str, str]:
    """Each family's name as docs/observability.md lists it (counters with ``_total``), and
    its type."""
    return {
        (f.name + "_total" if f.type == "counter" else f.name): f.type for f in registry.collect()
    }


def test_observability_doc_lists_every_series_with_its_type() -> None:
    doc = (DASHBOARD.parents[3] / "docs/observability.md").read_text()
    doc = doc.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]  # the other sections: spans …
    rows = {
        cells[1].strip("` "): cells[2].strip()
        for line in doc.splitlines()
        if line.startswith("| `") and len(cells := line.split("|")) > 3
    }
    wanted = _families(ProxyMetrics(list).registry) | _families(MetaserverMetrics().registry)
    wanted |= {s.exposed[0].removesuffix("_bucket"): s.kind.value for s in stats.SERIES}
    assert {n: rows.get(n) for n in wanted} == wanted
    assert set(rows) == set(wanted)  # and nothing the code does not export


def test_alert_rules_query_only_exported_series_of_the_release(
    renders: dict[str, Rendered],
) -> None:
    """The PrometheusRule's alerts: "prefill computes but pushes nothing" (refused pairings,
    failed transfers) and "a pair's loads fail" (D recomputes), on series the connector
    exports, in the release's namespace."""
    (rule,) = renders["observability"].of_kind("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {
        "PdgatePrefillRefusesPairings",
        "PdgatePushesFailing",
        "PdgatePairRecomputes",
    }
    names = {m.group(1) for r in alerts.values() for m in NAME.finditer(r["expr"])}
    assert names == {
        "vllm:pdgate_pairing_refusals_total",
        "vllm:pdgate_transfers_total",
        "vllm:pdgate_blocks_pushed_total",
        "vllm:pdgate_blocks_recomputed_total",
    }
    assert names <= exported_names()
    assert all(f'namespace="{NAMESPACE}"' in r["expr"] for r in alerts.values())
    assert "> 0.05" in alerts["PdgatePushesFailing"]["expr"]
    assert "> 0.2" in alerts["PdgatePairRecomputes"]["expr"]
    assert not renders["defaults"].of_kind("PrometheusRule")
