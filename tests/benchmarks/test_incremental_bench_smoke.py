"""Smoke test of `benchmarks/incremental.py` at a tiny size against moto: it runs, restores bit
for bit, and reports every target with a finite value. No timing thresholds (the machine decides
those); the bytes are checked: saves after the first upload far less than the first."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import REPO

pytestmark = pytest.mark.process  # its tests start processes or servers


def test_incremental_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "incremental.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, str(REPO / "benchmarks" / "incremental.py"), "--base-mib", "8"]
    proc = subprocess.run(
        [
            *command,
            "--steps",
            "3",
            "--dense-saves",
            "2",
            "--servers",
            "moto",
            "--json-out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only, never a performance bound
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "TARGETS" in proc.stdout and "bit-exact" in proc.stdout
    data = json.loads(out.read_text())
    (figures,) = data["results"]
    assert figures["steps_kept"] == [1, 2, 3]
    assert all(b < figures["uploaded_bytes"][0] / 2 for b in figures["uploaded_bytes"][1:])
    assert len(data["targets"]) == 4
    assert all(math.isfinite(row["value"]) for row in data["targets"])
