"""pd-launch's supervisor: progress while starting, and no orphans however it ends."""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from launch.options import Child
from launch.supervisor import ChildFailed, Supervisor
from tests.support.procs import free_port

# A child that serves /health after a delay and spawns a grandchild (like vLLM's engine core).
SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys, time, os
    delay, port, pidfile = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pidfile, "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    time.sleep(delay)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def server_child(tmp: Path, name: str, delay: float) -> tuple[Child, Path]:
    port = free_port()
    script = tmp / "server.py"
    script.write_text(SERVER)
    pidfile = tmp / f"{name}.pids"
    argv = [sys.executable, str(script), str(delay), str(port), str(pidfile)]
    return Child(name, argv, f"http://127.0.0.1:{port}/health", kind="engine"), pidfile


def pids(pidfile: Path) -> list[int]:
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return [int(x) for x in pidfile.read_text().split()]


def test_supervisor_reports_progress_and_stops_whole_trees(tmp_path: Path) -> None:
    a, pa = server_child(tmp_path, "fast", 0.1)
    b, pb = server_child(tmp_path, "slow", 1.5)
    lines: list[str] = []
    sup = Supervisor([a, b], tmp_path / "logs", lines.append)
    sup.start()
    try:
        sup.wait_ready(timeout_s=30, interval_s=0.2)
        everyone = pids(pa) + pids(pb)
        assert all(alive(p) for p in everyone)
    finally:
        sup.stop(grace_s=5)
    assert not any(alive(p) for p in everyone), "orphans left behind"
    text = "\n".join(lines)
    assert "started fast" in text and "started slow" in text
    assert "fast is ready" in text and "slow is ready" in text
    assert (tmp_path / "logs" / "slow.log").exists()


def test_supervisor_stops_everything_when_one_child_dies(tmp_path: Path) -> None:
    a, pa = server_child(tmp_path, "engine", 0.1)
    crasher = Child(
        "crasher",
        [sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(3)"],
        "http://127.0.0.1:1/health",
    )
    sup = Supervisor([a, crasher], tmp_path / "logs", lambda s: None)
    sup.start()
    try:
        everyone = pids(pa)
        assert sup.watch(poll_s=0.1) == "crasher"
    finally:
        sup.stop(grace_s=5)
    assert not any(alive(p) for p in everyone)


def test_supervisor_start_up_failure_is_reported_with_log_tail(tmp_path: Path) -> None:
    bad = Child(
        "broken",
        [sys.executable, "-c", "print('model not found: /nope'); raise SystemExit(1)"],
        "http://127.0.0.1:1/health",
    )
    sup = Supervisor([bad], tmp_path / "logs", lambda s: None)
    sup.start()
    try:
        with pytest.raises(ChildFailed, match="broken exited during start-up") as err:
            sup.wait_ready(timeout_s=30, interval_s=0.1)
        assert "model not found" in str(err.value)
    finally:
        sup.stop()


def test_supervisor_stop_soon_interrupts_waiting(tmp_path: Path) -> None:
    slow, ps = server_child(tmp_path, "slow", 60)
    sup = Supervisor([slow], tmp_path / "logs", lambda s: None)
    sup.start()
    threading.Timer(0.5, sup.stop_soon).start()
    try:
        with pytest.raises(ChildFailed, match="interrupted"):
            sup.wait_ready(timeout_s=30, interval_s=0.1)
        everyone = pids(ps)
    finally:
        sup.stop(grace_s=5)
    assert not any(alive(p) for p in everyone)


def test_supervisor_checks_a_gate_only_after_the_others(tmp_path: Path) -> None:
    """The proxy (a gate) is ready only when it answers after the engines are up: an early
    200 from it, before it could have seen them, does not count."""
    engine, _ = server_child(tmp_path, "engine", 1.0)
    gate_port = free_port()
    script = tmp_path / "gate.py"
    script.write_text(
        "import http.server, sys\n"
        "hits = []\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        hits.append(1); print('probed', flush=True)\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {gate_port}), H).serve_forever()\n"
    )
    gate = Child(
        "gate", [sys.executable, str(script)], f"http://127.0.0.1:{gate_port}/h", kind="gate"
    )
    lines: list[str] = []
    sup = Supervisor([gate, engine], tmp_path / "logs", lines.append)
    sup.start()
    try:
        sup.wait_ready(timeout_s=30, interval_s=0.1)
    finally:
        sup.stop(grace_s=5)
    ready = [line.split("] ")[1] for line in lines if "is ready" in line]
    assert ready == ["engine is ready", "gate is ready"]


def test_supervisor_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    """Even SIGKILL of pd-launch itself leaves no engine behind (Linux parent-death signal)."""
    pidfile = tmp_path / "child.pid"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from launch.options import Child\n"
        "from launch.supervisor import Supervisor\n"
        f"child = Child('c', [sys.executable, '-c', 'import time; time.sleep(600)'], 'http://x')\n"
        f"sup = Supervisor([child], Path({str(tmp_path)!r}), lambda s: None)\n"
        "sup.start()\n"
        f"Path({str(pidfile)!r}).write_text(str(sup.procs['c'].pid))\n"
        "time.sleep(600)\n"
    )
    import signal
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 20
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child_pid = int(pidfile.read_text())
        assert alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while alive(child_pid):
            assert time.monotonic() < deadline, "child outlived its killed supervisor"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_supervisor_restart_replaces_one_child_and_its_tree(tmp_path: Path) -> None:
    a, pa = server_child(tmp_path, "engine", 0.1)
    b, pb = server_child(tmp_path, "other", 0.1)
    sup = Supervisor([a, b], tmp_path / "logs", lambda s: None)
    sup.start()
    try:
        sup.wait_ready(timeout_s=30, interval_s=0.2)
        before, untouched = pids(pa), pids(pb)
        pa.unlink()
        sup.restart("engine", grace_s=5)
        sup.wait_ready(timeout_s=30, interval_s=0.2)
        after = pids(pa)
        assert not any(alive(p) for p in before), "the old tree survived the restart"
        assert all(alive(p) for p in after + untouched) and set(after).isdisjoint(before)
    finally:
        sup.stop(grace_s=5)
    assert not any(alive(p) for p in after + untouched)


def test_pd_launch_restart_starts_a_dead_child_again_and_keeps_the_rest(tmp_path: Path) -> None:
    """``pd-launch --restart``: a child that exits is started again with its own command (its
    log goes on), the others keep running; a stop ends the watch."""
    from launch.cli import serve

    a, pa = server_child(tmp_path, "engine", 0.1)
    counter = tmp_path / "starts"
    crasher = Child(
        "crasher",
        [sys.executable, "-c",
         f"import pathlib, time; p = pathlib.Path({str(counter)!r}); "
         "p.write_text(p.read_text() + 'x' if p.exists() else 'x'); time.sleep(0.3)"],
        "http://127.0.0.1:1/health",
    )  # fmt: skip
    lines: list[str] = []
    sup = Supervisor([a, crasher], tmp_path / "logs", lines.append)
    sup.start()
    watching = threading.Thread(
        target=lambda: lines.append(
            f"code {serve(sup, lines.append, restart=True, backoff_cap_s=0.2)}"
        )
    )
    watching.start()
    try:
        engine = pids(pa)
        deadline = time.monotonic() + 20
        while not counter.exists() or len(counter.read_text()) < 3:
            assert time.monotonic() < deadline, lines
            time.sleep(0.05)
        assert all(alive(p) for p in engine), "the other child was stopped"
    finally:
        sup.stop_soon()
        watching.join(10)
        sup.stop(grace_s=5)
    assert "code 0" in lines
    assert any("crasher exited (exit 2); starting it again" in line for line in lines), lines
