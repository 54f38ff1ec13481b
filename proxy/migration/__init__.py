"""Mid-stream migration: when D breaks after the client has part of a streamed answer (the
connection drops, D dies, or it sends nothing for ``--idle-timeout``), the same answer goes on
from another pair instead of ending with an error.

The proxy keeps what the client was sent as token ids (D's leg asks for ``return_token_ids``;
the ids are hidden again from a client that did not ask), and on a break sends a continuation:
a ``/v1/completions`` request whose prompt is the request's prompt token ids plus the tokens
generated so far, disaggregated again (P prefills all of it, D goes on), with ``max_tokens`` and
``min_tokens`` reduced by what was generated. Its events are spliced into the client's stream:
the first answer's ``id``, ``created`` and ``model``, a chat request's chunk shape, usage summed.
Greedy output is the same as an uninterrupted run's.

Replay is exact only when the continuation samples what the first D would have; the requests
where it cannot be (``refusal``) end with an error event as before, and are counted: several
choices, a chat request's logprobs, prompt logprobs, echo, stop strings (D holds back text that
may start one, so the client's text lags the ids), structured output and tools, presence and
frequency penalties (they count only generated tokens, and the replayed ones become prompt). A
completion's logprobs go on, their ``text_offset`` shifted past the text already sent. A seeded
request's sampler starts again from its seed after the splice. The ids replayed end where the
client's text does: tokens whose text D had not sent yet (an incomplete UTF-8 character) are
generated again, and the client gets only their text then (it has their ids and logprobs).

``tape`` records what the client got; ``splice`` makes the continuation and fits its events into
the client's stream; ``migrator`` decides, per break, what becomes of the stream.
"""

from proxy.migration.migrator import Migrator, Plan, refusal
from proxy.migration.splice import COMPLETIONS, Splicer, closing_events, continuation
from proxy.migration.tape import Tape, hide_ids

__all__ = [
    "COMPLETIONS",
    "Migrator",
    "Plan",
    "Splicer",
    "Tape",
    "closing_events",
    "continuation",
    "hide_ids",
    "refusal",
]
