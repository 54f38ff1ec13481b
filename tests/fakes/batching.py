"""The fake engines' metaserver writes, sent as pdgate's connector sends them.

The connector's ``BackgroundWriter`` (``pdwire/client/writer.py``) performs writes on a few
lanes; a lane that finds several writes ready sends them as one ``POST /v1/batch``. This is
the same shape on asyncio: up to ``lanes`` requests in flight, and the writes made while every
lane is busy (or in one event-loop turn) go out together, each with the answer it would have
had alone. The batch is built and read by pdwire's own ``batch`` and ``batch_results``."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from pdwire.client import _protocol as P


@dataclass(slots=True)
class _Write:
    method: str
    path: str
    body: bytes
    answer: asyncio.Future[tuple[int, bytes]]


class WriteBatcher:
    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, lanes: int = 4, batch_max: int = 64
    ) -> None:
        self.session = session
        self.base_url = base_url
        self.lanes = lanes
        self.batch_max = batch_max
        self._ready: list[_Write] = []
        self._busy = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0

    async def write(self, method: str, path: str, body: object) -> tuple[int, bytes]:
        """``(status, body)`` of the write: its own request's, or its item in a batch."""
        raw = json.dumps(body).encode()
        if self.batch_max <= 1:
            return await self._alone(method, path, raw)
        w = _Write(method, path, raw, asyncio.get_running_loop().create_future())
        self._ready.append(w)
        if self._busy < self.lanes:
            self._busy += 1
            task = asyncio.get_running_loop().create_task(self._lane())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await w.answer

    async def _alone(self, method: str, path: str, raw: bytes) -> tuple[int, bytes]:
        async with self.session.request(
            method, self.base_url + path, data=raw, headers={"content-type": "application/json"}
        ) as r:
            return r.status, await r.read()

    async def _lane(self) -> None:
        try:
            while self._ready:
                take, self._ready = self._ready[: self.batch_max], self._ready[self.batch_max :]
                try:
                    if len(take) == 1:
                        w = take[0]
                        _answer(w, await self._alone(w.method, w.path, w.body))
                        continue
                    batch = P.batch([P.Call(w.method, w.path, body=w.body) for w in take])
                    assert batch.body is not None
                    status, raw = await self._alone(batch.method, batch.path, batch.body)
                    self.batches += 1
                    if status != 200:
                        for w in take:
                            _answer(w, (status, raw))
                        continue
                    for w, item in zip(take, P.batch_results(raw, len(take)), strict=True):
                        _answer(w, (item.status, item.body))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    for w in take:
                        if not w.answer.done():
                            w.answer.set_exception(exc)
        finally:
            self._busy -= 1


def _answer(w: _Write, result: tuple[int, bytes]) -> None:
    """Its answer, unless its writer stopped waiting (cancelled): the write was made all the
    same, and the lane goes on with the others."""
    if not w.answer.done():
        w.answer.set_result(result)
