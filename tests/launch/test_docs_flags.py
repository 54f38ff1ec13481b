"""The docs explain every flag and connector key, and their commands use only real ones.

A new flag of pd-launch / pd-proxy / pd-metaserver or a new ``kv_connector_extra_config`` key
fails here until its docs page explains it; a command in README.md or docs/ with a flag or key
that does not exist (or a bad value) fails too.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import shlex
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from connector.config import ConnectorSettings, load_settings
from launch import cli as launch_cli
from launch import devices as launch_devices
from metaserver import cli as metaserver_cli
from pdservice.settings import SettingsParser
from proxy import cli as proxy_cli
from tests.support.sealing import key_file

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "pd-launch": launch_cli.build_parser,
    "pd-proxy": proxy_cli.build_parser,
    "pd-metaserver": metaserver_cli.build_parser,
}
PAGE_OF = {"pd-launch": "launch.md", "pd-proxy": "proxy.md", "pd-metaserver": "metaserver.md"}
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")

DOC_SECRETS = "/etc/pdgate/"  # where the docs keep keys and tokens


def long_flags(parser: argparse.ArgumentParser) -> list[str]:
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    return sorted(flags - {"--help"})


def mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def commands(text: str) -> Iterator[str]:
    """Shell commands of the fenced blocks: continuation lines joined, quotes kept together."""
    for block in FENCE.findall(text):
        buf = ""
        for line in block.splitlines():
            buf += line
            if buf.endswith("\\"):
                buf = buf[:-1] + " "
            elif buf.count("'") % 2:
                buf += "\n"
            else:
                if buf.strip():
                    yield buf
                buf = ""


def argv_of(command: str) -> tuple[str, list[str]]:
    """(program basename, its arguments), leading VAR=value assignments and `export` skipped."""
    words = shlex.split(command, comments=True)
    while words and (ASSIGNMENT.match(words[0]) or words[0] == "export"):
        if words[0] == "export":
            return "", []
        words = words[1:]
    if not words:
        return "", []
    return Path(words[0]).name, words[1:]


@pytest.mark.parametrize("program", sorted(PARSERS))
def test_docs_page_explains_every_flag(program: str) -> None:
    page = DOCS / PAGE_OF[program]
    text = page.read_text()
    flags = long_flags(PARSERS[program]())
    assert len(flags) >= 8  # the parser really was read
    missing = [f for f in flags if not mentions(text, f)]
    assert not missing, f"{program} flags not explained in docs/{page.name}: {missing}"


def test_docs_connector_page_explains_every_extra_config_key() -> None:
    text = (DOCS / "connector.md").read_text()
    keys = list(ConnectorSettings.model_fields)
    assert {"metaserver_url", "instance_id", "mooncake_protocol"} <= set(keys)
    missing = [k for k in keys if f"\n| `{k}` |" not in text]  # a row of the keys table
    assert not missing, f"connector keys not explained in docs/connector.md: {missing}"


def test_docs_launch_page_lists_every_device_preset() -> None:
    text = (DOCS / "launch.md").read_text()
    for device, preset in launch_devices.DEVICES.items():
        row = f"| `{device}` | `{preset.protocol}` |"
        assert row in text, f"docs/launch.md has no preset row starting {row!r}"
        if preset.visible_devices_env:
            assert f"`{preset.visible_devices_env}`" in text


_STAND_INS: dict[str, str] = {}


def stand_in(word: str) -> str:
    """A documented secret file (``/etc/pdgate/…``) as a local file holding a token, so the
    settings that read it at start can be checked here; other words as they are."""
    if not word.startswith(DOC_SECRETS):
        return word
    if word not in _STAND_INS:
        path = Path(tempfile.mkdtemp(prefix="pdgate-doc-")) / Path(word).name
        path.write_text(secrets.token_urlsafe(24) + "\n")
        _STAND_INS[word] = str(path)
    return _STAND_INS[word]


def documented_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in PAGES:
        for command in commands(page.read_text()):
            if not any(name in command for name in (*PARSERS, "--kv-transfer-config")):
                continue
            program, args = argv_of(command)
            found.append((page.name, program, args))
    return found


def test_docs_cli_commands_use_real_flags() -> None:
    checked = 0
    for page, program, args in documented_commands():
        if program not in PARSERS:
            continue
        parser = PARSERS[program]()
        known = set(long_flags(parser))
        unknown = [
            w.split("=")[0] for w in args if w.startswith("--") and w.split("=")[0] not in known
        ]
        assert not unknown, f"{page}: `{program}` has no flag {unknown} (abbreviations count too)"
        try:
            if isinstance(parser, SettingsParser):
                parser.load([stand_in(a) for a in args])  # flags and the settings' validation
            else:
                parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{page}: `{program} {shlex.join(args)}` is not a valid command line")
        checked += 1
    assert checked >= 8, checked  # README and docs really were scanned


def test_docs_kv_transfer_configs_use_real_connector_keys() -> None:
    checked = 0
    for page, _program, args in documented_commands():
        for i, word in enumerate(args[:-1]):
            if word != "--kv-transfer-config" or "PdgateConnector" not in args[i + 1]:
                continue
            config = json.loads(args[i + 1])
            assert config["kv_connector_module_path"] == "connector", page
            assert config["kv_role"] in ("kv_producer", "kv_consumer", "kv_both"), page
            extra = config["kv_connector_extra_config"]
            assert "side_channel_secret_file" in extra, f"{page}: an engine without a key file"
            # the documented key and token files are not on this machine: files that are stand
            # in for them
            local = {k: stand_in(v) if isinstance(v, str) else v for k, v in extra.items()}
            load_settings({**local, "side_channel_secret_file": key_file()})  # unknown key: raises
            checked += 1
    assert checked >= 3, checked
