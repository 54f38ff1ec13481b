"""The side channel's key file, read where it is checked: by each engine's connector and by
``pd-launch`` before it starts them (a clear error at start, not at the first handshake)."""

from __future__ import annotations

from pathlib import Path

MIN_KEY_BYTES = 16


def load_keys(path: str | Path) -> list[bytes]:
    """The keys in ``path``: one per non-empty line, surrounding whitespace stripped; each of
    at least ``MIN_KEY_BYTES`` bytes. A clear ``ValueError`` otherwise."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"side_channel_secret_file {path}: {exc.strerror or exc}") from None
    keys = [line.strip() for line in text.splitlines() if line.strip()]
    if not keys:
        raise ValueError(f"side_channel_secret_file {path} holds no key")
    short = [i + 1 for i, k in enumerate(keys) if len(k) < MIN_KEY_BYTES]
    if short:
        raise ValueError(
            f"side_channel_secret_file {path}: key(s) on line(s) {short} are shorter than "
            f"{MIN_KEY_BYTES} bytes (make one with: head -c 32 /dev/urandom | base64)"
        )
    return keys
