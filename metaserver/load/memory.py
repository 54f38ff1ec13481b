"""The load board of one metaserver process: reports in a dict, lapsed on the board's clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from metaserver.load.board import LoadBoard, others_summed
from pdwire.models import LoadReport, LoadView


@dataclass(frozen=True, slots=True)
class _Held:
    expires: float
    report: LoadReport


class MemoryLoadBoard(LoadBoard):
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._reports: dict[str, _Held] = {}

    async def report(self, replica: str, report: LoadReport) -> LoadView:
        self._reports[replica] = _Held(self._clock() + report.ttl_s, report)
        return await self.view(replica)

    async def view(self, replica: str) -> LoadView:
        now = self._clock()
        live = {}
        for who, held in list(self._reports.items()):
            if held.expires < now:
                del self._reports[who]
            else:
                live[who] = held.report
        return others_summed(replica, live)
