"""docs/configuration.md's settings table lists every setting, with its variable and default,
as the code declares them: a setting added to `spotckpt.config.Settings` fails this test until
it has a row.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from spotckpt.config import _CODE_ONLY, ENV_PREFIX, Config, Settings

TABLE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
HEADER = "| setting | env | default | what it does |"


def _rows() -> dict[str, list[str]]:
    """The table's rows by setting name: the cells after the name."""
    lines = TABLE_PAGE.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER) + 2  # past the header and its |---| line
    rows: dict[str, list[str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        name = re.fullmatch(r"`(\w+)`", cells[0])
        assert name is not None, f"a row names one setting in backquotes: {line}"
        assert name[1] not in rows, f"{name[1]} has two rows"
        rows[name[1]] = cells[1:]
    return rows


def _shown(value: Any) -> str:
    """A default as the table writes it (TOML's spelling; none for None)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_every_setting_has_a_row_with_its_variable_and_default() -> None:
    rows = _rows()
    declared = [field.name for field in dataclasses.fields(Config)]
    assert "uri" in declared and set(declared) > {f.name for f in dataclasses.fields(Settings)}
    assert sorted(rows) == sorted(declared), (
        f"missing rows: {sorted(set(declared) - set(rows))}; "
        f"rows of no setting: {sorted(set(rows) - set(declared))}"
    )
    defaults = Settings()
    for name, (env, default, what) in rows.items():
        assert what, f"{name}: say what it does"
        if name in _CODE_ONLY:
            assert env == "code only", name
        else:
            assert env.split()[0] == f"`{ENV_PREFIX}{name.upper()}`", (name, env)
        if name == "uri":
            assert default == "required"
        elif name == "storage_options":
            assert default == "{}" and defaults.storage_options == {}
        else:
            assert default == _shown(getattr(defaults, name)), (name, default)
