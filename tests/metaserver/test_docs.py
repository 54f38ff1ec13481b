"""The curl cookbook of docs/metaserver.md, executed verbatim against a running server."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable

from tests.support.procs import REPO
from tests.support.services import MetaserverProcess, RedisServer


def cookbook() -> list[str]:
    text = (REPO / "docs" / "metaserver.md").read_text()
    section = text.split("## Curl cookbook", 1)[1]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def test_docs_cookbook_runs_verbatim(
    redis_server: RedisServer, metaserver_factory: Callable[..., MetaserverProcess]
) -> None:
    blocks = cookbook()
    assert len(blocks) >= 5
    ms = metaserver_factory(redis_server.url, "--token", "doc-token", "--namespace", "docs")
    script = "set -euo pipefail\n" + "\n".join(blocks)
    proc = subprocess.run(
        ["bash", "-c", script],
        env={**os.environ, "MS": ms.url, "TOKEN": "doc-token"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert '"instance_id":"decode-0"' in out
    assert '"transfer_id":"tx-1","state":"bound"' in out  # what the watcher saw
    assert '"state":"done"' in out
    assert '{"results":[{"status":201,' in out  # the batch: each call answered as if alone
    assert '"state":"prefill_started"' in out and '{"status":404,' in out
    assert "409\n401\n401\n" in out  # a different binding; a write, then a read, tokenless
    assert '"bindings_by_state"' in out
    assert "pdgate_metaserver_bindings_created_total 2.0" in out
    assert out.count('"draining":true') == 2  # the drain's answer and the listing
    assert '"draining":false' in out.rsplit('{"instance_id"', 1)[1]  # the undrain's answer
