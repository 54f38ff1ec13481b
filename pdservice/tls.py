"""TLS on the proxy's and the metaserver's listeners (``--tls-cert`` / ``--tls-key``).

Both files are PEM; the certificate file may hold the chain. Given together or not at all, and
read at start (a clear error then, not at the first connection). uvicorn serves the TLS.
"""

from __future__ import annotations

import ssl
from typing import Any

from pydantic import BaseModel, Field, model_validator


class TlsListener(BaseModel):
    tls_cert_file: str = Field("", description="PEM certificate (chain) to serve HTTPS with")
    tls_key_file: str = Field("", description="PEM private key of --tls-cert")

    @model_validator(mode="after")
    def _pair(self) -> TlsListener:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_cert_file:
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    self.tls_cert_file, self.tls_key_file
                )
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot serve TLS with {self.tls_cert_file}: {exc}") from None
        return self

    def uvicorn_tls(self) -> dict[str, Any]:
        """uvicorn's keyword arguments for these files (none without TLS)."""
        if not self.tls_cert_file:
            return {}
        return {"ssl_certfile": self.tls_cert_file, "ssl_keyfile": self.tls_key_file}

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert_file else "http"
