"""Smoke test of the benchmark harness: `benchmarks/run.py --quick` runs every case once.

No timing thresholds here (timings depend on the machine); only that every case ran and
reported positive, finite numbers, and that the report has its targets.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests_support import REPO

RUN = REPO / "benchmarks" / "run.py"
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_report  # noqa: E402

S3_METHODS = bench_report.S3_ORDER
LOCAL_METHODS = ("spotckpt", "dcp_fs", "torch_save_file", "raw_file")
# Optional tools: reported as skipped, with the reason, when not installed.
OPTIONAL = {"s3torchconnector"}
TIER_PARTS = {"tiers/single", "tiers/nodes/replicate:2", "tiers/nodes/ec:2+1"}
TIER_SECONDS = {
    "single": (
        "raw_write_s",
        "fast_save_s",
        "bucket_save_s",
        "raw_read_s",
        "fast_restore_s",
        "bucket_restore_s",
        "async_stall_s",
        "async_done_s",
    ),
    "nodes": ("fast_save_s", "bucket_save_s", "peer_restore_s", "bucket_restore_s"),
}


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
        cwd=REPO,
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


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.process
def test_targets_are_reported(results: dict[str, Any]) -> None:
    names = {t["target"] for t in results["targets"]}
    for expected in (
        "save >= 0.9x raw multipart put",
        "save faster than DCP fsspec writer",
        "restore >= 0.9x best raw get",
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
        assert target["value"] is not None, target
        # A count that must be zero (bytes read from the bucket) is the one value allowed at 0.
        assert target["value"] > 0 or (target["threshold"] == 0 and target["value"] == 0), target


def _sources(rep: dict[str, Any], key: str) -> dict[str, int]:
    sources = rep[key]
    assert set(sources) == {"local", "peer", "store"}, sources
    assert all(isinstance(v, int) and v >= 0 for v in sources.values()), sources
    return sources


@pytest.mark.process
def test_fast_tier_section_has_its_parts_sources_and_targets(results: dict[str, Any]) -> None:
    tiers = results["tiers"]
    assert tiers["store"] == results["meta"]["primary_server"]
    assert len(tiers["load_before"]) == 3 and len(tiers["load_after"]) == 3
    parts = {part["id"]: part for part in tiers["parts"]}
    assert set(parts) == TIER_PARTS
    for part_id, part in parts.items():
        assert part["status"] == "ok", (part_id, part.get("error"))
        assert len(part["reps"]) == part["reps_planned"] >= 1, part_id
        assert part["bytes"] > 0 and part["tensors"] > 0, part_id
        for rep in part["reps"]:
            for key in TIER_SECONDS[part["kind"]]:
                assert math.isfinite(rep[key]) and rep[key] > 0, (part_id, key)
            from_bucket = _sources(rep, "bucket_restore_sources")
            assert from_bucket["store"] >= part["bytes"], (part_id, from_bucket)
            if part["kind"] == "single":
                fast = _sources(rep, "fast_restore_sources")
                assert fast["local"] >= part["bytes"] and fast["store"] == 0, fast
            else:
                peers = _sources(rep, "peer_restore_sources")
                # The lost node's object came from the others, none of it from the bucket.
                assert peers["peer"] >= part["bytes_per_rank"] and peers["store"] == 0, peers
    text = bench_report.render(results)
    assert "FAST TIER, one process" in text
    assert "FAST TIER, replicate:2 on 4 nodes" in text and "FAST TIER, ec:2+1 on 3 nodes" in text
    where = {(t["target"].split(" from ")[0], t["where"]) for t in results["targets"]}
    for spec in ("replicate:2, 4 nodes", "ec:2+1, 3 nodes"):
        assert ("one-node loss: restore reads 0 bytes", spec) in where
        assert ("one-node loss: restore >= 2x faster than", spec) in where
    assert any(t["target"] == "fast save >= 0.8x raw local write" for t in results["targets"])


@pytest.mark.process
def test_ddp_section_reads_the_checkpoint_once_against_dcp_per_rank(
    results: dict[str, Any],
) -> None:
    ddp = results["ddp"]
    assert ddp["status"] == "ok" and ddp["world"] == 4, ddp.get("error")
    assert ddp["store"] == results["meta"]["primary_server"]
    size = ddp["checkpoint_bytes"]
    spot, dcp = ddp["spotckpt"], ddp["dcp_default"]
    assert len(spot["reps"]) == len(dcp["reps"]) >= 1
    # spotckpt reads each replicated tensor once; DCP's default planning once per rank.
    assert size <= spot["bytes_read"] <= 1.05 * size, (spot, size)
    assert dcp["bytes_read"] >= 3.9 * size, (dcp, size)
    assert "DDP RESTORE, 4 ranks" in bench_report.render(results)
    assert any(t["target"].startswith("4-rank DDP restore reads") for t in results["targets"])


@pytest.mark.process
def test_scale_simulator_reports_every_phase_for_a_small_fsdp_case() -> None:
    """Mirrors docs/scale.md's command at a small size (its options, fewer ranks)."""
    scale = REPO / "benchmarks" / "scale.py"
    command = [sys.executable, str(scale), "--ranks", "8", "--tensors", "20", "--layout", "fsdp"]
    proc = subprocess.run(
        [*command, "--steps", "10", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only, never a performance bound
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(proc.stdout)
    for name in (
        "commit_s",
        "restore_parse_s",
        "dcp_global_plan_s",
        "spotckpt_coordinator_s",
        "peak_coordinator_mib",
    ):
        assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures[name])
    # 20 tensors in 8 even Shard(0) pieces each, plus 3 values held by every rank.
    assert figures["local_plan_items"] == 8 * 23 and figures["chunks"] == 8 * 20, figures
    assert figures["manifest_bytes"] > 0 and figures["restore_metadata_bytes_per_rank"] > 0
    assert figures["restore_error"] is None and figures["restore_read_items"] == 23, figures
    assert figures["list_requests_latest"] >= 1 and figures["list_requests_retention"] >= 1
    assert figures["retired_steps"] == 10 - 3, figures  # retire(keep_last=3) over 10 steps
    # spotckpt's planner: the second save's unchanged plans travel as digests and are reused.
    assert figures["planner"] == "spotckpt" and figures["cached_plan_reused"] is True, figures
    assert figures["cached_plan_gather_bytes"] < figures["dcp_plan_gather_bytes"], figures


@pytest.mark.process
def test_plan_check_bench_agrees_with_dcp_on_a_small_2d_layout() -> None:
    stdout = _bench("plan_check_bench.py", "--ranks", "32", "--tensors", "6", "--tp", "4")
    assert "layout=fsdp x tp4 ranks=32 tensors=6 chunks=192" in stdout, stdout


@pytest.mark.process
def test_manifest_bench_compares_packed_records_with_the_json_form() -> None:
    stdout = _bench("manifest_bench.py", "--tensors", "300", "--reps", "1")
    assert "manifest of 300 small tensors" in stdout, stdout
    ratios = re.search(r"packed / json: bytes ([0-9.]+)x", stdout)
    assert ratios is not None and float(ratios.group(1)) < 1.0, stdout


def _bench(script: str, *args: str) -> str:
    """The standard output of benchmarks/`script` run with `args`; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only, never a performance bound
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.process
def test_speed_rows_print_beside_the_committed_baseline(results: dict[str, Any]) -> None:
    """Issue 48's shapes run on the primary store and print next to benchmarks/baseline.json."""
    primary = results["meta"]["primary_server"]
    rows = {row["row"]: row for row in bench_report.shape_rows(results)}
    for state in ("large-4x8MiB", "varied-500"):
        for op in ("save", "restore"):
            row = rows[f"{primary}/{state}/{op}"]
            assert row["ratio"] is not None and row["ratio"] > 0, row
    baseline = json.loads((REPO / "benchmarks" / "baseline.json").read_text())
    assert baseline["commit"] and len(baseline["load_before"]) == 3, baseline
    for key, row in baseline["rows"].items():
        assert key.split("/")[1] in ("large-32x8MiB", "varied-20000"), key
        assert row["ratio"] > 0 and row["reps"] >= 5, row
    text = bench_report.render(results)
    assert "SPEED ROWS" in text and "ratio now" in text and "baseline" in text
    assert results["meta"]["spotckpt_files"] == [str(REPO / "spotckpt" / "__init__.py")]
