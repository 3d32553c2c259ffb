"""The house's size limits (issue 45): the manager stays a front, no module regrows into several.

Layering (which module may import which) is checked by import-linter in `make lint`; sizes are
what it cannot see. The limits leave room for what later work adds without crossing them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import spotckpt

PACKAGE = Path(spotckpt.__file__).parent
MODULE_LIMIT = 900
ROOM_LIMIT = 700
ROOMS = ("manager.py", "catalog.py", "interval.py", "goodput.py", "stats.py")
MANAGER_METHODS = 25
MANAGER_LINES = 450


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_larger_than_the_limit() -> None:
    over = {
        str(p.relative_to(PACKAGE)): _lines(p)
        for p in PACKAGE.rglob("*.py")
        if _lines(p) > MODULE_LIMIT
    }
    assert not over, f"modules over {MODULE_LIMIT} lines: {over}"


def test_the_rooms_that_grew_before_stay_small() -> None:
    sizes = {name: _lines(PACKAGE / name) for name in ROOMS}
    sizes.update({str(p.relative_to(PACKAGE)): _lines(p) for p in (PACKAGE / "cli").rglob("*.py")})
    over = {name: n for name, n in sizes.items() if n > ROOM_LIMIT}
    assert not over, f"over {ROOM_LIMIT} lines: {over}"


def test_the_manager_is_a_front() -> None:
    tree = ast.parse((PACKAGE / "manager.py").read_text())
    [manager] = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "CheckpointManager"
    ]
    methods = [n for n in manager.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    lines = (manager.end_lineno or manager.lineno) - manager.lineno + 1
    assert len(methods) <= MANAGER_METHODS, [m.name for m in methods]
    assert lines <= MANAGER_LINES, lines
