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

What each setting accepts is read from `Settings`' annotations (``int | None``, a ``Literal``
of words, a ``Callable`` that only code can give) and from its field's metadata (`_Checks`:
bounds, and the owning feature's own check). A feature owns its setting's values: the
``Literal`` types and checks come from torch-free modules below this one (the compression
modes from `spotckpt.format.compression`, the guards' and upload modes from
`spotckpt.engine.options`, the redundancy spec from `spotckpt.redundancy`), and the variables
that are not settings from `spotckpt.environment`, so this module imports no tier, preemption
source or manager.
"""

from __future__ import annotations

import json
import math
import os
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypedDict, Union, cast, get_args, get_origin, get_type_hints

from spotckpt.engine.options import AsyncMode, HealthCheck, HealthCheckName, ReplicaCheck
from spotckpt.environment import FEATURE_VARIABLES
from spotckpt.errors import ConfigError, InvalidArgumentError, MissingURIError
from spotckpt.format.compression import CompressionMode
from spotckpt.mirror_spec import parse_mirrors
from spotckpt.redact import redact, secret_values
from spotckpt.redundancy import check_redundancy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ENV_PREFIX = "SPOTCKPT_"
_CONFIG_VARIABLE = f"{ENV_PREFIX}CONFIG"
_NOT_SETTINGS = FEATURE_VARIABLES | {_CONFIG_VARIABLE}
_MAX_SHOWN = 60

SECRET_SETTINGS = frozenset({"storage_options", "signing_key", "verify_keys", "mirrors"})
"""Settings whose values may be secrets (credentials among the options, a mirror's among them;
the signing key, or PEM text given where a path belongs; a private key among the verify keys): an
error about one names the setting and the value's type, never the value."""
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


class _Checks(TypedDict, total=False):
    """A setting's checks beyond its type: its field's metadata (`_range_problem` reads them)."""

    non_empty: str  # what an empty string would fail to be: "string", "path"
    parse: Callable[[Any], object]  # the owner's check of a value: InvalidArgumentError if bad
    at_least: int  # the smallest number allowed
    positive: bool  # a finite number above 0
    in_code: Callable[[Any], str | None]  # the problem of an object (``Any``) given in code


def _path_not_pem(value: str) -> None:
    """A key setting's check: a path, never the PEM text itself (which is never shown)."""
    if _PEM_MARK in value or "\n" in value:
        raise InvalidArgumentError(
            "holds PEM text (not shown), not a path: put the key in a file (a Kubernetes "
            "secret mounted as a volume, for instance) and give the file's path"
        )


def _watcher_problem(value: Any) -> str | None:
    """What is wrong with a `preemption` object given in code, or None for a watcher."""
    return None if hasattr(value, "preempted") else "must be bool or a PreemptionWatcher"


_AT_LEAST_ONE = _Checks(at_least=1)
_POSITIVE = _Checks(positive=True)
_KEY_PATH = _Checks(non_empty="path", parse=_path_not_pem)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The manager's settings: the one declaration of their names, types and defaults.

    `CheckpointManager`'s keyword arguments are these fields, and `Config` is these plus the
    URI, so the two can never disagree. Validated on construction (ConfigError, a ValueError).

    - `keep_last`: committed checkpoints to keep (None: all); the newest is never deleted.
    - `interval_steps`: `maybe_save` saves when ``step % interval_steps == 0`` (None: never);
      ``"auto"`` chooses the interval from the measured step time, save cost and eviction rate
      (Daly's formula, see `spotckpt.interval`) and saves when that many steps have passed.
    - `eviction_rate_per_hour`: for ``"auto"``: evictions per hour of training (None: the rate
      observed in the run's events, starting from `spotckpt.interval.PRIOR_EVICTIONS_PER_HOUR`).
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
    - `prefix_spread`: spread rank objects over 4096 key prefixes (S3 request-rate partitions);
      an emergency save at a notice spreads them anyway once the bucket throttled.
    - `collective_timeout_s`: bound on every collective of the manager's own gloo group.
    - `agree_every`: with several ranks, agree on the preemption flag every N steps.
    - `save_budget_s`: time an emergency save may take after a signal; the window that
      `CheckpointManager.emergency_estimate` is judged against (or a cloud's shorter notice).
    - `aws_rebalance`: the manager's watcher also polls AWS's rebalance recommendation, and
      `maybe_save` answers the first one with an extra save (off by default).
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
      spotckpt versions cannot read it), except for an emergency save at a preemption notice,
      which decides as ``"auto"`` does once the link is measured (`spotckpt.deadline.
      NoticeAdaptation`).
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
    - `mirrors`: roots in other regions or clouds that every committed step is also copied to,
      in the background on the coordinator (`spotckpt.mirroring`): URIs separated by commas, a
      list, or a table from URI to that mirror's storage options (`spotckpt.mirror_spec`).
    - `mirror_bandwidth`: bytes per second the mirror copies may take together (None: no cap).
    - `mirror_wait_s`: how long `wait` and `close` wait for mirror copies in flight; what is
      left is copied by the next run (a copy never commits half a step). After a preemption
      notice mirror copies stop at once: the emergency save gets the bandwidth.
    - `nearest_copy`: the URI of the copy (the job's root or one of its `mirrors`) that a restore
      reads first, as a launcher that knows its region sets it; None: the one whose listing
      answers fastest (`spotckpt.restore`).
    """

    keep_last: int | None = field(default=3, metadata=_AT_LEAST_ONE)
    interval_steps: int | Literal["auto"] | None = field(default=None, metadata=_AT_LEAST_ONE)
    eviction_rate_per_hour: float | None = field(default=None, metadata=_POSITIVE)
    min_interval_steps: int = field(default=1, metadata=_AT_LEAST_ONE)
    max_interval_steps: int | None = field(
        default=DEFAULT_MAX_INTERVAL_STEPS, metadata=_AT_LEAST_ONE
    )
    max_events: int = field(default=500, metadata=_Checks(at_least=4))
    metrics: Callable[[dict[str, Any]], Any] | None = None
    async_save: bool = False
    async_mode: AsyncMode = "thread"
    preemption: bool | Any = field(default=True, metadata=_Checks(in_code=_watcher_problem))
    prefix_spread: bool = False
    collective_timeout_s: float = field(default=300.0, metadata=_POSITIVE)
    agree_every: int = field(default=1, metadata=_AT_LEAST_ONE)
    save_budget_s: float = field(default=25.0, metadata=_POSITIVE)
    aws_rebalance: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)
    local_dir: str | None = field(default=None, metadata=_Checks(non_empty="string"))
    local_interval_steps: int | None = field(default=None, metadata=_AT_LEAST_ONE)
    redundancy: str | None = field(default=None, metadata=_Checks(parse=check_redundancy))
    local_keep_last: int = field(default=2, metadata=_AT_LEAST_ONE)
    progress_interval_s: float | None = field(default=5.0, metadata=_POSITIVE)
    incremental: bool = False
    compression: CompressionMode = "off"
    replica_check: ReplicaCheck = "off"
    health_check: HealthCheckName | HealthCheck | None = None
    signing_key: str | None = field(default=None, metadata=_KEY_PATH)
    verify_keys: str | None = field(default=None, metadata=_KEY_PATH)
    key_provider: Callable[[], Any] | None = None
    accept_unsigned: bool = False
    mirrors: str | list[str] | dict[str, Any] | None = field(
        default=None, metadata=_Checks(parse=parse_mirrors)
    )
    mirror_bandwidth: float | None = field(default=None, metadata=_POSITIVE)
    mirror_wait_s: float = field(default=300.0, metadata=_POSITIVE)
    nearest_copy: str | None = field(default=None, metadata=_Checks(non_empty="string"))

    def __post_init__(self) -> None:
        for setting in fields(self):
            value = getattr(self, setting.name)
            kind = _KINDS[setting.name]
            if kind.code_only:
                problem = _code_only_problem(value)
            elif _code_value(kind, value):
                problem = _in_code_problem(setting.name, value)
            else:
                problem = _problem(setting.name, value)
            if problem is not None:
                raise ConfigError(redact(f"{setting.name}: {problem}"))
        if self.max_interval_steps is None:  # None means the default ceiling, never unbounded
            object.__setattr__(self, "max_interval_steps", DEFAULT_MAX_INTERVAL_STEPS)
        self._check_interval_bounds()
        if self.aws_rebalance and self.preemption is not True:
            raise ConfigError(
                "aws_rebalance: configures the manager's own preemption watcher: with "
                "preemption=False there is none, and a watcher passed in takes "
                "PreemptionWatcher(aws_rebalance=True) instead"
            )

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
        secrets = secret_values(self.storage_options)
        for target in parse_mirrors(self.mirrors):
            secrets |= secret_values(dict(target.storage_options))
        return redact(f"{type(self).__name__}({shown})", secrets)

    def manager_kwargs(self) -> dict[str, Any]:
        """The settings as CheckpointManager keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(Settings)}


@dataclass(frozen=True, kw_only=True, repr=False)  # Settings' redacting repr
class Config(Settings):
    """The checkpoint URI and the manager's `Settings`, from kwargs, env or a TOML file."""

    uri: str = field(metadata=_Checks(non_empty="string"))

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


_NONE = type(None)


@dataclass(frozen=True)
class _Kind:
    """What a setting's annotation accepts (`_kind_of`)."""

    types: tuple[type, ...]  # of a value from a file or the environment (`_NONE` for None)
    words: tuple[str, ...] = ()  # a Literal's strings: the only ones allowed, when any
    callables: bool = False  # a callable, given in code
    anything: bool = False  # an object given in code (``Any``), checked by its ``in_code``

    @property
    def code_only(self) -> bool:
        """Only code can give a value other than None (a callable)."""
        return self.callables and set(self.types) <= {_NONE}

    def expected(self, value: Any) -> str:
        """What a value must be, as an error says it after "must be ", for the wrong `value`
        (`_problem`: the type is named before the words, unless a type besides the words' and
        None is allowed: ``int, None or "auto"``)."""
        words = [f'"{word}"' for word in self.words]
        others = [t for t in self.types if t not in {type(w) for w in self.words}]
        if words and set(others) - {_NONE}:
            ordered = [t for t in others if t is not _NONE] + [t for t in others if t is _NONE]
            return _either([_type_name(t) for t in ordered] + words)
        if not words or not isinstance(value, self.types):
            return _kind_names(self.types)
        shown = _either(words + (["None"] if _NONE in self.types else []))
        return shown + (" here (a callable only in code)" if self.callables else "")


def _kind_of(hint: Any) -> _Kind:
    """The `_Kind` of an annotation: a union of types, Literals, a Callable, Any."""
    union = get_origin(hint) in (Union, types.UnionType)
    kinds: list[type] = []
    words: list[str] = []
    callables = anything = False
    for member in get_args(hint) if union else (hint,):
        origin = get_origin(member)
        if member is Any:
            anything = True
        elif origin is Literal:
            words += get_args(member)
            kinds += [type(word) for word in get_args(member)]
        elif origin is Callable:
            callables = True
        elif member is float:
            kinds += [int, float]  # an int is a fine number of seconds
        else:
            kinds.append(origin or member)  # dict[str, Any]: a dict
    return _Kind(tuple(dict.fromkeys(kinds)), tuple(words), callables, anything)


def _type_name(kind: type) -> str:
    return {_NONE: "None", dict: "a table of options"}.get(kind, kind.__name__)


def _either(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


_KINDS = {name: _kind_of(hint) for name, hint in get_type_hints(Config).items()}
_CHECKS = {setting.name: cast(_Checks, setting.metadata) for setting in fields(Config)}
_CODE_ONLY = frozenset(name for name, kind in _KINDS.items() if kind.code_only)
_KNOWN = sorted(name for name in _KINDS if name not in _CODE_ONLY)
"""The settings a file or the environment may give."""

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
    return " or ".join(_type_name(k) for k in kinds)


def _problem(key: str, value: Any) -> str | None:
    """What is wrong with `value` for setting `key`, or None when it is fine."""
    kind = _KINDS[key]
    wrong_type = not isinstance(value, kind.types) or (
        isinstance(value, bool) and bool not in kind.types
    )
    if wrong_type or (kind.words and isinstance(value, str) and value not in kind.words):
        return f"must be {kind.expected(value)}, got {_shown(key, value)}"
    return _range_problem(key, value)


def _in_code_problem(key: str, value: Any) -> str | None:
    """What is wrong with a value only code can give (`_code_value`), or None: a callable is
    fine where the type allows one; an object answers to the setting's ``in_code`` check."""
    if _KINDS[key].callables and callable(value):
        return None
    return _CHECKS[key]["in_code"](value)


def _code_only_problem(value: Any) -> str | None:
    if value is None or callable(value):
        return None
    return f"must be a callable taking one dict, or None, got {type(value).__name__}"


def _range_problem(key: str, value: Any) -> str | None:
    """What is wrong with a value of the right type (its field's `_Checks`), or None."""
    checks = _CHECKS[key]
    if "non_empty" in checks and value == "":
        return f"must be a non-empty {checks['non_empty']}"
    if "parse" in checks and value is not None:
        try:
            checks["parse"](value)
        except InvalidArgumentError as error:
            return str(error).removeprefix(f"{key} ")
    if isinstance(value, str) or value is None:
        return None
    if "at_least" in checks and value < checks["at_least"]:
        return f"must be at least {checks['at_least']}, got {value!r}"
    if "positive" in checks and not (math.isfinite(value) and value > 0):
        return f"must be a positive number, got {value!r}"
    return None


def _checked(values: Mapping[str, Any], where: Where) -> dict[str, Any]:
    checked = {}
    for key, value in values.items():
        if where is _keyword and key in _KINDS and _code_value(_KINDS[key], value):
            checked[key] = value  # Settings checks it
            continue
        if key in _CODE_ONLY:
            checked[key] = _code_only(key, value, where)
            continue
        if key not in _KINDS:
            raise ConfigError(redact(f"{where(key)}: unknown setting; known: {', '.join(_KNOWN)}"))
        problem = _problem(key, value)
        if problem is not None:
            raise ConfigError(redact(f"{where(key)}: {problem}"))
        checked[key] = value
    return checked


def _code_value(kind: _Kind, value: Any) -> bool:
    """Whether a keyword argument is a value only code can give: a callable where one may be
    (a health-check callable, a metrics hook), an object where the type says ``Any`` (a
    `PreemptionWatcher`); Settings checks them."""
    if kind.callables and callable(value):
        return True
    return kind.anything and not isinstance(value, kind.types)


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
        kind = _KINDS.get(key)
        if kind is None:
            known = ", ".join(_env_name(k) for k in _KNOWN)
            raise ConfigError(f"{name}: unknown environment variable; known: {known}")
        values[key] = _parse_env(name, raw, kind.types)
    return values


def _parse_env(name: str, raw: str, kinds: tuple[type, ...]) -> Any:
    text = raw.strip()
    if type(None) in kinds and text.lower() in ("", "none"):
        return None
    if dict in kinds and (str not in kinds or text.startswith("{")):
        return _parse_json(name, text, dict)
    if list in kinds and text.startswith("["):
        return _parse_json(name, text, list)
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


def _parse_json(name: str, text: str, kind: type[Any]) -> Any:
    """A JSON object (`kind` dict) or array (list); errors never echo the text, which may hold
    credentials."""
    word = "object" if kind is dict else "array"
    try:
        parsed = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{name}: must be a JSON {word} ({error})") from None
    if not isinstance(parsed, kind):
        raise ConfigError(f"{name}: must be a JSON {word}, got {type(parsed).__name__}")
    return parsed
