"""Fixtures of the command-line tests: private copies of the shared 4-rank checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fsdp_checkpoints import fsdp_checkpoint, tied_checkpoint


@pytest.fixture
def fsdp_copy(tmp_path: Path) -> Path:
    """A private copy of the 4-rank checkpoint."""
    return Path(shutil.copytree(fsdp_checkpoint(), tmp_path / "ckpt"))


@pytest.fixture
def tied_copy(tmp_path: Path) -> Path:
    """A private copy of the 4-rank tied checkpoint."""
    return Path(shutil.copytree(tied_checkpoint(), tmp_path / "tied"))
