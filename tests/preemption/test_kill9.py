"""kill -9 of a saving process at random moments never leaves a half-visible checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spotckpt import CheckpointManager

from kill_target import empty_state, state_for
from tests_support import REPO, TESTS


def _trial(uri: str, rng: random.Random) -> tuple[int, list[int]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
    child = subprocess.Popen(
        [sys.executable, str(TESTS / "kill_target.py"), uri],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    time.sleep(rng.uniform(0.05, 1.5))
    child.send_signal(signal.SIGKILL)
    output, _ = child.communicate(timeout=30)
    committed = [
        int(line.split()[1]) for line in output.splitlines() if line.startswith("committed")
    ]
    return child.returncode, committed


def _check(uri: str, reported: list[int]) -> None:
    options = {"part_size": 5 << 20} if uri.startswith("s3://") else {}
    with CheckpointManager(uri, preemption=False, storage_options=options) as mgr:
        steps = mgr.steps()
        # every step that claims to be committed restores completely and correctly
        for step in steps:
            target = empty_state()
            assert mgr.restore(target, step=step, fallback=False) == step
            expected = state_for(step)
            assert torch.equal(target["big"], expected["big"]) and target["step"] == step
            assert all(
                torch.equal(target["many"][k], expected["many"][k]) for k in expected["many"]
            )
        # nothing the process reported as committed is lost (retention keeps the last two)
        if reported:
            assert reported[-1] in steps


def _run_trials(uris: list[str], trials: int, seed: int) -> None:
    rng = random.Random(seed)
    for trial in range(trials):
        uri = uris[trial % len(uris)]
        status, reported = _trial(uri, rng)
        assert status == -signal.SIGKILL
        _check(uri, reported)


def test_kill9_trials(tmp_path: Path, s3_uri: str) -> None:
    """Three kills a store in `make test`; `make test-all` runs fifty more."""
    _run_trials([str(tmp_path / "ck"), s3_uri], trials=6, seed=1)


@pytest.mark.slow
def test_kill9_fifty_trials(tmp_path: Path, s3_uri: str) -> None:
    _run_trials([str(tmp_path / "ck"), s3_uri], trials=50, seed=2)
