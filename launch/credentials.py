"""Roles mode's secrets: a credential per part, written to files only this user can read."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from launch.options import Child

CREDENTIALS = "credentials.yaml"
ADMIN_TOKEN = "admin.token"
PROXY_ADMIN_KEY = "proxy-admin.key"  # the proxy's /admin and /v1/instances


def give_credentials(directory: Path, children: list[Child]) -> None:
    """Roles mode: a fresh token per engine (bound to its instance id and role), one for the
    proxy and one for an admin (``ADMIN_TOKEN``), the metaserver's credentials file listing
    them, and the proxy's admin key (``PROXY_ADMIN_KEY``); each part gets its own in its
    environment. Files are readable by this user only."""
    entries = []
    for child in children:
        token = secrets.token_urlsafe(24)
        if child.kind == "engine":
            role = "prefill" if child.name.startswith("prefill") else "decode"
            entries.append({"name": child.name, "role": "engine", "instance": child.name,
                            "engine_role": role, "token": token})  # fmt: skip
            child.env["PDGATE_METASERVER_TOKEN"] = token
        elif child.name == "proxy":
            entries.append({"name": "proxy", "role": "proxy", "token": token})
            child.env["PD_PROXY_METASERVER_TOKEN"] = token
            key = secrets.token_urlsafe(24)  # the operator's: drains, what the proxy sees
            child.env["PD_PROXY_ADMIN_KEYS"] = key
            write_private(directory / PROXY_ADMIN_KEY, key + "\n")
    admin = secrets.token_urlsafe(24)
    entries.append({"name": "admin", "role": "admin", "token": admin})
    write_private(directory / ADMIN_TOKEN, admin + "\n")
    write_private(directory / CREDENTIALS, json.dumps({"credentials": entries}, indent=1))  # YAML


def write_private(path: Path, text: str, *, new: bool = False) -> None:
    """Write ``text`` to a file only this user can read (``new``: refuse one that exists)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if new else os.O_TRUNC)
    with os.fdopen(os.open(path, flags, 0o600), "w") as f:
        f.write(text)
