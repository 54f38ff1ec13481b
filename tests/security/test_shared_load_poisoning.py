"""Shared load is advice, not a switch (security_review_2 N12). With ``--share-load`` every proxy
replica skipped the instances any other replica reported with an open circuit: one
``PUT /v1/load/<any name>`` naming every URL in ``open_circuits`` (any proxy-role caller; anyone
in open mode) emptied both pools on every replica, and load figures had no upper bound. Now
another replica's open circuits never empty a pool this replica sees as usable (it chooses on
its own view then), and load figures are bounded."""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from metaserver import MetaserverSettings, create_app
from metaserver.backend import memory_backend
from metaserver.store import MemoryStore
from pdwire.models import LoadReport
from tests.proxy.test_share_unit import Board, P, by_url, replica


async def test_a_report_naming_every_instance_does_not_empty_a_pool() -> None:
    board = Board()
    reg, share = replica(board, "a")
    poison = LoadReport(instances={}, open_circuits=P, ttl_s=60)
    await board.share_load("mallory", poison)
    await share.once()
    assert all(i.available() for i in reg.instances())  # the pool stays: its own view chooses
    assert share.overruled == 1
    # a report naming one instance of two is still heeded: the other takes the requests
    await board.share_load("mallory", LoadReport(instances={}, open_circuits=P[:1], ttl_s=60))
    await share.once()
    state = {url: inst.available() for url, inst in by_url(reg).items()}
    assert state == {P[0]: False, P[1]: True} and share.overruled == 1


async def test_load_figures_are_bounded() -> None:
    for figures in ((2_000_000, 1), (1, 2**41)):
        try:
            LoadReport(instances={P[0]: figures})
        except ValidationError:
            continue
        raise AssertionError(f"{figures} accepted")
    app = create_app(
        MetaserverSettings(), backend=memory_backend(MemoryStore(binding_ttl_s=60, retain_s=60))
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ms") as c:
        huge = {"instances": {P[0]: [10**12, 10**18]}}
        assert (await c.put("/v1/load/r", json=huge)).status_code == 422
