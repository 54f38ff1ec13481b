"""A side-channel key file for tests that start the connector (it refuses an unsealed side
channel unless told ``insecure_side_channel``): one random key per test session, in a private
temporary directory removed at exit. Its path goes into the environment (``ENV``), so the P and
D processes a test starts read the same key."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

ENV = "PDGATE_TEST_SIDE_CHANNEL_KEY_FILE"
_FILE: list[str] = []


def key_file() -> str:
    """The session's key file (made at the first call, unless a parent process made one)."""
    if not _FILE and os.environ.get(ENV):
        _FILE.append(os.environ[ENV])
    if not _FILE:
        directory = tempfile.mkdtemp(prefix="pdgate-test-key-")  # mode 0700
        atexit.register(shutil.rmtree, directory, True)
        path = Path(directory) / "side-channel.key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        _FILE.append(str(path))
        os.environ[ENV] = str(path)  # the processes this one starts
    return _FILE[0]


def sealed(extra: dict[str, object]) -> dict[str, object]:
    """``extra`` (a ``kv_connector_extra_config``) with the session's key unless it names its
    own or asks for the insecure mode."""
    if "side_channel_secret_file" in extra or extra.get("insecure_side_channel"):
        return extra
    return {**extra, "side_channel_secret_file": key_file()}
