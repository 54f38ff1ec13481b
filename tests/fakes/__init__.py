"""Fake vLLM servers for tests and benchmarks (real HTTP on loopback, no model).

``python -m tests.fakes.vllm --role decode --port N --metaserver URL`` runs one; ``FakeVLLM``
starts one in a subprocess and drives its knobs over HTTP.
"""

from tests.fakes.control import FakeVLLM

__all__ = ["FakeVLLM"]
