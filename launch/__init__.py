"""``pd-launch``: a whole pdgate deployment on one machine (metaserver, prefill and decode vLLM
servers with the connector, the proxy), for trying pdgate out and for end-to-end tests."""

from launch.options import LaunchPlan
from launch.plan import build_plan
from launch.supervisor import Supervisor

__all__ = ["LaunchPlan", "Supervisor", "build_plan"]
