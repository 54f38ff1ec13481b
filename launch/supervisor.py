"""Start children in their own process groups, wait until they are healthy (showing progress),
watch them, and stop every one of them — on Ctrl-C, on SIGTERM, or when any child dies."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import httpx

from launch.options import Child

Printer = Callable[[str], None]


class ChildFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self, children: list[Child], log_dir: Path, out: Printer = print) -> None:
        self.children = children
        self.log_dir = log_dir
        self.out = out
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[TextIO] = []
        self._stopping = threading.Event()

    # ---- start ----------------------------------------------------------------------------
    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for child in self.children:
            self._spawn(child)

    def _spawn(self, child: Child) -> None:
        log = open(self.log_dir / f"{child.name}.log", "a")
        self._logs.append(log)
        in_main_thread = threading.current_thread() is threading.main_thread()
        self.procs[child.name] = subprocess.Popen(
            child.argv,
            env={**os.environ, **child.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # its own process group (we stop its whole tree) in our session: a new session
            # would be a scheduling group of its own under kernel autogroups (docs/launch.md)
            process_group=0,
            # the parent-death signal follows the *thread* that forks: only from the main one
            preexec_fn=_die_with_parent if in_main_thread else None,
        )
        self.out(f"started {child.name} (pid {self.procs[child.name].pid}), log: {log.name}")

    def restart(self, name: str, grace_s: float = 15.0) -> None:
        """Stop child ``name`` (SIGTERM to its group, SIGKILL after ``grace_s``) and start it
        again with the same command; its log goes on in the same file."""
        child = next(c for c in self.children if c.name == name)
        proc = self.procs[name]
        self._signal(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.out(f"{name} did not stop in {grace_s:.0f}s: killing it")
        self._signal(proc, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(5)
        self._spawn(child)

    def dead(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def wait_ready(self, timeout_s: float, interval_s: float = 2.0) -> None:
        """Poll every health URL until all answer, printing progress; raise if a child dies."""
        started = time.monotonic()
        ready: set[str] = set()
        last_report = 0.0
        with httpx.Client(timeout=2.0) as http:
            while len(ready) < len(self.children):
                if self._stopping.is_set():
                    raise ChildFailed("interrupted")
                if dead := self.dead():
                    raise ChildFailed(
                        f"{', '.join(dead)} exited during start-up:\n{self.tail(dead[0])}"
                    )
                engines_up = all(c.name in ready for c in self.children if c.kind != "gate")
                for child in self.children:
                    if child.name in ready or (child.kind == "gate" and not engines_up):
                        continue  # a gate (the proxy) counts only once what it routes to is up
                    try:
                        if http.get(child.health_url).status_code == 200:
                            ready.add(child.name)
                            self.out(f"[{time.monotonic() - started:5.1f}s] {child.name} is ready")
                    except httpx.HTTPError:
                        pass
                elapsed = time.monotonic() - started
                if elapsed > timeout_s:
                    waiting = [c.name for c in self.children if c.name not in ready]
                    raise ChildFailed(f"not ready after {timeout_s:.0f}s: {', '.join(waiting)}")
                if elapsed - last_report >= 10 and len(ready) < len(self.children):
                    waiting = [c.name for c in self.children if c.name not in ready]
                    self.out(
                        f"[{elapsed:5.1f}s] waiting for {', '.join(waiting)} "
                        f"({len(ready)}/{len(self.children)} ready)"
                    )
                    last_report = elapsed
                time.sleep(interval_s if len(ready) < len(self.children) else 0)

    def watch(self, poll_s: float = 0.5) -> str | None:
        """Block until a child dies (returns its name) or ``stop_soon`` is called (None)."""
        while not self._stopping.wait(poll_s):
            if dead := self.dead():
                return dead[0]
        return None

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; True when ``stop_soon`` was called meanwhile."""
        return self._stopping.wait(seconds)

    def stop_soon(self) -> None:
        self._stopping.set()

    # ---- stop -----------------------------------------------------------------------------
    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process group (proxy first, metaserver last), then SIGKILL stragglers."""
        self._stopping.set()
        for name in reversed(list(self.procs)):
            self._signal(self.procs[name], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.out(f"{name} did not stop in {grace_s:.0f}s: killing it")
        for proc in self.procs.values():
            self._signal(proc, signal.SIGKILL)  # the group: children of children too
            if proc.poll() is None:
                proc.wait(5)
        deadline = time.monotonic() + 5
        while any(group_alive(p.pid) for p in self.procs.values()):
            if time.monotonic() > deadline:
                self.out("some processes survived SIGKILL (uninterruptible I/O?)")
                break
            time.sleep(0.02)
        for log in self._logs:
            log.close()

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it if the supervisor dies, even by
    SIGKILL — the one exit the supervisor cannot clean up after."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the group stop in stop() still applies
        pass


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is still in process group ``pgid``."""
    if not Path("/proc").exists():  # not Linux: ask the kernel about the group as a whole
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    return bool(group_members({pgid}))


def group_members(pgids: set[int]) -> list[int]:
    """The live (non-zombie) processes in any of the process groups ``pgids`` (Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            found.append(int(entry.name))
    return found
