"""Smoke test of `benchmarks/mirror_bench.py` at a tiny size: it runs without, with and with a
capped mirror, prints its table with the load average, and its JSON holds every figure. No
timing thresholds beyond one the cap itself sets: the capped copies cannot beat the cap by more
than its one-second burst allows."""

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

STATE_MIB = 8
CAP_MIB = 2.0


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def test_mirror_benchmark_reports_throughput_lag_stall_and_cpu(tmp_path: Path) -> None:
    out = tmp_path / "mirror.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "mirror_bench.py"),
            "--state-mib",
            str(STATE_MIB),
            "--saves",
            "2",
            "--every",
            "2",
            "--step-s",
            "0.05",
            "--cap-mib",
            str(CAP_MIB),
            "--results-dir",
            str(tmp_path / "results"),
            "--json-out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,  # a hang guard only, never a performance bound
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "load average" in proc.stdout and "extra CPU s/GiB" in proc.stdout
    assert len(list((tmp_path / "results").glob("mirror-*.json"))) == 1
    data = json.loads(out.read_text())
    assert len(data["meta"]["load_before"]) == 3
    runs = {run["run"]: run for run in data["runs"]}
    assert set(runs) == {"off", "on", "capped"}
    assert runs["off"]["mirrored"] == [] and runs["off"]["committed"] == [2, 4]
    state_bytes = STATE_MIB << 20
    for kind in ("on", "capped"):
        run, row = runs[kind], data["summary"][kind]
        assert run["committed"] == [2, 4] and run["mirrored"] == [2, 4], run
        assert run["skipped"] == []
        assert run["mirrored_bytes"] >= 2 * state_bytes
        # the mirror's proxy received at least what the copies say they moved
        assert run["proxies"]["mirror"]["bytes_in"] >= run["mirrored_bytes"]
        assert all(_finite(lag) and lag >= 0 for lag in run["lag_s"].values())
        assert len(run["steps_behind_after_save"]) == len(run["stall_s"]) == 2
        for name in ("mirror_mib_s", "mean_lag_s", "stall_ratio", "extra_cpu_s_per_gib"):
            assert _finite(row[name]), (kind, name, row)
        assert row["mirror_mib_s"] > 0 and row["stall_ratio"] > 0
    # each step copies STATE_MIB at CAP_MIB per second after a burst of one second's worth
    assert data["summary"]["capped"]["mirror_mib_s"] <= 1.5 * CAP_MIB
