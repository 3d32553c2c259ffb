"""`Config`: the checkpoint URI and manager settings from kwargs, env, or a TOML file.

Precedence, highest first: keyword arguments, ``SPOTCKPT_*`` environment variables, the file
named by ``SPOTCKPT_CONFIG`` or ``./spotckpt.toml``, then ``[tool.spotckpt]`` in
``./pyproject.toml``, then the defaults of `Settings`. `Config.load` is the one place that
applies this rule: ``CheckpointManager(uri, **kwargs)``, ``CheckpointManager.from_config()``,
every integration and the command line all resolve their settings through it. A keyword argument
that is passed wins, None included (``keep_last=None`` keeps every step whatever
``SPOTCKPT_KEEP_LAST`` says); only ``uri=None`` means "not given".

Unknown keys, wrong types and bad values are errors that name their source and key
(``/run/spotckpt.toml: keep_last: must be at least 1, got 0``,
``SPOTCKPT_KEEP_LAST: must be int or None, got 'many'``). The value of a setting in
`SECRET_SETTINGS` is never shown in them, only its type; credentials never appear in them.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from spotckpt.errors import ConfigError, InvalidArgumentError, MissingURIError
from spotckpt.extras import has_module
from spotckpt.preemption.azure import AZURE_ENDPOINT_ENV, AZURE_VM_NAME_ENV
from spotckpt.redact import redact, secret_values
from spotckpt.tiers.node import NODE_VARIABLE, ZONE_VARIABLE
from spotckpt.tiers.redundancy import parse_redundancy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ENV_PREFIX = "SPOTCKPT_"
_CONFIG_VARIABLE = f"{ENV_PREFIX}CONFIG"
_NOT_SETTINGS = frozenset(
    {_CONFIG_VARIABLE, NODE_VARIABLE, ZONE_VARIABLE, AZURE_ENDPOINT_ENV, AZURE_VM_NAME_ENV}
)
_MAX_SHOWN = 60

SECRET_SETTINGS = frozenset({"storage_options", "signing_key", "verify_keys"})
"""Settings whose values may be secrets (credentials among the options; the signing key, or PEM
text given where a path belongs; a private key among the verify keys): an error about one names
the setting and the value's type, never the value."""
_KEY_PATHS = frozenset({"signing_key", "verify_keys"})
_PEM_MARK = "-----BEGIN"

DEFAULT_MAX_INTERVAL_STEPS = 10_000
"""The ceiling of the ``"auto"`` interval when `max_interval_steps` is not given (or is None).

The auto interval comes from figures read back from the bucket, which a corrupt or forged event
can set to anything; the ceiling bounds what an eviction without notice can then lose to this
many steps: 100 times the starting interval, 17 minutes of 0.1-s steps, 2.8 hours of 1-s steps.
Daly's interval for realistic figures stays well below it (a 60-s save stall and one eviction in
8 hours give about 1,800 s), so it binds only runs of very short steps and rare evictions, where
the extra saves cost little; such a run may give a larger `max_interval_steps` itself. None
means this default rather than no bound, so that no setting leaves the interval unbounded.
"""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The manager's settings: the one declaration of their names, types and defaults.

    `CheckpointManager`'s keyword arguments are these fields, and `Config` is these plus the
    URI, so the two can never disagree. Validated on construction (ConfigError, a ValueError).

    - `keep_last`: committed checkpoints to keep (None: all); the newest is never deleted.
    - `interval_steps`: `maybe_save` saves when ``step % interval_steps == 0`` (None: never);
      ``"auto"`` chooses the interval from the measured step time, save cost and eviction rate
      (Daly's formula, see `spotckpt.goodput`) and saves when that many steps have passed.
    - `eviction_rate_per_hour`: for ``"auto"``: evictions per hour of training (None: the rate
      observed in the run's events, starting from `spotckpt.goodput.PRIOR_EVICTIONS_PER_HOUR`).
    - `min_interval_steps`, `max_interval_steps`: bounds of the ``"auto"`` interval; the
      ceiling defaults to `DEFAULT_MAX_INTERVAL_STEPS` (None means that default, not unbounded).
    - `max_events`: event objects kept under ``events/``; older ones are compacted.
    - `metrics`: a callable that receives one dict per save, restore and preemption (code only:
      never from a file or the environment); see `spotckpt.metrics`.
    - `async_save`: stage to CPU memory and upload in the background.
    - `async_mode`: where that upload runs: ``"thread"`` (default), or ``"process"``: DCP's
      separate upload process (needs an initialised process group; the store is rebuilt there
      from its URI and options; not with `local_dir`).
    - `preemption`: True to watch signals and cloud notices, False not to, or a watcher.
    - `prefix_spread`: spread rank objects over 4096 key prefixes (S3 request-rate partitions).
    - `collective_timeout_s`: bound on every collective of the manager's own gloo group.
    - `agree_every`: with several ranks, agree on the preemption flag every N steps.
    - `save_budget_s`: time an emergency save may take after a signal.
    - `storage_options`: back-end options, e.g. ``endpoint_url``; never logged.
    - `local_dir`: the fast tier, a folder on each node (``{node}`` in it is replaced by the
      node id); None: no fast tier. See `spotckpt.tiers`.
    - `local_interval_steps`: `maybe_save` also saves to the fast tier only, every N steps
      (None: the tier is written only as part of durable saves).
    - `redundancy`: copies of each rank's fast-tier object on other nodes: ``"replicate:F"``,
      ``"ec:K+M"`` (erasure coding), or None (the node's own copy only).
    - `local_keep_last`: fast-tier steps each node keeps.
    - `progress_interval_s`: a save or restore still running after this many seconds logs its
      progress at INFO (bytes done of total, rate, time left), again every as many seconds;
      None: never.
    - `incremental`: bucket saves upload only the tensor chunks whose bytes (BLAKE3) changed
      since the newest committed step and reference the others there (`spotckpt.engine.
      incremental`); off by default: hashing costs CPU time on every save of a state that
      changes whole, and older spotckpt versions cannot read a step that holds references.
    - `compression`: store bucket saves' tensor chunks compressed (lossless, per CRC block,
      bytes grouped by significance: `spotckpt.format.compression`): ``"on"``, ``"auto"`` (when
      a sample of the state, compressed, says the save gets faster on the upload rate that this
      rank's earlier saves measured: on slow links, never on a local disk) or ``"off"``
      (default: a compressed step's objects are no longer plain safetensors files, and older
      spotckpt versions cannot read it).
    - `replica_check`: compare the copies of replicated tensors across ranks before the commit:
      ``"all"``, ``"sample"`` (1/8 of the tensors per save, in turn) or ``"off"`` (default: a
      healthy DDP job may hold different values under one name, e.g. BatchNorm's running
      statistics, updated by each rank's own forward pass); see `spotckpt.engine.guards`.
    - `health_check`: refuse a save whose state is not healthy: ``"finite"`` (no NaN or
      infinity in floating tensors), a callable on the state (code only), or None.
    - `signing_key`: path of a PEM file holding an Ed25519 private key: every manifest is signed
      with it and every read refuses an unsigned or wrongly signed step; see
      `spotckpt.format.signing`. PEM text given here instead of a path is refused, unshown.
    - `verify_keys`: paths (separated by ``os.pathsep``) of PEM Ed25519 public keys also accepted
      for reading (key rotation, or readers that must not sign).
    - `key_provider`: a callable returning a `spotckpt.format.signing.Keyring` (code only: a
      key-management hook); used instead of the two paths.
    - `accept_unsigned`: with a key, still read steps that carry no signature (saved before the
      key was set); a wrong signature is refused all the same.
    """

    keep_last: int | None = 3
    interval_steps: int | Literal["auto"] | None = None
    eviction_rate_per_hour: float | None = None
    min_interval_steps: int = 1
    max_interval_steps: int | None = DEFAULT_MAX_INTERVAL_STEPS
    max_events: int = 500
    metrics: Any = None
    async_save: bool = False
    async_mode: Literal["thread", "process"] = "thread"
    preemption: Any = True
    prefix_spread: bool = False
    collective_timeout_s: float = 300.0
    agree_every: int = 1
    save_budget_s: float = 25.0
    storage_options: dict[str, Any] = field(default_factory=dict)
    local_dir: str | None = None
    local_interval_steps: int | None = None
    redundancy: str | None = None
    local_keep_last: int = 2
    progress_interval_s: float | None = 5.0
    incremental: bool = False
    compression: Literal["auto", "on", "off"] = "off"
    replica_check: Literal["all", "sample", "off"] = "off"
    health_check: Any = None
    signing_key: str | None = None
    verify_keys: str | None = None
    key_provider: Any = None
    accept_unsigned: bool = False

    def __post_init__(self) -> None:
        for setting in fields(self):
            value = getattr(self, setting.name)
            if setting.name == "preemption" and not isinstance(value, bool):
                if not hasattr(value, "preempted"):
                    raise ConfigError("preemption: must be bool or a PreemptionWatcher")
                continue
            if setting.name == "health_check" and callable(value):
                continue  # a callable gate, given in code
            if setting.name in _CODE_ONLY:
                problem = _code_only_problem(value)
            else:
                problem = _problem(setting.name, value)
            if problem is not None:
                raise ConfigError(redact(f"{setting.name}: {problem}"))
        if self.max_interval_steps is None:  # None means the default ceiling, never unbounded
            object.__setattr__(self, "max_interval_steps", DEFAULT_MAX_INTERVAL_STEPS)
        self._check_interval_bounds()

    def _check_interval_bounds(self) -> None:
        maximum = self.max_interval_steps
        if maximum is not None and maximum < self.min_interval_steps:
            default = " (the default)" if maximum == DEFAULT_MAX_INTERVAL_STEPS else ""
            raise ConfigError(
                f"max_interval_steps: must be at least min_interval_steps "
                f"({self.min_interval_steps}), got {maximum}{default}: set max_interval_steps "
                f"to at least {self.min_interval_steps}, or lower min_interval_steps"
            )

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return redact(f"{type(self).__name__}({shown})", secret_values(self.storage_options))

    def manager_kwargs(self) -> dict[str, Any]:
        """The settings as CheckpointManager keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(Settings)}


@dataclass(frozen=True, kw_only=True, repr=False)  # Settings' redacting repr
class Config(Settings):
    """The checkpoint URI and the manager's `Settings`, from kwargs, env or a TOML file."""

    uri: str

    @classmethod
    def load(cls, cwd: str | Path | None = None, **overrides: Any) -> Config:
        """Merge the sources in precedence order and validate the result: the one resolution
        of the settings (see the module docstring). Every keyword passed wins, None included,
        but ``uri=None``, which means "not given"."""
        folder = Path(cwd) if cwd is not None else Path.cwd()
        merged: dict[str, Any] = {}
        given = {k: v for k, v in overrides.items() if not (k == "uri" and v is None)}
        keywords = _checked(given, _keyword)  # the caller's own mistakes are reported first
        for where, values in (*_file_sources(folder), (_env_name, _from_env(os.environ))):
            merged.update(_checked(values, where))
        merged.update(keywords)
        if "uri" not in merged:
            raise MissingURIError(
                "no checkpoint URI: pass uri= or set SPOTCKPT_URI (or put uri in spotckpt.toml)"
            )
        return cls(**merged)


_TYPES: dict[str, tuple[type, ...]] = {
    "uri": (str,),
    "keep_last": (int, type(None)),
    "interval_steps": (int, str, type(None)),
    "eviction_rate_per_hour": (int, float, type(None)),
    "min_interval_steps": (int,),
    "max_interval_steps": (int, type(None)),
    "max_events": (int,),
    "async_save": (bool,),
    "async_mode": (str,),
    "preemption": (bool,),
    "prefix_spread": (bool,),
    "collective_timeout_s": (int, float),
    "agree_every": (int,),
    "save_budget_s": (int, float),
    "storage_options": (dict,),
    "local_dir": (str, type(None)),
    "local_interval_steps": (int, type(None)),
    "redundancy": (str, type(None)),
    "local_keep_last": (int,),
    "progress_interval_s": (int, float, type(None)),
    "incremental": (bool,),
    "compression": (str,),
    "replica_check": (str,),
    "health_check": (str, type(None)),
    "signing_key": (str, type(None)),
    "verify_keys": (str, type(None)),
    "accept_unsigned": (bool,),
}
_AT_LEAST_ONE = frozenset(
    {
        "keep_last",
        "interval_steps",
        "agree_every",
        "min_interval_steps",
        "max_interval_steps",
        "local_interval_steps",
        "local_keep_last",
    }
)
_POSITIVE = frozenset(
    {"collective_timeout_s", "save_budget_s", "eviction_rate_per_hour", "progress_interval_s"}
)
_CODE_ONLY = frozenset({"metrics", "key_provider"})

Where = Callable[[str], str]
"""Names a key in its source: ``/run/spotckpt.toml: keep_last``, ``SPOTCKPT_KEEP_LAST``."""


def _env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _keyword(key: str) -> str:
    return f"keyword argument {key}"


def _in_file(label: str) -> Where:
    return lambda key: f"{label}: {key}"


def _shown(key: str, value: Any) -> str:
    """`value` as an error about setting `key` shows it: only its type for `SECRET_SETTINGS`."""
    if key in SECRET_SETTINGS:
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _kind_names(kinds: tuple[type, ...]) -> str:
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def _problem(key: str, value: Any) -> str | None:
    """What is wrong with `value` for setting `key`, or None when it is fine."""
    kinds = _TYPES[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        if key == "storage_options":
            return f"must be a table of options, got {_shown(key, value)}"
        if key == "interval_steps":
            return f'must be int, None or "auto", got {_shown(key, value)}'
        return f"must be {_kind_names(kinds)}, got {_shown(key, value)}"
    if key == "interval_steps" and isinstance(value, str) and value != "auto":
        return f'must be int, None or "auto", got {_shown(key, value)}'
    return _range_problem(key, value)


def _code_only_problem(value: Any) -> str | None:
    if value is None or callable(value):
        return None
    return f"must be a callable taking one dict, or None, got {type(value).__name__}"


def _range_problem(key: str, value: Any) -> str | None:
    """What is wrong with a value of the right type, or None."""
    if key in ("uri", "local_dir") and value == "":
        return "must be a non-empty string"
    if key == "async_mode" and value not in ("thread", "process"):
        return f'must be "thread" or "process", got {_shown(key, value)}'
    if key == "compression" and value not in ("auto", "on", "off"):
        return f'must be "auto", "on" or "off", got {_shown(key, value)}'
    if key == "replica_check" and value not in ("all", "sample", "off"):
        return f'must be "all", "sample" or "off", got {_shown(key, value)}'
    if key == "health_check" and value not in (None, "finite"):
        return f'must be "finite" or None here (a callable only in code), got {_shown(key, value)}'
    if key in _KEY_PATHS and value == "":
        return "must be a non-empty path"
    if key in _KEY_PATHS and isinstance(value, str) and (_PEM_MARK in value or "\n" in value):
        return (
            "holds PEM text (not shown), not a path: put the key in a file (a Kubernetes "
            "secret mounted as a volume, for instance) and give the file's path"
        )
    if key == "redundancy" and value is not None:
        try:
            if parse_redundancy(value).erasure and not has_module("zfec"):
                return "ec:K+M needs zfec: pip install 'spotckpt[erasure]'"
        except InvalidArgumentError as error:
            return str(error).removeprefix("redundancy ")
    if isinstance(value, str) or value is None:
        return None
    if key in _AT_LEAST_ONE and value < 1:
        return f"must be at least 1, got {value!r}"
    if key == "max_events" and value < 4:
        return f"must be at least 4, got {value!r}"
    if key in _POSITIVE and not (math.isfinite(value) and value > 0):
        return f"must be a positive number, got {value!r}"
    return None


def _checked(values: Mapping[str, Any], where: Where) -> dict[str, Any]:
    checked = {}
    for key, value in values.items():
        if where is _keyword and _code_value(key, value):
            checked[key] = value  # Settings checks it
            continue
        if key in _CODE_ONLY:
            checked[key] = _code_only(key, value, where)
            continue
        if key not in _TYPES:
            raise ConfigError(
                redact(f"{where(key)}: unknown setting; known: {', '.join(sorted(_TYPES))}")
            )
        problem = _problem(key, value)
        if problem is not None:
            raise ConfigError(redact(f"{where(key)}: {problem}"))
        checked[key] = value
    return checked


def _code_value(key: str, value: Any) -> bool:
    """Whether a keyword argument is a value only code can give: a health-check callable, a
    `PreemptionWatcher` (Settings checks both)."""
    if key == "health_check":
        return callable(value)
    return key == "preemption" and not isinstance(value, bool)


def _code_only(key: str, value: Any, where: Where) -> Any:
    """A code-only setting (a callable): fine as a keyword argument, an error anywhere else."""
    if where is not _keyword:
        raise ConfigError(
            f"{where(key)}: can only be given in code (a callable passed to CheckpointManager "
            "or Config.load), not in a file or the environment"
        )
    problem = _code_only_problem(value)
    if problem is not None:
        raise ConfigError(f"{where(key)}: {problem}")
    return value


def config_files(folder: Path) -> list[str]:
    """The configuration files in `folder` that `Config.load` reads there when
    ``SPOTCKPT_CONFIG`` is not set: ``spotckpt.toml``, ``pyproject.toml`` with
    ``[tool.spotckpt]``."""
    pyproject = folder / "pyproject.toml"
    found = [str(folder / "spotckpt.toml")] if (folder / "spotckpt.toml").is_file() else []
    if pyproject.is_file() and _tool_table(pyproject, _read_toml(pyproject)) is not None:
        found.append(f"{pyproject} [tool.spotckpt]")
    return found


def _file_sources(folder: Path) -> list[tuple[Where, dict[str, Any]]]:
    sources = []
    pyproject = folder / "pyproject.toml"
    if pyproject.is_file():
        table = _tool_table(pyproject, _read_toml(pyproject))
        if table is not None:
            sources.append((_in_file(f"{pyproject} [tool.spotckpt]"), table))
    explicit = os.environ.get(_CONFIG_VARIABLE)
    path = Path(explicit) if explicit else folder / "spotckpt.toml"
    if explicit and not path.is_file():
        raise ConfigError(redact(f"{_CONFIG_VARIABLE}: {path} is not a readable file"))
    if path.is_file():
        sources.append((_in_file(str(path)), _read_toml(path)))
    return sources


def _tool_table(pyproject: Path, document: dict[str, Any]) -> dict[str, Any] | None:
    tool = document.get("tool")
    table = tool.get("spotckpt") if isinstance(tool, dict) else None
    if table is not None and not isinstance(table, dict):
        raise ConfigError(
            f"{pyproject}: tool.spotckpt: must be a table, got {type(table).__name__}"
        )
    return table


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"cannot read config file {path}: it is not UTF-8 TOML "
            f"(byte 0x{data[error.start]:02x} at offset {error.start})"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(
            redact(f"cannot read config file {path}: it is not valid TOML: {error}")
        ) from None


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in _NOT_SETTINGS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key in _CODE_ONLY:
            raise ConfigError(
                f"{name}: {key} can only be given in code (a callable), not in the environment"
            )
        kinds = _TYPES.get(key)
        if kinds is None:
            known = ", ".join(_env_name(k) for k in sorted(_TYPES))
            raise ConfigError(f"{name}: unknown environment variable; known: {known}")
        values[key] = _parse_env(name, raw, kinds)
    return values


def _parse_env(name: str, raw: str, kinds: tuple[type, ...]) -> Any:
    text = raw.strip()
    if type(None) in kinds and text.lower() in ("", "none"):
        return None
    if dict in kinds:
        return _parse_json_object(name, text)
    try:
        if bool in kinds:
            return _parse_bool(text)
        if int in kinds and float not in kinds:
            return int(text)
        if float in kinds:
            return float(text)
    except ValueError:
        if str in kinds:
            return text  # e.g. interval_steps "auto"; anything else fails validation
        names = _kind_names(tuple(k for k in kinds if k is not type(None)))
        shown = _shown(name[len(ENV_PREFIX) :].lower(), raw)
        raise ConfigError(redact(f"{name}: must be {names}, got {shown}")) from None
    return text


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidArgumentError(text)


def _parse_json_object(name: str, text: str) -> dict[str, Any]:
    """A JSON object; errors never echo the text, which may hold credentials."""
    try:
        parsed = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{name}: must be a JSON object ({error})") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{name}: must be a JSON object, got {type(parsed).__name__}")
    return parsed
