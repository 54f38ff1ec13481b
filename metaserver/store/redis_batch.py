"""Automatic pipelining: script calls made in the same event-loop turn go to Redis as one
pipeline (one write, one read), so concurrent requests share round trips and syscalls."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError

from metaserver.errors import StoreUnavailable

_MAX_BATCH = 512


@dataclass(slots=True)
class _Call:
    script: AsyncScript
    keys: list[str]
    args: list[Any]
    future: asyncio.Future[Any]


class ScriptBatcher:
    def __init__(self, client: aioredis.Redis) -> None:
        self._r = client
        self._pending: list[_Call] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    def call(self, script: AsyncScript, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append(_Call(script, keys, args, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), _MAX_BATCH):
            task = asyncio.create_task(self._run(pending[i : i + _MAX_BATCH]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[_Call]) -> None:
        try:
            results = await self._execute(batch)
            if any(isinstance(r, NoScriptError) for r in results):  # Redis restarted: reload
                for script in {id(c.script): c.script for c in batch}.values():
                    await self._r.script_load(script.script)
                results = await self._execute(batch)
        except (RedisError, OSError) as exc:
            error = StoreUnavailable(f"redis unreachable: {exc}")
            for call in batch:
                if not call.future.done():
                    call.future.set_exception(error)
            return
        except BaseException as exc:  # cancellation at shutdown: never leave a caller hanging
            for call in batch:
                if not call.future.done():
                    call.future.set_exception(StoreUnavailable(f"redis call interrupted: {exc!r}"))
            raise
        for call, result in zip(batch, results, strict=True):
            if call.future.done():
                continue
            if isinstance(result, ResponseError):
                call.future.set_exception(StoreUnavailable(f"redis error: {result}"))
            else:
                call.future.set_result(result)

    async def _execute(self, batch: list[_Call]) -> list[Any]:
        async with self._r.pipeline(transaction=False) as pipe:
            for call in batch:
                pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
            results: list[Any] = await pipe.execute(raise_on_error=False)
        return results
