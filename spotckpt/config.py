"""`Config`: the checkpoint URI and manager settings from kwargs, env, or a TOML file.

Precedence, highest first: keyword arguments, ``SPOTCKPT_*`` environment variables, the file
named by ``SPOTCKPT_CONFIG`` or ``./spotckpt.toml``, then ``[tool.spotckpt]`` in
``./pyproject.toml``. Unknown keys and wrong types are errors that name the key and its source.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ENV_PREFIX = "SPOTCKPT_"


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or missing."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything `CheckpointManager.from_config` needs."""

    uri: str
    keep_last: int | None = 3
    interval_steps: int | None = None
    async_save: bool = False
    preemption: bool = True
    prefix_spread: bool = False
    collective_timeout_s: float = 300.0
    agree_every: int = 1
    save_budget_s: float = 25.0
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or not self.uri:
            raise ConfigError("uri must be a non-empty string (set SPOTCKPT_URI)")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError("keep_last must be at least 1")
        if self.interval_steps is not None and self.interval_steps < 1:
            raise ConfigError("interval_steps must be at least 1")
        if self.agree_every < 1:
            raise ConfigError("agree_every must be at least 1")
        if self.save_budget_s <= 0 or self.collective_timeout_s <= 0:
            raise ConfigError("save_budget_s and collective_timeout_s must be positive")

    @classmethod
    def load(cls, cwd: str | Path | None = None, **overrides: Any) -> Config:
        """Merge the sources in precedence order and validate the result."""
        folder = Path(cwd) if cwd is not None else Path.cwd()
        merged: dict[str, Any] = {}
        for source, values in (
            *_file_sources(folder),
            ("environment", _from_env(os.environ)),
            ("keyword arguments", {k: v for k, v in overrides.items() if v is not None}),
        ):
            merged.update(_checked(values, source))
        if "uri" not in merged:
            raise ConfigError(
                "no checkpoint URI: set SPOTCKPT_URI, pass uri=, or put uri in spotckpt.toml"
            )
        return cls(**merged)

    def manager_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for CheckpointManager (everything but the URI)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "uri"}


_TYPES: dict[str, tuple[type, ...]] = {
    "uri": (str,),
    "keep_last": (int, type(None)),
    "interval_steps": (int, type(None)),
    "async_save": (bool,),
    "preemption": (bool,),
    "prefix_spread": (bool,),
    "collective_timeout_s": (int, float),
    "agree_every": (int,),
    "save_budget_s": (int, float),
    "storage_options": (dict,),
}


def _checked(values: dict[str, Any], source: str) -> dict[str, Any]:
    checked = {}
    for key, value in values.items():
        kinds = _TYPES.get(key)
        if kinds is None:
            raise ConfigError(f"unknown setting {key!r} in {source}; known: {sorted(_TYPES)}")
        wrong_bool = isinstance(value, bool) and bool not in kinds
        if not isinstance(value, kinds) or wrong_bool:
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"setting {key!r} in {source} must be {names}, got {value!r}")
        checked[key] = value
    return checked


def _file_sources(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    sources = []
    pyproject = folder / "pyproject.toml"
    if pyproject.is_file():
        table = _read_toml(pyproject).get("tool", {}).get("spotckpt")
        if table is not None:
            sources.append((f"{pyproject} [tool.spotckpt]", table))
    explicit = os.environ.get(f"{ENV_PREFIX}CONFIG")
    path = Path(explicit) if explicit else folder / "spotckpt.toml"
    if explicit and not path.is_file():
        raise ConfigError(f"SPOTCKPT_CONFIG names {path}, which is not a readable file")
    if path.is_file():
        sources.append((str(path), _read_toml(path)))
    return sources


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from None


def _from_env(environ: os._Environ[str] | dict[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == f"{ENV_PREFIX}CONFIG":
            continue
        key = name[len(ENV_PREFIX) :].lower()
        kinds = _TYPES.get(key)
        if kinds is None:
            raise ConfigError(
                f"unknown environment variable {name}; known: "
                + ", ".join(ENV_PREFIX + k.upper() for k in sorted(_TYPES))
            )
        values[key] = _parse_env(name, raw, kinds)
    return values


def _parse_env(name: str, raw: str, kinds: tuple[type, ...]) -> Any:
    text = raw.strip()
    try:
        if type(None) in kinds and text.lower() in ("", "none"):
            return None
        if bool in kinds:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if int in kinds and float not in kinds:
            return int(text)
        if float in kinds:
            return float(text)
        if dict in kinds:
            parsed = json.loads(text)
            if not isinstance(parsed, dict):
                raise ValueError(text)
            return parsed
    except ValueError:
        names = " or ".join(k.__name__ for k in kinds if k is not type(None))
        raise ConfigError(f"environment variable {name} must be {names}, got {raw!r}") from None
    return text
