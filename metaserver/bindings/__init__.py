"""Bindings: where prefill must push a transfer's KV, and its state history.

``service``: the operations (put, read and long-poll, events, marks), framework-free;
``batch``: several writes in one request; ``feeds``: new bindings streamed to proxies;
``fastpath``: the ASGI layer in front of FastAPI that serves the hot calls (and the vllm-ascend
compat call) through the same functions; ``routes``: the documented HTTP edge. The records and
their rules are the store's (``metaserver.store``).
"""
