"""Layered configuration shared by pdgate's services: flags > environment > YAML file > defaults.

The YAML file is named by the ``config_file`` setting itself (a flag, or ``<PREFIX>CONFIG_FILE``
in the environment). Secret fields are ``SecretStr`` and URLs with credentials are redacted in
``repr``, so settings can be logged.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import ValidationError
from pydantic_core import PydanticUndefined
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

_SECRET_PARAM = re.compile(r"(?i)([?&][^=&#]*(?:password|secret|token|key)[^=&#]*=)[^&#]*")


def redact_url(url: str) -> str:
    """``redis://user:secret@host/0?sentinel_password=x`` → ``redis://***@host/0?sentinel_password=***``:
    credentials and every query parameter named like a password, secret, token or key."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.partition("?")[0]:
        url = f"{scheme}://***@{rest.rpartition('@')[2]}"
    return _SECRET_PARAM.sub(r"\1***", url)


class LayeredSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid", validate_default=True)

    config_file: Path | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        init_kwargs: dict[str, Any] = getattr(init_settings, "init_kwargs", {})
        prefix = str(settings_cls.model_config.get("env_prefix", ""))
        path = init_kwargs.get("config_file") or os.environ.get(f"{prefix}CONFIG_FILE")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path:
            if not Path(path).is_file():
                raise FileNotFoundError(f"config file {path} does not exist")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


S = TypeVar("S", bound=LayeredSettings)


class SettingsParser(argparse.ArgumentParser, Generic[S]):
    """The command line of a ``LayeredSettings`` class. Flags are added one by one and only
    those given reach the settings (so environment, YAML and defaults fill the rest); help
    texts come from the fields' descriptions; bad values end in a clear usage error."""

    def __init__(self, settings_cls: type[S], **parser_kw: Any) -> None:
        super().__init__(**parser_kw)
        self.settings_cls = settings_cls
        self.add_argument("--config", dest="config_file", help="YAML file with settings")

    def option(self, flag: str, name: str, kind: Any = str, **kw: Any) -> None:
        field = self.settings_cls.model_fields[name]
        default = field.default
        hidden = default is None or default is PydanticUndefined
        shown = "" if hidden else f" (default: {getattr(default, 'value', default)})"
        self.add_argument(
            flag, dest=name, type=kind, default=argparse.SUPPRESS,
            help=f"{field.description or ''}{shown}", **kw,
        )  # fmt: skip

    def switch(self, flag: str, name: str) -> None:
        """A boolean setting turned on by a bare flag."""
        help_text = self.settings_cls.model_fields[name].description or ""
        self.add_argument(
            flag, dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text
        )

    def unswitch(self, flag: str, name: str) -> None:
        """A boolean setting (on by default) turned off by a bare flag."""
        help_text = self.settings_cls.model_fields[name].description or ""
        self.add_argument(
            flag, dest=name, action="store_false", default=argparse.SUPPRESS,
            help=f"turn off: {help_text}",
        )  # fmt: skip

    def load(self, argv: Sequence[str] | None = None) -> S:
        args = vars(self.parse_args(argv))
        try:
            return self.settings_cls(**args)
        except (ValidationError, FileNotFoundError, ValueError) as exc:
            self.error(f"invalid settings:\n{exc}")
