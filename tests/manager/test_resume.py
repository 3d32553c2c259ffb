"""Exact resume: a run killed with SIGKILL and restarted matches an uninterrupted run bit for bit.

These run the real example (`examples/train.py`, two data-loader workers that mask input
characters at random, dropout, AdamW, warm-up + cosine, gradient accumulation) as child processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import REPO

TRAIN = REPO / "examples" / "train.py"
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


@pytest.mark.process
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


@pytest.mark.process
def test_killed_run_resumes_from_the_fast_tier_past_the_durable_save(
    reference: tuple[dict[int, set[str]], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Durable saves every 6 steps, fast-tier saves every 2: killed right after the fast save of
    step 8, the restart on the same node resumes from the tier's step 8, not the store's 6."""
    ref_losses, ref_digest = reference
    monkeypatch.setenv("SPOTCKPT_NODE", "node-a")
    (tmp_path / "disks").mkdir()
    tier = [
        "--save-every",
        "6",
        "--local-every",
        "2",
        "--local-dir",
        str(tmp_path / "disks/{node}"),
    ]
    uri = str(tmp_path / "ckpt")
    run_train(uri, tmp_path, "run", *tier, "--kill-after-commit", "8", expect=-signal.SIGKILL)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-000000006"]
    resumed = run_train(uri, tmp_path, "run", *tier)
    assert "starting at step 9 (restored: 8)" in resumed.stderr, resumed.stderr[-3000:]
    read = re.search(r"restore read: local (\d+) B, peer (\d+) B, store (\d+) B", resumed.stderr)
    assert read is not None and int(read[1]) > 0 and read.groups()[1:] == ("0", "0"), resumed.stderr
    seen = losses(tmp_path / "run.losses")
    assert sorted(seen) == list(range(1, STEPS + 1))
    for step, values in seen.items():
        assert values == ref_losses[step], f"loss of step {step} differs"
    assert (tmp_path / "run.digest").read_text() == ref_digest
