"""Identity per pod, not per pool: engine pods present their projected ServiceAccount tokens and
the metaserver has the Kubernetes API review them (``metaserver.access.kube``); a real
``pd-metaserver`` process against an API stand-in built from the API's source
(``tests/support/kube_api.py``).

With one token per pool (the chart's way before), a compromised decode pod could act as every
other decode pod: register their ids, bind their blocks, drain them. Now a pod's token acts as
that pod alone (its id, its own addresses, one registration) and as nothing once the pod is gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.metaserver.conftest import binding_spec
from tests.support.kube_api import FakeKubeAPI, FakePod
from tests.support.services import MetaserverProcess

NS = "serving"
ADMIN = "admin-token-0123456789"


@dataclass
class Cluster:
    api: FakeKubeAPI
    ms: MetaserverProcess
    pods: dict[str, FakePod]
    tokens: dict[str, str]

    def call(self, who: str, method: str, path: str, body: Any = None) -> httpx.Response:
        token = self.tokens.get(who, who)
        return httpx.request(
            method, self.ms.url + path, json=body, headers={"authorization": f"Bearer {token}"},
            timeout=10,
        )  # fmt: skip

    def register(self, who: str, iid: str, role: str, host: str) -> httpx.Response:
        body: dict[str, Any] = {"role": role, "url": f"http://{host}:8000"}
        if role == "decode":
            body["kv_endpoint"] = {"host": host, "port": 5600}
        return self.call(who, "PUT", f"/v1/instances/{iid}", body)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    api = FakeKubeAPI(tmp_path)
    creds = tmp_path / "credentials.yaml"
    creds.write_text(f"""\
credentials:
  - {{name: ops, role: admin, token: {ADMIN}}}
  - {{name: prefill-pods, role: engine, engine_role: prefill,
      kubernetes: {{service_account: "{NS}:pd-prefill"}}}}
  - {{name: decode-pods, role: engine, engine_role: decode,
      kubernetes: {{service_account: "{NS}:pd-decode"}}}}
""")
    pods = {
        "pd-decode-0": api.add_pod(NS, "pd-decode-0", "pd-decode", "10.9.0.10"),
        "pd-decode-1": api.add_pod(NS, "pd-decode-1", "pd-decode", "10.9.0.11"),
        "pd-prefill-0": api.add_pod(NS, "pd-prefill-0", "pd-prefill", "10.9.1.10"),
    }
    tokens = {name: api.mint(pod) for name, pod in pods.items()}
    ms = MetaserverProcess(
        "memory", "--credentials-file", str(creds), "--kube-api", api.url,
        "--kube-ca-file", str(api.cert.cert), "--kube-token-file", str(api.token_file),
        log_dir=tmp_path,
    )  # fmt: skip
    try:
        yield Cluster(api, ms, pods, tokens)
    finally:
        ms.stop()
        api.stop()


def test_a_pods_token_acts_as_that_pod_alone(cluster: Cluster) -> None:
    c = cluster
    assert c.register("pd-decode-0", "pd-decode-0", "decode", "10.9.0.10").status_code == 201
    assert c.register("pd-decode-1", "pd-decode-1", "decode", "10.9.0.11").status_code == 201
    assert c.register("pd-prefill-0", "pd-prefill-0", "prefill", "10.9.1.10").status_code == 201
    # what a compromised decode-0 tries: another pod's id, another pod's address (URL or KV
    # endpoint), the other pool's role, a second registration, another pod's blocks, a drain
    refused = [
        c.register("pd-decode-0", "pd-decode-1", "decode", "10.9.0.11"),
        c.register("pd-decode-0", "pd-decode-0", "decode", "10.9.0.11"),
        c.call("pd-decode-0", "PUT", "/v1/instances/pd-decode-0", {
            "role": "decode", "url": "http://10.9.0.10:8000",
            "kv_endpoint": {"host": "10.9.1.10", "port": 5600}}),
        c.register("pd-decode-0", "pd-decode-0", "prefill", "10.9.0.10"),
        c.register("pd-decode-0", "pd-decode-0x", "decode", "10.9.0.10"),
        c.call("pd-decode-0", "PUT", "/v1/bindings/t-other",
               _binding("pd-decode-1", "10.9.0.11")),
        c.call("pd-decode-0", "PUT", "/v1/instances/pd-decode-1/drain"),
    ]  # fmt: skip
    assert [r.status_code for r in refused] == [403] * 7, [r.text for r in refused]
    # what it legitimately does still works: heartbeat, its own binding, the prefill's lease
    assert c.register("pd-decode-0", "pd-decode-0", "decode", "10.9.0.10").status_code == 200
    own = c.call("pd-decode-0", "PUT", "/v1/bindings/t1", _binding("pd-decode-0", "10.9.0.10"))
    assert own.status_code == 201, own.text
    forged = {"state": "prefill_started", "actor": "pd-decode-0"}
    assert c.call("pd-decode-0", "POST", "/v1/bindings/t1/events", forged).status_code == 403
    lease = {"state": "prefill_started", "actor": "pd-prefill-0"}
    assert c.call("pd-prefill-0", "POST", "/v1/bindings/t1/events", lease).status_code == 200
    listed = c.call(ADMIN, "GET", "/v1/instances").json()["instances"]
    assert {i["instance_id"]: i["draining"] for i in listed} == {
        "pd-decode-0": False, "pd-decode-1": False, "pd-prefill-0": False,
    }  # fmt: skip
    # each token was reviewed once: later calls were answered from the cache
    assert sorted(set(c.api.reviews)) == sorted(c.tokens.values())
    assert len(c.api.reviews) == 3


def test_a_token_is_nobodys_once_its_pod_is_gone_or_for_another_audience(
    cluster: Cluster,
) -> None:
    c, api = cluster, cluster.api
    other_audience = api.mint(c.pods["pd-decode-0"], audiences=("https://kubernetes.default",))
    made_up = "eyJhbGciOi.eyJzdWIiOiJwZC1kZWNvZGUtMCJ9.c2lnbmF0dXJl"
    for token in (other_audience, made_up, "not a jwt at all"):
        assert c.register(token, "pd-decode-0", "decode", "10.9.0.10").status_code == 401
    assert "not a jwt at all" not in api.reviews  # never sent to the API server
    # the pod deleted and made again under the same name (a StatefulSet does): a new uid
    old = c.tokens["pd-decode-1"]
    api.add_pod(NS, "pd-decode-1", "pd-decode", "10.9.0.11")
    assert c.register(old, "pd-decode-1", "decode", "10.9.0.11").status_code == 401
    fresh = api.mint(api.pods[(NS, "pd-decode-1")])
    assert c.register(fresh, "pd-decode-1", "decode", "10.9.0.11").status_code == 201
    # a terminating pod's still valid token is refused: it is on its way out
    api.pods[(NS, "pd-prefill-0")].terminating = True
    assert c.register("pd-prefill-0", "pd-prefill-0", "prefill", "10.9.1.10").status_code == 401
    # a pod of a service account no entry names
    stray = api.add_pod(NS, "stray-0", "default", "10.9.2.1")
    assert c.register(api.mint(stray), "stray-0", "decode", "10.9.2.1").status_code == 401


def test_an_unreachable_kubernetes_api_answers_503_not_401(cluster: Cluster) -> None:
    cluster.api.token_file.write_text("not-the-metaserver's-token\n")  # the API refuses it
    r = cluster.register("pd-decode-0", "pd-decode-0", "decode", "10.9.0.10")
    assert r.status_code == 503 and r.headers.get("retry-after") == "1", r.text
    cluster.api.token_file.write_text(cluster.api.caller_token + "\n")  # rotated back: re-read
    assert cluster.register("pd-decode-0", "pd-decode-0", "decode", "10.9.0.10").status_code == 201


def _binding(decode: str, host: str) -> dict[str, Any]:
    spec = binding_spec(decode_instance_id=decode, kv_endpoint={"host": host, "port": 5600})
    return spec.model_dump(mode="json")
