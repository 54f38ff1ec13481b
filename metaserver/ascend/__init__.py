"""vllm-ascend compatibility: the URL unchanged ``MooncakeLayerwiseConnector`` decode engines POST
their blocks to (``POST /v1/ascend/metaserver``).

The body (``pdwire.ascend.AscendBinding``) is validated, its ``remote_host:remote_port`` checked
against the decode pool this deployment knows, and it is stored as a binding under D's request
id, the way ``PUT /v1/bindings/{id}`` stores pdgate's own. The answer comes at once: D's
scheduler thread is never held for the prefill (the example proxy held it until P finished).

The decode pool (``DecodeEndpoints``): ``--ascend-decode HOST:PORT[-PORT]`` entries, HOST an
address or a DNS name (a headless Service: every address it resolves to), re-resolved every few
seconds; plus, unless ``--no-ascend-registry``, the KV endpoints of registered decode instances.
A binding naming anything else is refused (422): whoever can reach this URL must not be able to
send P's KV push elsewhere. D sends no Authorization header: where the metaserver needs
credentials, the URL carries ``?rid=<X-Request-Id>&cap=<capability>`` (``pdwire.ascend.capability``,
keyed with a proxy's token; the proxy builds such URLs), good for that request's bindings alone.

``pool``: the decode pool (``PoolEntry``, ``DecodeEndpoints``); ``compat``: who may post and what
is stored (``authorize``, ``post_binding``, which the fast path calls too); ``routes``: the
documented route.
"""
