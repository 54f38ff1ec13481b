"""Routing: which instances a request's attempts go to, and the loop that runs the attempts.

``select`` (the ``Selector``: annotate, pick D, decide the flow, pick P → a ``Selection``),
``decide`` (disaggregate or not), ``pairing`` (whether a P may push into a D), ``attempts``
(the ``Dispatcher``: load, retries, backoff, charging), ``listeners`` and ``kv`` (what follows a
route without steering it: the shared load, KV placement)."""

from proxy.routing.attempts import Dispatcher, Opened
from proxy.routing.decide import Decider
from proxy.routing.listeners import RouteListener, SharedLoad
from proxy.routing.pairing import Pairing
from proxy.routing.select import NO_ANNOTATION, Annotator, Policies, Selection, Selector

__all__ = [
    "NO_ANNOTATION",
    "Annotator",
    "Decider",
    "Dispatcher",
    "Opened",
    "Pairing",
    "Policies",
    "RouteListener",
    "Selection",
    "Selector",
    "SharedLoad",
]
