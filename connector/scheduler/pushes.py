"""What P's scheduler keeps per request, from the first time it looks at it until it finishes.

A ``PrefillRequest`` holds the request's push parameters (parsed once), whether P took the
lease on its binding (admission.py) or why it pushes nothing, and, once its blocks are
allocated, its ``Push``: D's blocks and the next one to hand the workers. Each step ``Push.step``
turns the tokens scheduled into the chunk the workers push: the blocks that became complete in
this chunk (full blocks only; the tail block on the last chunk; blocks D already has are
skipped), and on the last chunk the transfer's end. A traced request (tracing on, the proxy's
context sampled) keeps its events for the ``pdgate.connector.prefill`` span (``PrefillTrace``).

Runs in vLLM's EngineCore process, on its scheduler's thread (``PrefillSide``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector.metadata import Destination, SendChunk
from connector.tracing import ConnectorTracer, Event
from pdwire.errors import ParamsError
from pdwire.models import Binding
from pdwire.params import SendParams, parse_prefill_leg
from pdwire.trace import TraceParent

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class Push:
    request: Request
    transfer_id: str
    dest: Destination
    d_blocks: list[int]
    prompt_len: int
    next_block: int  # first block not handed to the workers yet
    emitted: bool = False
    closed: bool = False
    traceparent: str = ""  # handed to the workers with each chunk (tracing on)

    def step(self, scheduled: int, p_blocks: list[int], block_size: int) -> SendChunk | None:
        """The chunk of a step that computes ``scheduled`` more tokens into ``p_blocks`` (P's
        blocks of the request): the last one closes the push; ``None``: nothing to hand over."""
        end = self.request.num_computed_tokens + scheduled
        last = end >= self.prompt_len
        upto = -(-self.prompt_len // block_size) if last else end // block_size
        upto = min(upto, len(self.d_blocks), len(p_blocks))
        pairs = [(p_blocks[i], self.d_blocks[i]) for i in range(self.next_block, upto)]
        self.next_block = max(self.next_block, upto)
        if last:
            return self.close(pairs)
        if not pairs:
            return None
        self.emitted = True
        return SendChunk(
            self.request.request_id,
            self.transfer_id,
            self.dest,
            pairs,
            False,
            "",
            self.traceparent,
        )

    def close(self, pairs: list[tuple[int, int]], fail: str = "") -> SendChunk:
        """The push's last chunk: the workers end the transfer after it (failed: ``fail``)."""
        rid = self.request.request_id
        self.emitted = True
        self.closed = True
        return SendChunk(rid, self.transfer_id, self.dest, pairs, True, fail, self.traceparent)


@dataclass
class PrefillTrace:
    """A traced request on P (tracing on, the proxy's context sampled)."""

    parent: TraceParent
    start: float  # wall clock: P's scheduler first saw the request
    events: list[Event]

    def emit(
        self, tracer: ConnectorTracer, request: Request, report: dict[str, Any] | None, end: float
    ) -> None:
        """The ``pdgate.connector.prefill`` span: first seen → finished, with the report."""
        attributes: dict[str, str | int] = {
            "pdgate.request_id": request.request_id,
            "pdgate.prompt_tokens": len(request.prompt_token_ids or ()),
        }
        if report is not None:
            attributes["pdgate.transfer_id"] = str(report.get("transfer_id") or "")
            attributes["pdgate.push"] = str(report.get("push", ""))
            if report.get("reason"):
                attributes["pdgate.no_push_reason"] = str(report["reason"])
        self.events.append(Event("finished", end))
        tracer.emit(
            "pdgate.connector.prefill", self.parent, self.start, end, attributes, self.events
        )


@dataclass
class PrefillRequest:
    """What P knows of one request, from the first time it looks at it until ``finished``."""

    params: SendParams | None  # None: the request asked for no push, or asked badly
    push: Push | None = None  # set up by ``after_alloc``
    no_push: str | None = None  # why P will push nothing for it
    doubted_at: float | None = None  # when the registry first said no (``registry_grace_s``)
    claiming: Binding | None = None  # P asked for the lease on this binding
    claimed: Binding | None = None  # P holds the lease (its ``prefill_started`` won)
    trace: PrefillTrace | None = None


def parse_quietly(request: Request) -> SendParams | None:
    """For a request ``matched`` never saw (aborted while waiting)."""
    try:
        return parse_prefill_leg(request.kv_transfer_params)
    except ParamsError:
        return None
