"""The metaserver's KV-event follower reads no frame over ``MAX_EVENT_BYTES``: an engine (or
anyone who registers a publisher) cannot make it buffer frames of any size (review 2, N11), and
the follower goes on (ZeroMQ itself does not reconnect a socket it dropped for that).
vLLM publishes one batch per engine step, about 16 bytes per token stored: 16 MiB is a step of
a million tokens."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from metaserver.backend import Backend
from metaserver.kvindex import follower
from metaserver.kvindex.follower import Follower, Source
from pdwire.kv_events import seq_frame
from tests.metaserver.test_kvindex import _h, batch, free_port, stored

pytestmark = pytest.mark.timeout(60)


def test_the_cap_holds_a_step_of_a_million_tokens_and_not_much_more() -> None:
    assert 1 << 20 <= follower.MAX_EVENT_BYTES // 16 <= 4 << 20


async def test_a_frame_over_the_cap_never_reaches_the_follower(backend: Backend) -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    index = backend.kv_index
    f = Follower("e1", Source(f"tcp://127.0.0.1:{port}", None, "kv"), index, ctx)
    task = asyncio.create_task(f.run())
    small = msgspec.msgpack.encode(batch(stored(1)))
    seq = 0

    async def publish_until(applied: int) -> None:
        nonlocal seq
        deadline = time.monotonic() + 20
        while f.stats.batches < applied:  # PUB drops what it sends before a subscriber is in
            assert time.monotonic() < deadline, "the follower never got a batch"
            await pub.send_multipart([b"kv", seq_frame(seq), small])
            seq += 1
            await asyncio.sleep(0.05)

    try:
        await publish_until(1)
        garbage = b"\xc1" * (follower.MAX_EVENT_BYTES + 1)  # not msgpack: "bad" if read
        await pub.send_multipart([b"kv", seq_frame(seq), garbage])
        seq += 1
        await publish_until(f.stats.batches + 1)  # the follower goes on (reconnected)
        assert f.stats.bad == 0 and f.stats.reconnects >= 1  # dropped, then a new connection
        assert await index.match([int.from_bytes(_h(1)[-8:], "big")], ["e1"]) == {"e1": 1}
    finally:
        task.cancel()
        pub.close(0)
        ctx.destroy(linger=0)
