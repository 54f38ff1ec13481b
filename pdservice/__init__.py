"""pdservice: what pdgate's processes share beyond the protocol (``pdwire``).

* ``pdservice.listener`` — the proxy's and the metaserver's listener guards (receipt deadlines,
  a per-client connection cap) on uvicorn's httptools protocol;
* ``pdservice.tls`` — TLS on those listeners;
* ``pdservice.asgi`` / ``pdservice.limits`` — ASGI types, the request-body reader, the body cap;
* ``pdservice.settings`` — the layered settings base (flags > env > YAML > defaults) and its CLI;
* ``pdservice.keys`` — the side channel's key file, read by the connector and by ``pd-launch``.

It depends on no part of pdgate; ``pdwire`` stays the contract between them.
"""
