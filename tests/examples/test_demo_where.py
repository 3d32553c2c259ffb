"""`make demo` ends by saying where each run wrote and how to look at it; the commands it prints
work as printed (run here through a shell that has not activated the virtual environment, on a
real checkpoint in a folder whose name needs quoting), and with the embedded server it says that
the checkpoints are gone."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from spotckpt import CheckpointManager

from tests_support import REPO, SCRIPT


def _demo() -> ModuleType:
    if "spotckpt_demo" in sys.modules:  # loaded by another test module already
        return sys.modules["spotckpt_demo"]
    spec = importlib.util.spec_from_file_location("spotckpt_demo", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["spotckpt_demo"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.process
def test_printed_commands_show_the_spot_run(tmp_path: Path) -> None:
    base = tmp_path / "my checkpoints" / "demo-1234abcd"
    runs = {"spot run": f"{base}/spot", "reference run": f"{base}/reference"}
    with CheckpointManager(runs["spot run"], preemption=False) as mgr:
        mgr.save(25, {"w": torch.ones(3)}, blocking=True)
    text = _demo().where_to_look(runs, embedded=False)
    assert f"spot run:      {runs['spot run']}" in text
    assert f"reference run: {runs['reference run']}" in text
    hint = text.splitlines().index("look at the spot run's checkpoints and its goodput with:")
    commands = [line.strip() for line in text.splitlines()[hint + 1 :]]
    assert [c.split()[1] for c in commands] == ["ls", "stats"]
    assert all(c.startswith(f"{SCRIPT} ") for c in commands)  # this environment's spotckpt
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    env["PATH"] = os.defpath  # a shell that has not activated the virtual environment
    env.pop("VIRTUAL_ENV", None)
    listed, stats = (
        subprocess.run(
            command, shell=True, capture_output=True, text=True, timeout=300, env=env, check=False
        )
        for command in commands
    )
    assert listed.returncode == 0, listed.stderr
    assert "25" in listed.stdout and "no committed" not in listed.stdout
    assert stats.returncode == 0, stats.stderr


def test_embedded_server_run_says_its_checkpoints_are_gone() -> None:
    runs = {"spot run": "s3://demo-1/runs/tiny/spot", "reference run": "s3://demo-1/x/reference"}
    text = _demo().where_to_look(runs, embedded=True)
    assert "s3://demo-1/runs/tiny/spot" in text
    assert "these checkpoints are gone" in text and "SPOTCKPT_URI=" in text
    assert "spotckpt ls" not in text  # nothing left to look at
