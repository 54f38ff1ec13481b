"""The metaserver's per-store fixtures (``tests/metaserver/conftest.py``), for the attacks that
must fail on every store."""

from tests.metaserver.conftest import api_factory, store_kind, store_time, store_url

__all__ = ["api_factory", "store_kind", "store_time", "store_url"]
