"""Launch options as pd-launch makes them: the pdgate connector's engines get a side-channel
key file (the plan refuses them without one; it only passes the path on)."""

from __future__ import annotations

from typing import Any

from launch.options import LaunchOptions

KEY_FILE = "/run/pdgate/side-channel.key"


def options(**fields: Any) -> LaunchOptions:
    return LaunchOptions(**{"side_channel_secret_file": KEY_FILE, **fields})
