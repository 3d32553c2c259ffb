"""Every exception spotckpt raises derives from `spotckpt.CheckpointError`."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import spotckpt
from spotckpt import CheckpointError

PACKAGE = Path(spotckpt.__file__).parent
# Raised only to be caught and translated in the same module, or required by the language.
INTERNAL = {
    ("spotckpt", "AttributeError"),  # PEP 562 module __getattr__ must raise AttributeError
    ("spotckpt.storage.gcs", "DataCorruption"),  # google's own type, retried then translated
    ("spotckpt.storage.gcs", "InvalidResponse"),
}


def _raised_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            if isinstance(func, ast.Name):
                names.add(func.id)
    return names


def test_every_raised_exception_is_a_checkpoint_error() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module_name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(module_name)
        for name in _raised_names(path):
            if (module_name, name) in INTERNAL:
                continue
            raised = getattr(module, name, None)
            if not isinstance(raised, type):
                continue  # a function building the error (`raise _fail(...)`): its raises count
            if not issubclass(raised, CheckpointError):
                offenders.append(f"{module_name}: raise {name}(...)")
    assert not offenders, offenders


def test_public_errors_keep_their_builtin_bases() -> None:
    """Generic handlers (except ValueError, FileNotFoundError, ...) keep working."""
    from spotckpt.errors import InvalidArgumentError, InvalidTypeError, ManifestError
    from spotckpt.storage import AlreadyExistsError, ObjectNotFoundError

    assert issubclass(InvalidArgumentError, ValueError) and issubclass(ManifestError, ValueError)
    assert issubclass(InvalidTypeError, TypeError)
    assert issubclass(ObjectNotFoundError, FileNotFoundError)
    assert issubclass(AlreadyExistsError, FileExistsError)
    assert issubclass(spotckpt.KeyMismatchError, CheckpointError)
    assert issubclass(spotckpt.ConfigError, CheckpointError)
