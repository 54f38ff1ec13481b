"""Which answers can be continued exactly (``refusal``), and per break what becomes of the
stream (``Migrator.plan``), counted in ``pd_migrations_total``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from proxy.migration.splice import closing_events, continuation
from proxy.migration.tape import Tape
from proxy.rewrite import ClientRequest

if TYPE_CHECKING:
    from proxy.metrics import Metrics
    from proxy.sse import Broken, EventHook

_GUIDED = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "tools", "functions",
)  # fmt: skip


def refusal(req: ClientRequest) -> str | None:
    """Why this request's answer cannot be continued exactly on another pair (``None``: it
    can). Decided once, when the request is parsed."""
    body = req.body
    if not req.stream:
        return "not streamed (retried from the start before its first byte instead)"
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "several choices"
    if body.get("prompt_logprobs") or (req.chat and body.get("logprobs")):
        return "chat logprobs or prompt logprobs"
    if body.get("echo"):
        return "echo"
    if body.get("stop"):
        return "stop strings"
    for key in _GUIDED:
        value = body.get(key)
        if value and not (key == "response_format" and _plain_text(value)):
            return "structured output or tools"
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "presence or frequency penalty"
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("continuous_usage_stats"):
        return "continuous usage stats"
    if not req.chat and not _single_prompt(body.get("prompt")):
        return "several prompts"
    return None


def _plain_text(fmt: Any) -> bool:
    return isinstance(fmt, dict) and fmt.get("type") == "text"


def _single_prompt(prompt: Any) -> bool:
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    )


class Plan(NamedTuple):
    """What becomes of a broken stream: ``outcome`` (``pd_migrations_total``), and for
    ``continued`` the continuation to send, for ``closed`` the client's last events."""

    outcome: str
    request: ClientRequest | None = None
    closing: bytes = b""
    why: str = ""


class Migrator:
    """Carries streamed answers over D's breaks, at most ``limit`` times per request."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self._counts = metrics.migrations

    def tape(self, req: ClientRequest) -> Tape | None:
        """A tape for ``req`` when its answer could be continued (D's leg then asks for
        token ids); ``None`` when it could not (or migration is off)."""
        if self.limit <= 0 or not req.stream or refusal(req) is not None:
            return None
        req.track_ids = True
        prompt = req.body.get("prompt")
        ids = list(prompt) if not req.chat and isinstance(prompt, list) else None
        return Tape(ids)

    def hook(self, req: ClientRequest, tape: Tape) -> EventHook:
        """The first answer's events: recorded, their ids hidden unless the client asked."""
        take, hide = tape.take, not req.body.get("return_token_ids")

        def hook(payload: bytes) -> bytes:
            return take(payload, hide)

        return hook

    def plan(
        self, req: ClientRequest, tape: Tape | None, broken: Broken, elsewhere: bool = True
    ) -> Plan:
        """What to do now that ``broken`` happened; ``elsewhere``: a decode instance other than
        the broken one is available (the same one is never asked again: a frozen D would hold
        the continuation up to ``--first-token-timeout``)."""
        if tape is None:
            why = refusal(req) if self.limit > 0 else "migration is off"
            return self._count(broken, Plan("refused", why=why or "not tracked"))
        if tape.finish is not None:
            return self._count(broken, Plan("closed", closing=closing_events(req, tape)))
        unfit = tape.unfit()
        if unfit is not None:
            return self._count(broken, Plan("refused", why=unfit))
        if tape.migrations >= self.limit:
            return self._count(broken, Plan("limit", why=f"--migration-limit {self.limit}"))
        if not elsewhere:
            return self._count(broken, Plan("failed", why="no other decode instance available"))
        cont = continuation(req, tape)
        if cont is None:
            return self._count(broken, Plan("closed", closing=closing_events(req, tape)))
        tape.rewind()
        tape.migrations += 1
        return Plan("continued", request=cont)

    def counted(self, broken: Broken, outcome: str) -> None:
        self._counts.labels(broken.reason, outcome).inc()

    def _count(self, broken: Broken, plan: Plan) -> Plan:
        self.counted(broken, plan.outcome)
        return plan
