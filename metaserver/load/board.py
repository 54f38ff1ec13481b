"""``LoadBoard``: where proxy replicas leave their load and read the others', summed
(``metaserver.load``)."""

from __future__ import annotations

import abc
from collections.abc import Mapping

from pdwire.models import LoadReport, LoadView


class LoadBoard(abc.ABC):
    @abc.abstractmethod
    async def report(self, replica: str, report: LoadReport) -> LoadView:
        """Record ``replica``'s report; the others' (those not expired), summed."""

    @abc.abstractmethod
    async def view(self, replica: str) -> LoadView:
        """The others' reports (those not expired), summed; records nothing (on Redis, a
        script that only reads)."""


def others_summed(replica: str, reports: Mapping[str, LoadReport]) -> LoadView:
    """What ``replica`` reads: every other live replica's report, summed."""
    others: dict[str, list[int]] = {}
    open_: set[str] = set()
    recent: dict[str, int] = {}
    for who, r in reports.items():
        if who == replica:
            continue
        for url, (n, tokens) in r.instances.items():
            acc = others.setdefault(url, [0, 0])
            acc[0] += n
            acc[1] += tokens
        open_.update(r.open_circuits)
        for url, work in r.recent.items():
            recent[url] = recent.get(url, 0) + work
    view = {url: (v[0], v[1]) for url, v in others.items()}
    return LoadView(others=view, open_circuits=sorted(open_), recent=recent, replicas=len(reports))
