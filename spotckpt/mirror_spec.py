"""The `mirrors` setting: where a job's committed steps are also copied, with each mirror's own
storage options.

Pure (no store, no torch), so that `spotckpt.config` checks the setting with the parser the
manager uses without importing the mirroring itself (`spotckpt.mirroring`). Accepted forms:
URIs separated by commas (``SPOTCKPT_MIRRORS=gs://b/run,az://c/run``), a list of URIs (TOML, code),
or a mapping from URI to that mirror's storage options (credentials differ per cloud; Azure takes
one connection string per account), as a TOML table or a JSON object in the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spotckpt.errors import InvalidArgumentError

MAX_MIRRORS = 8
"""More than this is a mistake: each mirror is a full copy of every step, egress billed."""


@dataclass(frozen=True)
class MirrorTarget:
    """One mirror: its root URI and its own storage options (never shown: they may hold
    credentials)."""

    uri: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)


def parse_mirrors(value: Any) -> tuple[MirrorTarget, ...]:
    """The mirrors a setting value names (see the module docstring); InvalidArgumentError says
    what is wrong, without the options' values."""
    if value is None:
        return ()
    if isinstance(value, str):
        targets = [MirrorTarget(uri.strip()) for uri in value.split(",") if uri.strip()]
    elif isinstance(value, (list, tuple)):
        targets = [MirrorTarget(_uri(uri)) for uri in value]
    elif isinstance(value, Mapping):
        targets = [MirrorTarget(_uri(uri), _options(uri, opts)) for uri, opts in value.items()]
    else:
        raise InvalidArgumentError(
            f"must be URIs separated by commas, a list of URIs or a table from URI to storage "
            f"options, got {type(value).__name__}"
        )
    uris = [target.uri for target in targets]
    if len(set(uris)) != len(uris):
        raise InvalidArgumentError("names a mirror twice")
    if len(targets) > MAX_MIRRORS:
        raise InvalidArgumentError(f"names {len(targets)} mirrors; at most {MAX_MIRRORS}")
    return tuple(targets)


def _uri(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(f"a mirror must be a non-empty URI, got {type(value).__name__}")
    return value.strip()


def _options(uri: Any, options: Any) -> Mapping[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise InvalidArgumentError(
            f"the storage options of mirror {_uri(uri)} must be a table of named options, got "
            f"{type(options).__name__}"
        )
    return dict(options)
