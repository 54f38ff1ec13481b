"""pdgate proxy: an OpenAI-compatible prefill/decode router.

* ``proxy.app.create_app`` — the ASGI app; ``proxy.cli.main`` — ``pd-proxy``;
* ``proxy.handler`` — the completion endpoints; ``proxy.routing`` — selection (decision, D, P)
  and the attempt loop (load, retries); ``proxy.flows`` — decode-first / concurrent /
  prefill-first / direct;
* ``proxy.backend`` — the data-path HTTP seam, implemented by ``proxy.native`` (default) and
  ``proxy.aiohttp_backend``; ``tests.proxy.mock`` — an in-memory ``MockBackend`` for tests (wired
  with ``Runtime.wire``); ``proxy.server`` — pd-proxy's uvicorn protocol;
* ``proxy.policies`` — selection policies; ``proxy.instances`` — registry, health, circuit,
  discovery; ``proxy.config`` — settings; ``proxy.errors`` — exception tree.
"""

from proxy.app import create_app
from proxy.config import ProxySettings

__all__ = ["ProxySettings", "create_app"]
