"""`open_store` finds a scheme among the built-in stores, then among installed packages' entry
points (group ``spotckpt.stores``); the registry sits above the stores, so no import circles.

The entry points here are real: a distribution's ``.dist-info`` with an ``entry_points.txt`` in a
folder put on ``sys.path``, found by `importlib.metadata` as an installed package would be.
"""

from __future__ import annotations

import ast
import graphlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import spotckpt.storage
from spotckpt.errors import InvalidArgumentError, StorageError
from spotckpt.storage import open_store, registry
from spotckpt.storage.memory import MemoryStore

PLUGIN = "spotckpt_teststore"
ENTRY_POINTS = f"""
[spotckpt.stores]
teststore = {PLUGIN}:open_test_store
memory = {PLUGIN}:never_called
broken = {PLUGIN}_missing:open_store
notafactory = {PLUGIN}:NOT_A_FACTORY
"""
MODULE = """
from spotckpt.storage.memory import MemoryStore

OPENED = []
NOT_A_FACTORY = 42


def open_test_store(uri, options):
    OPENED.append((uri, options))
    return MemoryStore("teststore-" + uri.partition("://")[2])


def never_called(uri, options):
    raise AssertionError("a built-in scheme must win over an entry point")
"""


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A distribution declaring four stores, installed into a folder on ``sys.path``."""
    info = tmp_path / "spotckpt_teststore-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: spotckpt-teststore\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    (tmp_path / f"{PLUGIN}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    yield tmp_path
    sys.modules.pop(PLUGIN, None)


def test_an_entry_point_adds_a_scheme(installed: Path) -> None:
    store = open_store("teststore://run-1", flavour="plain")
    assert isinstance(store, MemoryStore) and store.uri == "memory://teststore-run-1"
    assert sys.modules[PLUGIN].OPENED == [("teststore://run-1", {"flavour": "plain"})]
    open_store("teststore://run-2")
    assert len(sys.modules[PLUGIN].OPENED) == 2


def test_a_builtin_scheme_wins_over_an_entry_point(installed: Path) -> None:
    assert isinstance(open_store("memory://registry"), MemoryStore)
    assert PLUGIN not in sys.modules


def test_a_broken_entry_point_is_named(installed: Path) -> None:
    with pytest.raises(StorageError, match=r"broken:// .*broken = spotckpt_teststore_missing"):
        open_store("broken://x")
    with pytest.raises(StorageError, match=r"notafactory = spotckpt_teststore:NOT_A_FACTORY"):
        open_store("notafactory://x")


def test_an_unknown_scheme_lists_the_entry_points_too(installed: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"'nosuch'; use one of .*teststore://"):
        open_store("nosuch://x")


def test_register_store_is_consulted_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    made = MemoryStore("registered")
    registry.register_store("custom", lambda uri, options: made)
    assert open_store("custom://anything") is made


def _storage_imports(path: Path) -> set[str]:
    """The ``spotckpt.storage`` modules that the file imports, anywhere in it (a name taken from
    the package itself counts as its ``__init__``, unless it is a submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "spotckpt.storage":
            found.update(
                f"spotckpt.storage.{alias.name}"
                if (path.parent / f"{alias.name}.py").exists()
                else "spotckpt.storage"
                for alias in node.names
            )
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("spotckpt.storage")}


def test_the_storage_package_has_no_import_circle() -> None:
    folder = Path(spotckpt.storage.__file__).parent
    graph = {
        f"spotckpt.storage.{path.stem}".removesuffix(".__init__"): _storage_imports(path)
        for path in folder.glob("*.py")
    }
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the circle
    assert "spotckpt.storage.registry" not in graph["spotckpt.storage.base"]
