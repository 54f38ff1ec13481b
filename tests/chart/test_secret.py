"""The release Secret: generated on install, kept across upgrades, replaced only on request."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm

from tests.chart.fake_kube_api import FakeKubeAPI, serve
from tests.chart.rendering import FULLNAME, NAMESPACE, RELEASE, parse, render


def _upgrade(api: FakeKubeAPI, chart: helm.Chart, values: dict[str, Any] | None = None) -> Any:
    with serve(api) as url:
        config = helm.Config(kube_apiserver=url, kube_token="test", namespace=NAMESPACE)
        try:
            files = config.render(
                chart, values or {}, name=RELEASE, namespace=NAMESPACE, is_upgrade=True
            )
        finally:
            config.close()
    return parse(files)


def test_secret_generated_on_install_is_random_and_strong(chart: helm.Chart) -> None:
    first = render(chart=chart).secret_data(f"{FULLNAME}-auth")
    second = render(chart=chart).secret_data(f"{FULLNAME}-auth")
    assert re.fullmatch(r"[A-Za-z0-9]{48}", first["token"])
    assert re.fullmatch(r"[A-Za-z0-9]{32}", first["redis-password"])
    assert first["token"] != second["token"]
    assert first["redis-password"] != second["redis-password"]


def test_secret_upgrade_keeps_the_values_in_the_cluster(chart: helm.Chart) -> None:
    installed = render(chart=chart)
    secret = installed.get("Secret", f"{FULLNAME}-auth")
    api = FakeKubeAPI()
    api.put_secret(secret)

    upgraded = _upgrade(api, chart, {"prefill": {"replicas": 3}})

    assert upgraded.secret_data(f"{FULLNAME}-auth") == installed.secret_data(f"{FULLNAME}-auth")
    assert upgraded.get("StatefulSet", f"{FULLNAME}-prefill")["spec"]["replicas"] == 3
    assert f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULLNAME}-auth" in " ".join(api.requests)


def test_secret_upgrade_without_a_stored_secret_generates_one(chart: helm.Chart) -> None:
    api = FakeKubeAPI()  # e.g. the Secret was deleted by hand
    upgraded = _upgrade(api, chart)
    assert re.fullmatch(r"[A-Za-z0-9]{48}", upgraded.secret_data(f"{FULLNAME}-auth")["token"])
    assert api.requests, "the chart never looked the Secret up"


def test_secret_given_token_wins_over_the_stored_one(chart: helm.Chart) -> None:
    api = FakeKubeAPI()
    api.put_secret(render(chart=chart).get("Secret", f"{FULLNAME}-auth"))
    upgraded = _upgrade(api, chart, {"auth": {"token": "rotated-token-value"}})
    data = upgraded.secret_data(f"{FULLNAME}-auth")
    assert data["token"] == "rotated-token-value"
    # The Redis password is not part of the rotation: still the stored one.
    stored = api.secrets[(NAMESPACE, f"{FULLNAME}-auth")]["data"]["redis-password"]
    assert upgraded.get("Secret", f"{FULLNAME}-auth")["data"]["redis-password"] == stored
