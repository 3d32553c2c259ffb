"""Smoke test of `benchmarks/dcp_convert_bench.py` at a small size: it measures
``dcp_to_torch_save``, ``import_dcp`` and ``export_dcp`` each in a process of its own, prints the
table with the load average, and its JSON holds every figure. No timing or memory thresholds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import REPO

pytestmark = pytest.mark.process  # its tests start processes


@pytest.mark.timeout(300)
def test_conversion_benchmark_reports_time_and_peak_memory(tmp_path: Path) -> None:
    out = tmp_path / "convert.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "dcp_convert_bench.py"),
            "--state-mib",
            "16",
            "--tensors",
            "4",
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "load average before" in done.stdout
    figures = json.loads(out.read_text())["figures"]
    assert set(figures) == {"dcp_to_torch_save", "import_dcp", "export_dcp"}
    for found in figures.values():
        assert math.isfinite(found["seconds"]) and found["seconds"] > 0
        assert math.isfinite(found["peak_mib"])
