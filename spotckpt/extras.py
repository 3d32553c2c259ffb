"""Optional parts and the ``pip install 'spotckpt[extra]'`` that brings each.

The core install holds what ``import spotckpt``, the local store and S3 need; each cloud and each
training framework is an extra (pyproject.toml). Code that needs one imports it where it is used
and, when the import fails, raises `MissingDependencyError` saying which extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from spotckpt.errors import MissingDependencyError


def missing_extra(extra: str, purpose: str, error: ImportError) -> MissingDependencyError:
    """The error for `purpose` (``"the GCS store"``) when the `extra`'s packages are absent."""
    return MissingDependencyError(
        f"{purpose} needs the {extra} extra: pip install 'spotckpt[{extra}]' ({error})"
    )


def has_module(name: str) -> bool:
    """Whether `name` can be imported, without importing it (a None in ``sys.modules``, which
    Python documents as blocking an import, counts as absent)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:
        return False


def import_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """`module`, imported; a `MissingDependencyError` naming `extra` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise missing_extra(extra, purpose, error) from error
