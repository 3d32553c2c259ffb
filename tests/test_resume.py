"""Exact resume: a run killed with SIGKILL and restarted matches an uninterrupted run bit for bit.

These run the real example (`examples/train.py`, two data-loader workers that mask input
characters at random, dropout, AdamW, warm-up + cosine, gradient accumulation) as child processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
# 160 windows of 32 characters, 16 per batch, 2 micro-batches per step: 5 steps per epoch.
SMALL = ["--corpus-chars", str(160 * 32 + 1), "--batch-size", "16", "--accumulate", "2"]
STEPS = 14


def run_train(
    uri: str, workdir: Path, name: str, *extra: str, expect: int = 0
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPOTCKPT_URI": uri, "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        str(TRAIN),
        "--steps",
        str(STEPS),
        "--save-every",
        "2",
        "--workers",
        "2",
        "--loss-log",
        str(workdir / f"{name}.losses"),
        "--digest-file",
        str(workdir / f"{name}.digest"),
        *SMALL,
        *extra,
    ]
    result = subprocess.run(
        command, env=env, cwd=workdir, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == expect, result.stderr[-3000:]
    return result


def losses(path: Path) -> dict[int, set[str]]:
    """Every loss logged per step (a step re-run after a restart logs twice)."""
    seen: dict[int, set[str]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        seen.setdefault(entry["step"], set()).add(entry["loss"])
    return seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, set[str]], str]:
    workdir = tmp_path_factory.mktemp("reference")
    run_train(str(workdir / "ckpt"), workdir, "ref")
    return losses(workdir / "ref.losses"), (workdir / "ref.digest").read_text()


@pytest.mark.parametrize(
    ("kills", "label"),
    [((4,), "mid-epoch"), ((10,), "epoch boundary"), ((4, 8), "two interruptions")],
)
def test_killed_and_resumed_run_matches(
    reference: tuple[dict[int, set[str]], str],
    tmp_path: Path,
    kills: tuple[int, ...],
    label: str,
) -> None:
    ref_losses, ref_digest = reference
    uri = str(tmp_path / "ckpt")
    for kill in kills:
        run_train(uri, tmp_path, "run", "--kill-after-commit", str(kill), expect=-signal.SIGKILL)
    run_train(uri, tmp_path, "run")
    resumed = losses(tmp_path / "run.losses")
    assert sorted(resumed) == list(range(1, STEPS + 1)), label
    for step, values in resumed.items():
        assert values == ref_losses[step], f"{label}: loss of step {step} differs"
    assert (tmp_path / "run.digest").read_text() == ref_digest, label
