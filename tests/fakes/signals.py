"""The fake P's done signals to D, sent as pdgate's connector sends them.

The connector's P sends each transfer's done signal to D's side channel through one ZeroMQ
DEALER socket per D rank, fire-and-forget (``connector/worker/side_channel.py``). The fakes
play that with one long-lived chunked ``POST /_fake/kv-stream`` per D, a transfer id per line;
a channel that breaks is opened again for the next signal (a signal lost with it makes D wait
for its deadline, as a lost ZeroMQ message would)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp


class _Channel:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._run(session, url))

    async def _lines(self) -> AsyncIterator[bytes]:
        while True:
            line = await self.queue.get()
            while not self.queue.empty():  # what queued meanwhile goes out in the same write
                line += self.queue.get_nowait()
            yield line

    async def _run(self, session: aiohttp.ClientSession, url: str) -> None:
        async with session.post(url, data=self._lines(), timeout=aiohttp.ClientTimeout()) as r:
            await r.read()


class SignalChannels:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._open: dict[str, _Channel] = {}

    def send(self, host: str, port: int, transfer_id: str) -> None:
        url = f"http://{host}:{port}/_fake/kv-stream"
        channel = self._open.get(url)
        if channel is None or channel.task.done():
            channel = self._open[url] = _Channel(self.session, url)
        channel.queue.put_nowait(transfer_id.encode() + b"\n")

    async def close(self) -> None:
        for channel in self._open.values():
            channel.task.cancel()
        await asyncio.gather(*(c.task for c in self._open.values()), return_exceptions=True)
