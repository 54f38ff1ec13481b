"""The Redis store's change listener: one pub/sub connection per process on ``<ns>:changes``
(a transfer id per change) and ``<ns>:created`` (a new binding, whole), feeding this process's
long-poll waiters and binding feeds (``store.waiters``).

It reconnects forever with backoff; after a reconnect every waiter is woken to read again (no
change is missed) and the feeds hear that creations may have been missed. Anyone who can PUBLISH
on the channels can send anything: a message that cannot be read is counted, logged and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from metaserver.store.redis_codec import created_of
from metaserver.store.waiters import LocalWaiters

log = logging.getLogger("pdgate.metaserver.redis")
_RECANCEL_S = 0.1


class ChangeListener:
    def __init__(self, client: aioredis.Redis, namespace: str, waiters: LocalWaiters) -> None:
        self._r = client
        self._waiters = waiters
        self.channel = f"{namespace}:changes"
        self.created_channel = f"{namespace}:created"
        self._created_raw = self.created_channel.encode()
        self._task: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()  # set once Redis confirms the subscription
        self.bad_messages = 0  # messages that could not be read (dropped, logged)

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="metaserver-pubsub")

    async def close(self) -> None:
        if self._task is not None:
            await _cancel_until_done(self._task)

    async def _listen(self) -> None:
        """Feed local waiters from the channels; reconnect forever with backoff."""
        delay = 0.05
        while True:
            pubsub = self._r.pubsub()
            try:
                # SUBSCRIBE is only sent here; Redis may still run a PUBLISH from another
                # connection before it. The subscription is live at its confirmation message.
                await pubsub.subscribe(self.channel, self.created_channel)
                confirmed = 0
                async for message in pubsub.listen():
                    kind = message.get("type")
                    if kind == "message":
                        self._deliver(message)
                    elif kind == "subscribe" and (confirmed := confirmed + 1) == 2:
                        self.subscribed.set()
                        if delay > 0.05:
                            log.info("change subscription restored")
                        delay = 0.05
                        self._waiters.notify_all()  # anything may have changed while away
                    elif kind == "subscribe" and confirmed > 2:
                        # redis-py reconnected and subscribed again by itself: what was
                        # published meanwhile is gone
                        log.warning("change subscription re-established; waking every waiter")
                        self._waiters.lost()
                        self._waiters.notify_all()
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
                raise
            except (RedisError, OSError) as exc:
                self.subscribed.clear()
                self._waiters.lost()
                log.warning("change subscription lost (%s); retrying in %.2fs", exc, delay)
            except Exception:  # a bug here must not end every long-poll's wake-ups for good
                self.subscribed.clear()
                self._waiters.lost()
                log.exception("change listener failed; subscribing again in %.2fs", delay)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            self._waiters.notify_all()

    def _deliver(self, message: dict[str, Any]) -> None:
        """Wake the waiters a change message names. A message that cannot be read is counted
        and logged, and every waiter is woken to read its binding again (a wake-up it needed
        may have been in it)."""
        try:
            if message["channel"] == self._created_raw:
                self._waiters.created(created_of(message["data"]))
            else:
                self._waiters.notify(message["data"].decode())
        except Exception as exc:
            self.bad_messages += 1
            log.warning("unreadable change message %.80r dropped (%r)", message.get("data"), exc)
            self._waiters.notify_all()


async def _cancel_until_done(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it to end, cancelling again while it runs on. On Python
    3.11 ``asyncio.wait_for`` loses a cancel that lands as the call it waits on completes
    (CPython gh-86296, fixed in 3.12); redis-py sends commands through it, so a listener
    cancelled while it subscribed went on to read its subscription for good, and ``close``
    waited for it for ever (a hung CI run; 5 of 120 closes that came 0-30 ms after the start
    hung in ``tests/metaserver/test_redis_store.py`` before this)."""
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=_RECANCEL_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task
