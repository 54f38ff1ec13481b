"""Read the Dockerfiles in docker/ with Docker's own parser (the `dockerfile` package wraps
BuildKit's Go parser) and replay a build stage's install steps on this machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile

from tests.chart.rendering import REPO

DOCKER_DIR = REPO / "docker"
DOCKERFILES = sorted(DOCKER_DIR.glob("*.Dockerfile"))


@dataclass
class Stage:
    base: str  # the FROM image, ARG defaults substituted
    name: str | None
    commands: list[dockerfile.Command] = field(default_factory=list)

    def all(self, cmd: str) -> list[dockerfile.Command]:
        return [c for c in self.commands if c.cmd == cmd]

    def last(self, cmd: str) -> dockerfile.Command | None:
        found = self.all(cmd)
        return found[-1] if found else None


@dataclass
class Parsed:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def _arg(value: str) -> tuple[str, str]:
    name, _, default = value.partition("=")
    return name, default


def substitute(text: str, variables: dict[str, str]) -> str:
    """Docker's ${VAR} / $VAR substitution (no modifiers needed here)."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return variables.get(name, m.group(0))

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", repl, text)


def parse(path: Path) -> Parsed:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for cmd in dockerfile.parse_file(str(path)):
        if cmd.cmd == "FROM":
            image = substitute(cmd.value[0], global_args)
            name = cmd.value[2] if len(cmd.value) >= 3 and cmd.value[1].upper() == "AS" else None
            stages.append(Stage(base=image, name=name))
        elif not stages:
            if cmd.cmd == "ARG":
                key, default = _arg(cmd.value[0])
                global_args[key] = default
        else:
            stages[-1].commands.append(cmd)
    return Parsed(path=path, global_args=global_args, stages=stages)


# --- .dockerignore --------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
            continue
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        out += {"*": "[^/]*", "?": "[^/]"}.get(ch, re.escape(ch))
        i += 1
    return re.compile(out)


class DockerIgnore:
    """Docker's rules: patterns in order, the last match wins, `!` re-includes, and a pattern
    that matches a directory matches everything under it."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, re.Pattern[str]]] = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            self.rules.append((negate, _pattern_regex(pattern)))

    def excluded(self, rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for negate, regex in self.rules:
            if any(regex.fullmatch(p) for p in prefixes):
                result = not negate
        return result


def build_context(dest: Path, ignore: DockerIgnore) -> Path:
    """Copy the repository as Docker would send it (the build context after .dockerignore)."""
    for root, dirs, files in os.walk(REPO):
        rel_root = os.path.relpath(root, REPO)
        rel_root = "" if rel_root == "." else rel_root
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            rel = f"{rel_root}/{name}" if rel_root else name
            if ignore.excluded(rel):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(root) / name, target)
    return dest


# --- replaying a stage ----------------------------------------------------------------------


@dataclass
class Replay:
    """Runs one stage's WORKDIR / ARG / ENV / COPY / RUN steps with its container paths mapped
    into ``root`` (so /src becomes root/src), as `docker build --build-arg` would with ARGs."""

    root: Path
    context: Path
    env: dict[str, str]
    log: list[str] = field(default_factory=list)

    def path(self, container_path: str, cwd: str) -> Path:
        full = container_path if container_path.startswith("/") else f"{cwd}/{container_path}"
        return self.root / os.path.normpath(full).lstrip("/")

    def run_stage(self, stage: Stage, build_args: dict[str, str]) -> None:
        cwd = "/"
        variables = dict(self.env)
        for cmd in stage.commands:
            if cmd.cmd == "ARG":
                key, default = _arg(cmd.value[0])
                variables[key] = build_args.get(key, default)
            elif cmd.cmd == "ENV":
                pairs = list(cmd.value)
                for k, v in zip(pairs[::2], pairs[1::2], strict=True):
                    variables[k] = substitute(v, variables)
            elif cmd.cmd == "WORKDIR":
                cwd = substitute(cmd.value[0], variables)
                self.path(cwd, "/").mkdir(parents=True, exist_ok=True)
            elif cmd.cmd == "COPY":
                if any(f.startswith("--from") for f in cmd.flags):
                    continue
                *sources, dest = (substitute(v, variables) for v in cmd.value)
                for src in sources:
                    self._copy(self.context / src, dest, cwd, many=len(sources) > 1)
            elif cmd.cmd == "RUN":
                script = " ".join(cmd.value)
                self.log.append(script)
                subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", script],
                    cwd=self.path(cwd, "/"),
                    env={**os.environ, **variables},
                    check=True,
                    timeout=900,
                )

    def _copy(self, src: Path, dest: str, cwd: str, *, many: bool) -> None:
        if not src.exists():
            raise FileNotFoundError(f"COPY source {src} is not in the build context")
        target = self.path(dest, cwd)
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True)
        else:
            if dest.endswith("/") or many:
                target = target / src.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
