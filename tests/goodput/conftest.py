"""Fixtures of the goodput tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ck")
    return str(request.getfixturevalue("s3_uri"))
