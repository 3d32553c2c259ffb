"""Which store opens which URI: the scheme -> factory table behind `open_store`.

A scheme is found, in this order, among the factories given to `register_store` (the built-in
``file``, ``memory``, ``s3``, ``gs``, ``gcs``, ``az``, ``abfs`` and ``abfss`` are registered when
this module loads, and every ``fsspec+<protocol>`` goes to `spotckpt.storage.fsspec`), then
among the entry points of the group ``spotckpt.stores``: a package adds a scheme without editing
spotckpt by declaring, in its ``pyproject.toml``::

    [project.entry-points."spotckpt.stores"]
    hdfs2 = "spotckpt_hdfs2:open_hdfs2_store"

where ``open_hdfs2_store(uri, options)`` returns an `ObjectStore`. A built-in scheme therefore
wins over an entry point of the same name. The S3, GCS, Azure and fsspec back ends import their
SDKs only when a URI of theirs is opened (`_BackEnd`), and an entry point loads only when its
scheme is asked for. A back end whose SDK is not installed is a `MissingDependencyError` that
names the extra to install, the same for every scheme (`store_extras`).

This module sits above `spotckpt.storage.base` and the back ends; none of them imports it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any
from urllib.parse import urlsplit

from spotckpt.errors import InvalidArgumentError, StorageError
from spotckpt.extras import missing_extra
from spotckpt.storage.base import ObjectStore
from spotckpt.storage.local import open_local_store
from spotckpt.storage.memory import open_memory_store

ENTRY_POINT_GROUP = "spotckpt.stores"
"""The entry-point group through which other packages add URI schemes."""

StoreFactory = Callable[[str, dict[str, Any]], ObjectStore]
"""Builds the store for a URI from it and its back-end options."""

_FACTORIES: dict[str, StoreFactory] = {}
_FSSPEC = "fsspec+"


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Make `open_store` build `factory(uri, options)` for URIs with this scheme (in this
    process; an installed package can use the ``spotckpt.stores`` entry points instead)."""
    _FACTORIES[scheme] = factory


def uri_scheme(uri: str) -> str:
    """The scheme of `uri`; plain paths (including Windows drive letters) count as ``file``."""
    scheme = urlsplit(uri).scheme
    return scheme if len(scheme) > 1 else "file"


def open_store(uri: str, **options: Any) -> ObjectStore:
    """Open the store for `uri`: ``s3://bucket/prefix``, ``gs://bucket/prefix``,
    ``az://container/prefix``, ``fsspec+<protocol>://...``, ``file:///path`` or a plain path,
    ``memory://name``, or a scheme an installed package adds (see the module docstring).
    Options go to the back end (for S3: ``endpoint_url``, ``part_size``, ``max_concurrency``,
    ``region_name``, ...)."""
    return _factory(uri_scheme(uri))(uri, dict(options))


def _factory(scheme: str) -> StoreFactory:
    """The registered factory for `scheme`, else the one its entry point names (loaded once)."""
    factory = _FACTORIES.get(scheme)
    if factory is not None:
        return factory
    if scheme.startswith(_FSSPEC):
        return _BUILT_IN[_FSSPEC]
    found = entry_points(group=ENTRY_POINT_GROUP, name=scheme)
    if not found:
        known = sorted({*_FACTORIES, *entry_points(group=ENTRY_POINT_GROUP).names})
        listed = ", ".join(f"{name}://" for name in known)
        raise InvalidArgumentError(
            f"unsupported storage URI scheme {scheme!r}; use one of {listed}"
        )
    if len(found) > 1:
        claims = "; ".join(_describe(entry) for entry in found)
        raise StorageError(f"more than one installed package adds the {scheme}:// store: {claims}")
    factory = _load(next(iter(found)))
    _FACTORIES[scheme] = factory
    return factory


def _load(entry: EntryPoint) -> StoreFactory:
    """The factory an entry point names; a StorageError naming it when that cannot be had."""
    try:
        factory = entry.load()
    except Exception as error:
        raise StorageError(
            f"the {entry.name}:// store could not be loaded from {_describe(entry)}: "
            f"{type(error).__name__}: {error}"
        ) from error
    if not callable(factory):
        raise StorageError(
            f"the {entry.name}:// store from {_describe(entry)} is a {type(factory).__name__}, "
            "not a factory(uri, options) that returns a store"
        )
    return factory


def _describe(entry: EntryPoint) -> str:
    """The entry point as a message names it: its value, group and distribution."""
    package = f" (package {entry.dist.name})" if entry.dist is not None else ""
    return f"the entry point {entry.name} = {entry.value} in {ENTRY_POINT_GROUP}{package}"


@dataclass(frozen=True)
class _BackEnd:
    """A built-in back end, imported when a URI of its first opens (with its SDK): a missing
    SDK is a MissingDependencyError naming `extra` (None: a core dependency)."""

    module: str
    function: str
    extra: str | None

    def __call__(self, uri: str, options: dict[str, Any]) -> ObjectStore:
        try:
            module = importlib.import_module(self.module)
        except ImportError as error:
            if self.extra is None:
                raise
            purpose = f"the {uri_scheme(uri)}:// store"
            raise missing_extra(self.extra, purpose, error) from error
        store: ObjectStore = getattr(module, self.function)(uri, options)
        return store


_S3 = _BackEnd("spotckpt.storage.s3", "open_s3_store", None)
_GCS = _BackEnd("spotckpt.storage.gcs", "open_gcs_store", "gcs")
_AZURE = _BackEnd("spotckpt.storage.azure", "open_azure_store", "azure")
_BUILT_IN: dict[str, StoreFactory] = {
    "file": open_local_store,
    "memory": open_memory_store,
    "s3": _S3,
    "gs": _GCS,
    "gcs": _GCS,
    "az": _AZURE,
    "abfs": _AZURE,
    "abfss": _AZURE,
    _FSSPEC: _BackEnd("spotckpt.storage.fsspec", "open_fsspec_store", "fsspec"),
}
"""The built-in schemes (``fsspec+`` stands for every ``fsspec+<protocol>``)."""


def store_extras() -> dict[str, str | None]:
    """The extra each built-in scheme needs (None: the core install has what it needs)."""
    return {
        scheme: factory.extra if isinstance(factory, _BackEnd) else None
        for scheme, factory in _BUILT_IN.items()
    }


for _scheme, _built_in in _BUILT_IN.items():
    if _scheme != _FSSPEC:
        register_store(_scheme, _built_in)
