"""Smoke test of `benchmarks/azure_bench.py`: a tiny run on Azurite reports both ratios (no
timing thresholds: timings depend on the machine)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from azurite import azurite_command
from tests_support import REPO

pytestmark = pytest.mark.process  # its tests start processes or servers


def test_the_azure_benchmark_runs_and_reports_ratios() -> None:
    if azurite_command() is None:
        pytest.skip("Azurite is not installed: run `make azurite` (npm install azurite)")
    command = [sys.executable, str(REPO / "benchmarks" / "azure_bench.py")]
    done = subprocess.run(
        [*command, "--mib", "2", "--tensor-mib", "1", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for operation in ("save", "restore"):
        found = re.search(rf"^{operation}\s+spotckpt .* ratio (\d+\.\d+)$", done.stdout, re.M)
        assert found is not None, done.stdout
        assert float(found[1]) > 0
