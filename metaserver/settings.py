"""Layered configuration shared by pdgate's services: flags > environment > YAML file > defaults.

The YAML file is named by the ``config_file`` setting itself (a flag, or ``<PREFIX>CONFIG_FILE``
in the environment). Secret fields are ``SecretStr`` and URLs with credentials are redacted in
``repr``, so settings can be logged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)


def redact_url(url: str) -> str:
    """``redis://user:secret@host`` → ``redis://***@host``."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


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
