"""Capacity: where the time to first token goes, and what P:D to run.

``breakdown``: finished bindings as timelines of five stages, their spreads overall and per
instance; ``advice``: the queueing model and the P:D recommendation it makes for a target;
``advisor``: both served from the store's recent bindings (``GET /v1/breakdown``) and kept in
the ``pool_recommended`` gauges; ``quantile``: the one quantile definition (``/v1/stats`` uses it
too); ``routes``: the HTTP edge.
"""
