"""Tables and targets from the benchmark results (plain data in, text out; no torch here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench_units import S3_METHODS
from ddp_bench import ddp_table, ddp_target

MIB = 1 << 20
GIB = 1 << 30
# What a save may use beyond its parts and staging: the interpreter's and DCP's own allocations
# (plans, metadata, the manifest), thread stacks, and the HTTP client's buffers.
MEMORY_ALLOWANCE = 64 * MIB

S3_ORDER = S3_METHODS
RAW_GETS = ("raw_boto3", "raw_boto3_single")
"""The raw restores; the faster one is the reference ('best raw get')."""
LOCAL_ORDER = ("spotckpt", "dcp_fs", "torch_save_file", "raw_file")


def _index(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {case["id"]: case for case in results["cases"]}


def _ok(case: dict[str, Any] | None) -> bool:
    return bool(case) and case.get("status") == "ok" and bool(case.get("reps"))  # type: ignore[union-attr]


def _median(case: dict[str, Any] | None) -> float | None:
    return float(case["median_s"]) if _ok(case) and case else None


def _gib(case: dict[str, Any]) -> float:
    return max(float(case.get("bytes", 0)), 1.0) / GIB


def _cpu_per_gib(case: dict[str, Any] | None) -> float | None:
    return float(case["cpu_s"]) / _gib(case) if _ok(case) and case else None


def _labels(results: dict[str, Any], group: str) -> list[tuple[str, str]]:
    """(server, state label) pairs of a group, in the order they ran."""
    seen: list[tuple[str, str]] = []
    for case in results["cases"]:
        if case["group"] == group and (case["server"], case["state"]) not in seen:
            seen.append((case["server"], case["state"]))
    return seen


def best_raw_restore(cases: dict[str, dict[str, Any]], base: str) -> dict[str, Any] | None:
    """The faster of the raw restores measured under `base` (parallel ranged GETs, one GET)."""
    measured = [cases[k] for k in (f"{base}/{m}/restore" for m in RAW_GETS) if _ok(cases.get(k))]
    return min(measured, key=lambda case: float(case["median_s"]), default=None)


def _target(
    name: str,
    where: str,
    value: float | None,
    threshold: float,
    passes: Callable[[float], bool],
    detail: str,
) -> dict[str, Any]:
    return {
        "target": name,
        "where": where,
        "value": value,
        "threshold": threshold,
        "pass": None if value is None else bool(passes(value)),
        "detail": detail,
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target's measured value and pass/miss (None: not measured in this run)."""
    cases = _index(results)
    out: list[dict[str, Any]] = []
    for server, state in _labels(results, "s3"):
        base = f"s3/{server}/{state}"
        where = f"{server} {state}"

        def med(method: str, op: str, base: str = base) -> float | None:
            return _median(cases.get(f"{base}/{method}/{op}"))

        def cpu(method: str, op: str, base: str = base) -> float | None:
            return _cpu_per_gib(cases.get(f"{base}/{method}/{op}"))

        spot_save, spot_restore = med("spotckpt", "save"), med("spotckpt", "restore")
        out.append(
            _target(
                "save >= 0.9x raw multipart put",
                where,
                _ratio(med("raw_boto3", "save"), spot_save),
                0.9,
                lambda v: v >= 0.9,
                "raw put time / spotckpt save time",
            )
        )
        out.append(
            _target(
                "save faster than DCP fsspec writer",
                where,
                _ratio(med("dcp_fsspec", "save"), spot_save),
                1.0,
                lambda v: v > 1.0,
                "DCP fsspec save time / spotckpt save time",
            )
        )
        out.append(
            _target(
                "restore >= 0.9x best raw get",
                where,
                _ratio(_median(best_raw_restore(cases, base)), spot_restore),
                0.9,
                lambda v: v >= 0.9,
                "faster raw get (ranged or one GET) time / spotckpt restore time",
            )
        )
        out.append(
            _target(
                "restore >= 10x DCP fsspec reader",
                where,
                _ratio(med("dcp_fsspec", "restore"), spot_restore),
                10.0,
                lambda v: v >= 10.0,
                "DCP fsspec load time / spotckpt restore time",
            )
        )
        out.append(
            _target(
                "CPU/GiB saved <= 1.2x raw put",
                where,
                _ratio(cpu("spotckpt", "save"), cpu("raw_boto3", "save")),
                1.2,
                lambda v: v <= 1.2,
                "spotckpt save CPU s/GiB / raw put CPU s/GiB",
            )
        )
    primary = results["meta"].get("primary_server")
    for server, state in _labels(results, "stall"):
        if server == "memory":
            continue
        stall = _median(cases.get(f"stall/{server}/{state}/spotckpt_async/stall"))
        copy = _median(cases.get(f"stall/memory/{state}/memcpy/copy"))
        blocking = _median(cases.get(f"s3/{server}/{state}/spotckpt/save"))
        where = f"{server} {state}"
        out.append(
            _target(
                "async stall <= 1.5x in-memory copy",
                where,
                _ratio(stall, copy),
                1.5,
                lambda v: v <= 1.5,
                "async save() return time / copy into preallocated buffers",
            )
        )
        out.append(
            _target(
                "async stall <= 0.1x blocking save",
                where,
                _ratio(stall, blocking),
                0.1,
                lambda v: v <= 0.1,
                "async save() return time / blocking save time",
            )
        )
    out.extend(_memory_targets(results, cases, primary))
    out.extend(tier_targets(results))
    if results.get("ddp"):
        out.append(ddp_target(results["ddp"]))
    return out


def memory_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Peak extra memory of spotckpt saves on the primary server, one row per state size."""
    cases = _index(results)
    primary = results["meta"].get("primary_server")
    settings = results["meta"]["settings"]
    parts = (settings["concurrency"] + 1) * settings["part_size"]
    rows = []
    for size in settings["memory_sizes"]:
        label = f"large-{size // GIB}GiB" if size % GIB == 0 else f"large-{size // MIB}MiB"
        measured = f"s3/{primary}/{label}/spotckpt/save" in cases  # a state of the S3 cases
        groups = ("s3", "stall") if measured else ("memory", "memory")
        blocking = cases.get(f"{groups[0]}/{primary}/{label}/spotckpt/save")
        asynchronous = cases.get(f"{groups[1]}/{primary}/{label}/spotckpt_async/stall")
        rows.append(
            {
                "state": label,
                "bytes": size,
                "blocking_peak": blocking.get("peak_extra_bytes") if _ok(blocking) else None,
                "async_peak": asynchronous.get("peak_extra_bytes") if _ok(asynchronous) else None,
                "blocking_bound": parts + MEMORY_ALLOWANCE,
                "async_bound": size + parts + MEMORY_ALLOWANCE,
            }
        )
    return rows


def _memory_targets(
    results: dict[str, Any], cases: dict[str, dict[str, Any]], primary: str | None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if primary is None:
        return out
    for row in memory_rows(results):
        where = f"{primary} {row['state']}"
        for kind in ("blocking", "async"):
            peak, bound = row[f"{kind}_peak"], row[f"{kind}_bound"]
            staging = "state + " if kind == "async" else ""
            out.append(
                _target(
                    f"peak extra memory bounded ({kind} save)",
                    where,
                    None if peak is None else peak / MIB,
                    bound / MIB,
                    lambda v, b=bound: v <= b / MIB,
                    f"MiB; bound = {staging}(concurrency + 1) x part size + "
                    f"{MEMORY_ALLOWANCE // MIB} MiB",
                )
            )
    return out


# The fast tier (tiers_bench) ------------------------------------------------------------------


def _tier_median(part: dict[str, Any], key: str) -> float | None:
    value = part.get("median", {}).get(key) if part.get("status") == "ok" else None
    return None if value is None else float(value)


def _tier_bucket_bytes(part: dict[str, Any]) -> float | None:
    """The most bytes any restore-from-peers repetition read from the bucket (job-wide)."""
    if part.get("status") != "ok" or not part.get("reps"):
        return None
    return float(max(r["peer_restore_sources"]["store"] for r in part["reps"]))


def tier_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 15's targets, from the fast-tier section (none when it did not run)."""
    tiers = results.get("tiers")
    if not tiers:
        return []
    store = tiers["store"]
    out = []
    for part in tiers["parts"]:
        if part["kind"] == "single":
            out.append(
                _target(
                    "fast save >= 0.8x raw local write",
                    f"single process, {_mib(part)}",
                    _ratio(_tier_median(part, "raw_write_s"), _tier_median(part, "fast_save_s")),
                    0.8,
                    lambda v: v >= 0.8,
                    "raw write (no fsync) time / fast save time, same disk and bytes",
                )
            )
            continue
        where = f"{part['redundancy']}, {part['nodes']} nodes"
        out.append(
            _target(
                "one-node loss: restore reads 0 bytes from the bucket",
                where,
                _tier_bucket_bytes(part),
                0.0,
                lambda v: v == 0,
                "bytes the restore from peers read from the bucket (job-wide, most of any rep)",
            )
        )
        out.append(
            _target(
                f"one-node loss: restore >= 2x faster than from {store}",
                where,
                _ratio(
                    _tier_median(part, "bucket_restore_s"), _tier_median(part, "peer_restore_s")
                ),
                2.0,
                lambda v: v >= 2.0,
                f"{store} restore time / restore-from-peers time, same step",
            )
        )
    return out


def _mib(part: dict[str, Any]) -> str:
    return f"{part.get('bytes', 0) / MIB:.1f} MiB"


def _tier_row(
    part: dict[str, Any],
    label: str,
    key: str,
    ratio: tuple[str, str] | None = None,
    ratio_is: str = "",
    notes: str = "",
) -> list[str]:
    """One operation of a fast-tier part: median, spread, GiB/s, and the ratio of the medians
    of `ratio` (numerator key, denominator key)."""
    values = [float(r[key]) for r in part["reps"]]
    median = _tier_median(part, key)
    spread = f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else ""
    value = None if ratio is None else _ratio(*(_tier_median(part, k) for k in ratio))
    return [
        label,
        str(len(values)),
        _fmt(median, 3),
        spread,
        _fmt(_ratio(float(part["bytes"]) / GIB, median), 2),
        _fmt(value, 2, "x"),
        ratio_is if value is not None else "",
        notes,
    ]


def _sources(sources: dict[str, int]) -> str:
    return "local/peer/bucket MiB " + "/".join(
        f"{sources[k] / MIB:.1f}" for k in ("local", "peer", "store")
    )


_TIER_HEADER = ["operation", "n", "median s", "min-max", "GiB/s", "ratio", "ratio is", "notes"]


def _load(part: dict[str, Any]) -> str:
    before, after = part.get("load_before"), part.get("load_after")
    return f"load {before[0]:.1f} -> {after[0]:.1f}" if before and after else "load ?"


def _tier_single_table(part: dict[str, Any], store: str) -> str:
    title = (
        f"FAST TIER, one process, {_mib(part)} in {part.get('tensors', '?')} tensors; bucket "
        f"{store}; local_dir and raw file on the same disk, neither fsynced; {_load(part)}"
    )
    if part["status"] != "ok":
        return f"{title}\n{part['status']}: {part.get('error', '')[-400:]}"
    last = part["reps"][-1]
    fast, restore = ("fast_save_s", "fast_restore_s")
    rows = [
        _tier_row(part, "raw write (one write, no fsync)", "raw_write_s"),
        _tier_row(part, "fast save", fast, ("raw_write_s", fast), "raw write / fast save"),
        _tier_row(
            part, f"save to {store}", "bucket_save_s", ("bucket_save_s", fast), "this / fast save"
        ),
        _tier_row(part, "raw read (page cache)", "raw_read_s"),
        _tier_row(
            part,
            "fast restore",
            restore,
            ("raw_read_s", restore),
            "raw read / fast restore",
            _sources(last["fast_restore_sources"]),
        ),
        _tier_row(
            part,
            f"restore from {store}",
            "bucket_restore_s",
            ("bucket_restore_s", restore),
            "this / fast restore",
            _sources(last["bucket_restore_sources"]),
        ),
        _tier_row(
            part,
            "async fast save: stall",
            "async_stall_s",
            ("async_stall_s", fast),
            "this / blocking fast save",
        ),
        _tier_row(
            part,
            "async fast save: committed",
            "async_done_s",
            ("async_done_s", fast),
            "this / blocking fast save",
        ),
    ]
    return title + "\n" + _table(_TIER_HEADER, rows)


def _tier_nodes_table(part: dict[str, Any], store: str) -> str:
    title = (
        f"FAST TIER, {part['redundancy']} on {part['nodes']} nodes x 1 rank (gloo, this "
        f"machine), {_mib(part)} in all; {part['lost_node']} killed and its folder deleted; "
        f"bucket {store}; {_load(part)}"
    )
    if part["status"] != "ok":
        return f"{title}\n{part['status']}: {part.get('error', '')[-400:]}"
    last = part["reps"][-1]
    peers, bucket = "peer_restore_s", "bucket_restore_s"
    rows = [
        _tier_row(part, "fast save", "fast_save_s"),
        _tier_row(
            part,
            f"save to {store}",
            "bucket_save_s",
            ("bucket_save_s", "fast_save_s"),
            "this / fast save",
        ),
        _tier_row(
            part,
            "restore after the loss, from peers",
            peers,
            (bucket, peers),
            f"{store} restore / this",
            _sources(last["peer_restore_sources"]),
        ),
        _tier_row(
            part,
            f"restore of the same step from {store}",
            bucket,
            None,
            "",
            _sources(last["bucket_restore_sources"]),
        ),
    ]
    return title + "\n" + _table(_TIER_HEADER, rows)


def _tier_tables(results: dict[str, Any]) -> list[str]:
    tiers = results.get("tiers")
    if not tiers:
        return []
    tables = []
    for part in tiers["parts"]:
        draw = _tier_single_table if part["kind"] == "single" else _tier_nodes_table
        tables.append(draw(part, tiers["store"]))
    return tables


# Rendering -------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def _case_row(case: dict[str, Any] | None, label: str, ref: dict[str, Any] | None) -> list[str]:
    if case is None:
        return [label, "-", "-", "-", "-", "-", "-", "-", "-", ""]
    if not _ok(case):
        status = case.get("status", "?")
        return [label, status, "", "", "", "", "", "", "", str(case.get("error", ""))[:80]]
    median = float(case["median_s"])
    ref_median = _median(ref)
    cpu = _cpu_per_gib(case)
    ref_cpu = _cpu_per_gib(ref)
    spread = f"{case['min_s']:.2f}-{case['max_s']:.2f}" if len(case["reps"]) > 1 else ""
    notes = []
    info = case["reps"][-1].get("info", {}) if case["reps"] else {}
    if "read_ratio" in info:
        notes.append(f"read {info['read_ratio']:.2f}x needed, {info.get('requests', '?')} GETs")
    return [
        label,
        str(len(case["reps"])),
        f"{median:.2f}",
        spread,
        f"{_gib(case) / median:.3f}",
        _fmt(_ratio(ref_median, median), 2, "x"),
        _fmt(cpu, 2),
        _fmt(_ratio(cpu, ref_cpu), 2, "x"),
        f"{case['peak_extra_bytes'] / MIB:.0f}",
        "; ".join(notes),
    ]


_HEADER = [
    "case",
    "n",
    "median s",
    "min-max",
    "GiB/s",
    "vs raw",
    "CPU s/GiB",
    "CPU vs raw",
    "peak +MiB",
    "notes",
]


def _group_tables(
    results: dict[str, Any], group: str, order: tuple[str, ...], raw: str
) -> list[str]:
    cases = _index(results)
    parts = []
    for server, state in _labels(results, group):
        base = f"{group}/{server}/{state}"
        any_case = next((c for c in results["cases"] if c["id"].startswith(base + "/")), {})
        size = any_case.get("bytes")
        tensors = any_case.get("tensors")
        title = f"{group.upper()} {server}, state {state}"
        if size:
            title += f" ({size / MIB:.1f} MiB in {tensors} tensors)"
        rows = []
        for op in ("save", "restore"):
            ref = cases.get(f"{base}/{raw}/{op}")
            if op == "restore" and group in ("s3", "shapes"):
                ref = best_raw_restore(cases, base)
            for method in order:
                case = cases.get(f"{base}/{method}/{op}")
                if case is not None:
                    rows.append(_case_row(case, f"{method} {op}", ref))
        parts.append(title + "\n" + _table(_HEADER, rows))
    return parts


def shape_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 48's speed rows: spotckpt's save against the raw multipart put and its restore
    against the best raw get, on each `shapes` state (ratio = raw median / spotckpt median)."""
    cases = _index(results)
    rows = []
    for server, state in _labels(results, "shapes"):
        base = f"shapes/{server}/{state}"
        for op in ("save", "restore"):
            spot = cases.get(f"{base}/spotckpt/{op}")
            ref = (
                best_raw_restore(cases, base)
                if op == "restore"
                else cases.get(f"{base}/raw_boto3/save")
            )
            if spot is None:
                continue
            rows.append(
                {
                    "row": f"{server}/{state}/{op}",
                    "versus": "best raw get" if op == "restore" else "raw multipart put",
                    "raw_method": ref["method"] if ref else None,
                    "bytes": spot.get("bytes"),
                    "tensors": spot.get("tensors"),
                    "reps": len(spot.get("reps", [])),
                    "spotckpt_s": _median(spot),
                    "spotckpt_min_s": spot.get("min_s"),
                    "spotckpt_max_s": spot.get("max_s"),
                    "raw_s": _median(ref),
                    "ratio": _ratio(_median(ref), _median(spot)),
                    "loadavg_after": spot.get("loadavg_after"),
                }
            )
    return rows


def _shape_table(results: dict[str, Any]) -> str | None:
    """The speed rows beside the committed baseline: ratio now | baseline | delta."""
    rows = shape_rows(results)
    if not rows:
        return None
    baseline = results.get("baseline") or {}
    known = baseline.get("rows", {})
    body = []
    for row in rows:
        then = known.get(row["row"], {}).get("ratio")
        now = row["ratio"]
        delta = (
            "-" if now is None or then is None else f"{now - then:+.2f}x ({now / then - 1:+.0%})"
        )
        size = f"{(row['bytes'] or 0) / MIB:.1f} MiB in {row['tensors']}"
        load = row["loadavg_after"]
        body.append(
            [
                row["row"],
                size,
                row["versus"],
                str(row["reps"]),
                _fmt(row["spotckpt_s"], 3),
                _fmt(row["raw_s"], 3),
                _fmt(now, 2, "x"),
                _fmt(then, 2, "x") if then is not None else "- (no row at this size)",
                delta,
                _fmt(load[0] if load else None, 2),
            ]
        )
    header = [
        "row",
        "state",
        "vs",
        "n",
        "spotckpt s",
        "raw s",
        "ratio now",
        "baseline",
        "delta",
        "load",
    ]
    if baseline:
        loads = "/".join(f"{x:.1f}" for x in baseline.get("load_before", [])[:1])
        loads += " -> " + "/".join(f"{x:.1f}" for x in baseline.get("load_after", [])[:1])
        source = (
            f"baseline {baseline.get('path')}: commit {str(baseline.get('commit'))[:9]}, "
            f"run {baseline.get('run_id')}, {baseline.get('settings', {}).get('reps')} reps, "
            f"load {loads}"
        )
    else:
        source = "no baseline file"
    return (
        "SPEED ROWS (issue 48's shapes; ratio = raw median / spotckpt median; load = 1-min "
        f"load average after the case)\n{source}\n" + _table(header, body)
    )


def _stall_table(results: dict[str, Any]) -> str | None:
    cases = _index(results)
    rows = []
    for server, state in _labels(results, "stall"):
        if server == "memory":
            continue
        stall = cases.get(f"stall/{server}/{state}/spotckpt_async/stall")
        copy = cases.get(f"stall/memory/{state}/memcpy/copy")
        blocking = cases.get(f"s3/{server}/{state}/spotckpt/save")
        complete = None
        if _ok(stall) and stall:
            completes = sorted(r["info"].get("complete_s", 0.0) for r in stall["reps"])
            complete = completes[len(completes) // 2]
        rows.append(
            [
                f"{server} {state}",
                _fmt(_median(stall), 3),
                _fmt(complete, 2),
                _fmt(_median(blocking), 2),
                _fmt(_median(copy), 3),
                _fmt(_ratio(_median(stall), _median(copy)), 2, "x"),
                _fmt(_ratio(_median(stall), _median(blocking)), 3, "x"),
                _fmt(stall["peak_extra_bytes"] / MIB if _ok(stall) and stall else None, 0),
            ]
        )
    if not rows:
        return None
    header = [
        "store, state",
        "async stall s",
        "async done s",
        "blocking s",
        "memcpy s",
        "stall/memcpy",
        "stall/blocking",
        "async peak +MiB",
    ]
    return "TRAINING-LOOP STALL (async save returns after staging)\n" + _table(header, rows)


def _memory_table(results: dict[str, Any]) -> str | None:
    rows = memory_rows(results)
    if not rows or results["meta"].get("primary_server") is None:
        return None
    body = [
        [
            r["state"],
            _fmt(None if r["blocking_peak"] is None else r["blocking_peak"] / MIB, 0),
            _fmt(r["blocking_bound"] / MIB, 0),
            _fmt(None if r["async_peak"] is None else r["async_peak"] / MIB, 0),
            _fmt(r["async_bound"] / MIB, 0),
        ]
        for r in rows
    ]
    header = ["state", "blocking +MiB", "bound", "async +MiB", "bound"]
    settings = results["meta"]["settings"]
    return (
        f"PEAK EXTRA MEMORY of spotckpt saves on {results['meta']['primary_server']} "
        f"(part {settings['part_size'] // MIB} MiB x {settings['concurrency']} in flight)\n"
        + _table(header, body)
    )


def _targets_table(results: dict[str, Any]) -> str:
    rows = []
    for t in results.get("targets", []):
        verdict = {True: "pass", False: "MISS", None: "n/a"}[t["pass"]]
        rows.append(
            [
                t["target"],
                t["where"],
                _fmt(t["value"], 3),
                _fmt(t["threshold"], 2),
                verdict,
                t["detail"],
            ]
        )
    header = ["target", "where", "value", "threshold", "result", "value is"]
    return "TARGETS\n" + _table(header, rows)


def render(results: dict[str, Any]) -> str:
    """The whole printed report."""
    meta = results["meta"]
    lines = [
        "",
        "=" * 100,
        f"spotckpt benchmarks {meta['run_id']}{' (quick)' if meta['quick'] else ''}: "
        f"{meta['cpus']} CPUs, load {meta['load_before'][0]:.1f} -> {meta['load_after'][0]:.1f}, "
        f"{meta['duration_s'] / 60:.1f} min",
        "versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "servers: "
        + ", ".join(f"{k} {v}" for k, v in meta["servers"].items())
        + (f" (restarts: {meta['server_restarts']})" if meta.get("server_restarts") else ""),
    ]
    if meta.get("spotckpt_files"):
        tree = meta.get("tree", {})
        lines.append(
            f"spotckpt imported from {', '.join(meta['spotckpt_files'])} (tree {tree.get('path')}"
            f"{', commit ' + tree['commit'][:9] if tree.get('commit') else ''}"
            f"{', modified' if tree.get('modified') else ''})"
        )
    lines += [f"note: {n}" for n in meta.get("notes", [])]
    skipped = {
        c["method"]: c.get("error", "")
        for c in results["cases"]
        if c.get("status") == "skipped" and c["op"] == "save"
    }
    lines += [f"note: {m} skipped: {why}" for m, why in skipped.items()]
    reached = [c for c in results["cases"] if c["method"] == "s3torchconnector" and _ok(c)]
    if reached:
        lines.append(
            f"note: s3torchconnector {meta['versions'].get('s3torchconnector', '?')} reached the "
            "plain-HTTP loopback endpoints (AWS_ENDPOINT_URL, path-style addressing)"
        )
    lines.append(
        "medians over repetitions; 'vs raw' = raw time / case time (1.00x = as fast as the raw "
        "transfer of the same bytes); CPU = client process user+system seconds per GiB; "
        "peak +MiB = peak RSS above the RSS before the operation"
    )
    sections = _group_tables(results, "s3", S3_ORDER, "raw_boto3")
    sections += _group_tables(results, "shapes", S3_ORDER, "raw_boto3")
    sections += _group_tables(results, "local", LOCAL_ORDER, "raw_file")
    for extra in (_stall_table(results), _memory_table(results)):
        if extra:
            sections.append(extra)
    speed = _shape_table(results)
    if speed:
        sections.append(speed)
    sections += _tier_tables(results)
    if results.get("ddp"):
        sections.append(ddp_table(results["ddp"]))
    sections.append(_targets_table(results))
    return "\n".join(lines) + "\n\n" + "\n\n".join(sections) + "\n"
