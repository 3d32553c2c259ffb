"""The `mirrors` setting: where a job's committed steps are also copied, with each mirror's own
storage options.

Pure (no store, no torch), so that `spotckpt.config` checks the setting with the parser the
manager uses without importing the mirroring itself (`spotckpt.mirroring`). Accepted forms:
URIs separated by commas (``SPOTCKPT_MIRRORS=gs://b/run,az://c/run``), a list of URIs (TOML, code),
or a mapping from URI to that mirror's storage options (credentials differ per cloud; Azure takes
one connection string per account), as a TOML table or a JSON object in the environment. Among a
mirror's options, ``keep_last`` is no storage option but the mirror's own retention (an integer,
or None to keep every step); without it the mirror keeps what the job's `keep_last` keeps.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from spotckpt.errors import InvalidArgumentError

MAX_MIRRORS = 8
"""More than this is a mistake: each mirror is a full copy of every step, egress billed."""
_NOT_IN_URIS = re.compile(r"[\s\[\]{}\"']")
KEEP_LAST = "keep_last"
"""The option of a mirror that is its own retention, not a storage option."""
JOBS_KEEP_LAST = "job"
"""`MirrorTarget.keep_last` when the mirror keeps what the job keeps."""


@dataclass(frozen=True)
class MirrorTarget:
    """One mirror: its root URI and its own storage options (never shown: they may hold
    credentials)."""

    uri: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    keep_last: int | str | None = JOBS_KEEP_LAST
    """Committed steps the mirror keeps (None: all), or `JOBS_KEEP_LAST`."""

    def retention(self, jobs: int | None) -> int | None:
        """The mirror's `keep_last`, given the job's."""
        return jobs if self.keep_last == JOBS_KEEP_LAST else cast(int | None, self.keep_last)


def parse_mirrors(value: Any) -> tuple[MirrorTarget, ...]:
    """The mirrors a setting value names (see the module docstring); InvalidArgumentError says
    what is wrong, without the options' values."""
    if value is None:
        return ()
    if isinstance(value, str):
        targets = [MirrorTarget(_uri(uri)) for uri in value.split(",") if uri.strip()]
    elif isinstance(value, (list, tuple)):
        targets = [MirrorTarget(_uri(uri)) for uri in value]
    elif isinstance(value, Mapping):
        targets = [_target(uri, _options(uri, opts)) for uri, opts in value.items()]
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
    uri = value.strip()
    if _NOT_IN_URIS.search(uri):  # JSON or quoting taken for URIs: a typo, not a folder name
        raise InvalidArgumentError(
            f"a mirror URI holds quotes, brackets or spaces: {uri[:80]!r}; give URIs separated "
            "by commas, or a JSON array or object"
        )
    return uri


def _target(uri: Any, options: Mapping[str, Any]) -> MirrorTarget:
    """A mirror from its table of options, its own `KEEP_LAST` taken out of them."""
    if KEEP_LAST not in options:
        return MirrorTarget(_uri(uri), options)
    rest = {name: value for name, value in options.items() if name != KEEP_LAST}
    keep = options[KEEP_LAST]
    if keep is not None and (type(keep) is not int or keep < 1):
        raise InvalidArgumentError(
            f"the keep_last of mirror {_uri(uri)} must be an integer of at least 1, or None"
        )
    return MirrorTarget(_uri(uri), rest, keep)


def _options(uri: Any, options: Any) -> Mapping[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise InvalidArgumentError(
            f"the storage options of mirror {_uri(uri)} must be a table of named options, got "
            f"{type(options).__name__}"
        )
    return dict(options)
