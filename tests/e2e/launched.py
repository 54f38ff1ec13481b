"""``pd-launch`` run as a user runs it: its command line in a subprocess, what it prints read
back (endpoints, the files holding the launch's secrets, the sample curl), and Ctrl-C at the
end, after which nothing it started may be left. Shared by the modules that start a deployment
through pd-launch's command line instead of its plan (``tests/e2e/stack.py``)."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from launch.supervisor import group_alive
from tests.e2e.engine_metrics import prompt_tokens_by_source

READY_LINE = "Ctrl-C stops everything"


@dataclass
class Launched:
    """A running ``pd-launch`` and what it printed."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def text(self) -> str:
        return "\n".join(self.lines)

    def endpoint(self, label: str) -> str:
        """The first URL pd-launch printed after ``pdgate is up:`` on the line labelled
        ``label`` (``proxy (OpenAI API)``, ``metaserver``, ``prefill``, ``decode``)."""
        return self.endpoints(label)[0]

    def endpoints(self, label: str) -> list[str]:
        up = self.lines.index("pdgate is up:")
        found = []
        for line in self.lines[up + 1 :]:
            if line.strip().startswith("curl "):
                break
            head, _, rest = line.strip().partition("  ")
            if head == label:
                found.append(rest.split()[0])
        assert found, f"pd-launch printed no {label!r} endpoint:\n{self.text()}"
        return found

    @property
    def proxy(self) -> str:
        """The proxy's base URL (pd-launch prints the OpenAI API's, ``…/v1``)."""
        return self.endpoint("proxy (OpenAI API)").removesuffix("/v1")

    def url_of(self, name: str) -> str:
        """Engine ``name`` (``prefill-0``, ``decode-1``…): the k-th URL printed for its role."""
        role, k = name.rsplit("-", 1)
        return self.endpoints(role)[int(k)]

    def secret(self, label: str) -> str:
        """The content of the file pd-launch named on the line labelled ``label`` (``metaserver
        roles``, ``proxy admin key``, ``engines' API key``); it exists while pd-launch runs."""
        return self.secret_file(label).read_text().strip()

    def secret_file(self, label: str) -> Path:
        for line in self.lines:
            head, _, rest = line.strip().partition("  ")
            if head == label:
                match = re.search(r" in (/\S+)", rest)
                assert match, line
                return Path(match[1])
        raise AssertionError(f"pd-launch named no file for {label!r}:\n{self.text()}")

    def curl(self) -> list[str]:
        """The sample ``curl`` command pd-launch printed (two lines), as argv."""
        at = next(i for i, line in enumerate(self.lines) if line.strip().startswith("curl -s"))
        command = self.lines[at].strip().rstrip("\\") + " " + self.lines[at + 1].strip()
        return shlex.split(command)

    def served_model(self) -> str:
        """The model name in the sample curl's body."""
        argv = self.curl()
        return str(json.loads(argv[argv.index("-d") + 1])["model"])

    def log_of(self, name: str) -> str:
        """What child ``name`` wrote to the log pd-launch named for it."""
        match = re.search(rf"started {re.escape(name)} \(pid \d+\), log: (\S+)", self.text())
        assert match, f"pd-launch named no log for {name}:\n{self.text()}"
        return Path(match[1]).read_text(errors="replace")

    def child_pids(self) -> list[int]:
        """The pid of every child pd-launch said it started."""
        return [int(p) for p in re.findall(r"\(pid (\d+)\)", self.text())]

    def interrupt(self) -> int:
        """Ctrl-C, as a user stops it; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.reader is not None:
            self.reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


@contextmanager
def pd_launch(argv: Sequence[str], ready_timeout_s: float) -> Iterator[Launched]:
    """Start ``argv`` (a ``pd-launch`` command line) in a process group of its own, echo what it
    prints to stderr (``[pd-launch] …``), hand it over once it printed that everything is up,
    and always Ctrl-C it afterwards. A pd-launch that exits (a child failed) is not waited for."""
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        process_group=0,
    )  # fmt: skip
    launched = Launched(proc)
    up = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            launched.lines.append(line.rstrip())
            print(f"[pd-launch] {line.rstrip()}", file=sys.stderr, flush=True)
            if READY_LINE in line:
                up.set()

    launched.reader = threading.Thread(target=read, daemon=True)
    launched.reader.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not up.wait(0.5):
            ended = proc.poll() is not None or time.monotonic() > deadline
            assert not ended, "pd-launch never became ready:\n" + "\n".join(launched.lines[-30:])
        yield launched
    finally:
        launched.interrupt()


def _stat(pid: int) -> list[str] | None:
    """Fields 3… of ``/proc/PID/stat`` (state, ppid, pgrp, session … start time at [19]) of a
    live process; None for one that is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == "Z" else fields


Proc = tuple[int, str]  # pid, start time: a pid reused later is another process


def processes_of(root: int, groups: Sequence[int]) -> set[Proc]:
    """Every live process descending from ``root`` (itself included) or in one of the
    process ``groups`` (pd-launch starts each child in a process group of its own)."""
    stats = {int(e.name): _stat(int(e.name)) for e in Path("/proc").iterdir() if e.name.isdigit()}
    live = {pid: f for pid, f in stats.items() if f is not None}

    def descends(pid: int) -> bool:
        for _ in range(64):
            if pid == root:
                return True
            if pid <= 1 or pid not in live:
                return False
            pid = int(live[pid][1])
        return False

    return {(pid, f[19]) for pid, f in live.items() if int(f[2]) in groups or descends(pid)}


def alive(procs: set[Proc]) -> set[Proc]:
    return {(pid, born) for pid, born in procs if (f := _stat(pid)) and f[19] == born}


def check_curl_then_ctrl_c(launched: Launched, children: int) -> None:
    """What pd-launch promises a user at the end: it printed ``children`` children with their
    pids and a curl command that answers; Ctrl-C then stops it (exit 0), every process it
    started, however deep, is gone, and so are the files holding the launch's secrets."""
    text = launched.text()
    pids = launched.child_pids()
    assert len(pids) == children, text
    answer = subprocess.run(launched.curl(), capture_output=True, text=True, timeout=120)
    assert '"choices"' in answer.stdout, answer.stdout + answer.stderr
    secrets = [
        launched.secret_file(label)
        for label in ("metaserver roles", "proxy admin key", "engines' API key")
        if label in text
    ]
    assert secrets and all(f.exists() for f in secrets), text
    procs = processes_of(launched.proc.pid, pids)
    assert len(procs) >= children, procs
    assert launched.interrupt() == 0
    assert "all processes stopped" in launched.text()
    deadline = time.monotonic() + 10
    while alive(procs) or any(group_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"pd-launch left processes behind: {alive(procs)}"
        time.sleep(0.1)
    assert not [f for f in secrets if f.exists()], "pd-launch left its secrets behind"


def delta(after: dict[str, float], before: dict[str, float], source: str) -> float:
    return after.get(source, 0.0) - before.get(source, 0.0)


async def sources_after(url: str, before: dict[str, float], tokens: int) -> dict[str, float]:
    """The counters once ``tokens`` more prompt tokens are accounted for (stats may land just
    after the response), or as they are after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        now = await prompt_tokens_by_source(url)
        if sum(now.values()) - sum(before.values()) >= tokens or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)
