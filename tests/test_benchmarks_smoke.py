"""Smoke test of the benchmark harness: `benchmarks/run.py --quick` runs every case once.

No timing thresholds here (timings depend on the machine); only that every case ran and
reported positive, finite numbers, and that the report has its targets.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "run.py"
S3_METHODS = ("spotckpt", "dcp_fsspec", "torch_save_boto3", "s3torchconnector", "raw_boto3")
LOCAL_METHODS = ("spotckpt", "dcp_fs", "torch_save_file", "raw_file")
# Optional tools: reported as skipped, with the reason, when not installed.
OPTIONAL = {"s3torchconnector"}


def _weed_installed() -> bool:
    return bool(shutil.which("weed") or Path(sys.executable).with_name("weed").exists())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    json_out = out / "quick.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    proc = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--quick",
            "--json-out",
            str(json_out),
            "--results-dir",
            str(out / "results"),
            "--workdir",
            str(out / "scratch"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only, never a performance bound
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "TARGETS" in proc.stdout
    assert (out / "results" / "latest.json").exists()
    return json.loads(json_out.read_text())


def _expected_ids(data: dict[str, Any]) -> set[str]:
    servers = data["meta"]["settings"]["servers"]
    states = {c["state"] for c in data["cases"] if c["group"] in ("s3", "local")}
    assert any(s.startswith("large-") for s in states) and any(
        s.startswith("small-") for s in states
    ), states
    ids = set()
    for state in states:
        for op in ("save", "restore"):
            for server in servers:
                ids |= {f"s3/{server}/{state}/{m}/{op}" for m in S3_METHODS}
            ids |= {f"local/disk/{state}/{m}/{op}" for m in LOCAL_METHODS}
        ids.add(f"stall/{data['meta']['primary_server']}/{state}/spotckpt_async/stall")
        ids.add(f"stall/memory/{state}/memcpy/copy")
    return ids


def test_every_case_ran_with_positive_numbers(results: dict[str, Any]) -> None:
    meta = results["meta"]
    assert meta["quick"] is True
    assert "moto" in meta["settings"]["servers"]
    if _weed_installed():
        assert "weed" in meta["settings"]["servers"]
    assert meta["primary_server"] in meta["settings"]["servers"]
    cases = {c["id"]: c for c in results["cases"]}
    missing = _expected_ids(results) - set(cases)
    assert not missing, sorted(missing)
    for case_id, case in cases.items():
        if case["status"] == "skipped" and case["method"] in OPTIONAL:
            assert case["error"], case_id  # the reason is reported
            continue
        assert case["status"] == "ok", (case_id, case.get("error"), case.get("traceback"))
        assert case["bytes"] > 0 and case["tensors"] > 0, case_id
        assert len(case["reps"]) == case["reps_planned"] >= 1, case_id
        for rep in case["reps"]:
            assert math.isfinite(rep["seconds"]) and rep["seconds"] > 0, case_id
            assert math.isfinite(rep["cpu_s"]) and rep["cpu_s"] >= 0, case_id
            assert rep["peak_extra_bytes"] >= 0, case_id
        assert case["median_s"] > 0, case_id


def test_memory_cases_at_two_sizes(results: dict[str, Any]) -> None:
    primary = results["meta"]["primary_server"]
    sizes = results["meta"]["settings"]["memory_sizes"]
    assert len(sizes) == 2
    cases = {c["id"]: c for c in results["cases"]}
    smaller = sizes[0]
    label = f"large-{smaller >> 20}MiB"
    for method, op in (("spotckpt", "save"), ("spotckpt_async", "stall")):
        case = cases[f"memory/{primary}/{label}/{method}/{op}"]
        assert case["status"] == "ok" and case["peak_extra_bytes"] > 0, case


def test_targets_are_reported(results: dict[str, Any]) -> None:
    names = {t["target"] for t in results["targets"]}
    for expected in (
        "save >= 0.9x raw multipart put",
        "save faster than DCP fsspec writer",
        "restore >= 0.8x raw get",
        "restore >= 10x DCP fsspec reader",
        "CPU/GiB saved <= 1.2x raw put",
        "async stall <= 1.5x in-memory copy",
        "async stall <= 0.1x blocking save",
        "peak extra memory bounded (blocking save)",
        "peak extra memory bounded (async save)",
    ):
        assert expected in names, expected
    for target in results["targets"]:
        assert target["pass"] in (True, False), target  # every target measured in the run
        assert target["value"] is not None and target["value"] > 0, target
