"""Issue 48's speed rows for two checkouts, interleaved: is the new one no slower?

    python benchmarks/compare.py /tmp/old-checkout                 # old tree against this one
    python benchmarks/compare.py /tmp/old --new /work/other --reps 5 --varied-count 20000
    python benchmarks/compare.py /tmp/old --quick                  # small sizes: a smoke run

Runs `run.py --only 'shapes/*' --reps 1 --tree TREE` once per tree and repetition, alternating
old, new, old, new, ..., so that load that comes and goes hits both trees alike; the measuring
code is this checkout's `benchmarks/` for both, only the imported spotckpt package differs (each
run checks that its children imported the tree's package). Each run measures its own raw put
and gets, so every repetition gives one ratio per row (raw time / spotckpt time). Per row it
prints the median ratio of each tree, their spread (min-max), and the verdict: "no slower" when
the new median >= the old median - max(5 % of the old median, the larger of the two spreads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_report import shape_rows  # noqa: E402

RUN = HERE / "run.py"
RELATIVE_TOLERANCE = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the checkout before the change")
    parser.add_argument(
        "--new", type=Path, default=HERE.parent, help="the checkout after it (default: this one)"
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions per tree (5)")
    parser.add_argument("--quick", action="store_true", help="run.py's --quick sizes")
    parser.add_argument("--mid-tensors", type=int, help="run.py --mid-tensors (8 MiB tensors)")
    parser.add_argument(
        "--varied-count",
        type=int,
        default=5000,
        help="run.py --varied-count: tensors of 1-256 KiB (5000, 224 MiB; 20000 is the full shape)",
    )
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="run.py's")
    parser.add_argument("--json-out", type=Path, help="write every run's rows and the verdicts")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def _loadavg() -> str:
    with open("/proc/loadavg", encoding="ascii") as file:
        return " ".join(file.read().split()[:3])


def run_once(args: argparse.Namespace, tree: Path, scratch: Path, name: str) -> dict[str, Any]:
    """One run.py run of the speed rows against `tree`; its JSON results."""
    json_out = scratch / f"{name}.json"
    command = [
        sys.executable,
        str(RUN),
        "--only",
        "shapes/*",
        "--servers",
        "weed",
        "--reps",
        "1",
        "--tree",
        str(tree),
        "--json-out",
        str(json_out),
        "--results-dir",
        str(scratch / "results"),
        "--workdir",
        str(scratch / "work"),
        "--timeout-scale",
        str(args.timeout_scale),
    ]
    if args.quick:
        command.append("--quick")
    if args.mid_tensors:
        command += ["--mid-tensors", str(args.mid_tensors)]
    if not args.quick:
        command += ["--varied-count", str(args.varied_count)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not json_out.exists():
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-4000:])
        raise SystemExit(f"{name}: run.py exited with {proc.returncode}")
    results: dict[str, Any] = json.loads(json_out.read_text())
    return results


def summary(ratios: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "spread": max(ratios) - min(ratios),
    }


def verdict(old: dict[str, float], new: dict[str, float]) -> tuple[float, bool]:
    """The tolerance, and whether the new tree is no slower within it."""
    tolerance = max(RELATIVE_TOLERANCE * old["median"], old["spread"], new["spread"])
    return tolerance, new["median"] >= old["median"] - tolerance


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    ratios: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    runs: list[dict[str, Any]] = []
    began = time.monotonic()
    print(f"old {trees['old']}\nnew {trees['new']}\nload {_loadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="spotckpt-compare-") as folder:
        scratch = Path(folder)
        for rep in range(args.reps):
            for label, tree in trees.items():
                load_before = _loadavg()
                results = run_once(args, tree, scratch, f"{label}-{rep}")
                rows = shape_rows(results)
                files = results["meta"]["spotckpt_files"]
                for row in rows:
                    if row["ratio"] is None:
                        raise SystemExit(f"{label} rep {rep}: {row['row']} did not complete")
                    ratios[label].setdefault(row["row"], []).append(row["ratio"])
                runs.append(
                    {"tree": label, "rep": rep, "load": [load_before, _loadavg()], "rows": rows}
                )
                shown = "  ".join(f"{r['row']} {r['ratio']:.2f}x" for r in rows)
                print(
                    f"rep {rep + 1}/{args.reps} {label} ({', '.join(files)}): {shown}  "
                    f"load {load_before} -> {_loadavg()}",
                    flush=True,
                )
    verdicts = []
    for row, old_ratios in ratios["old"].items():
        old, new = summary(old_ratios), summary(ratios["new"].get(row, [float("nan")]))
        tolerance, ok = verdict(old, new)
        verdicts.append(
            {"row": row, "old": old, "new": new, "tolerance": tolerance, "no_slower": ok}
        )
    header = f"{'row':<28} {'old median':>10} {'old min-max':>12} {'new median':>10} "
    header += f"{'new min-max':>12} {'tolerance':>9}  verdict"
    lines = [
        "",
        f"SPEED ROWS, old vs new, {args.reps} interleaved repetitions each "
        f"({(time.monotonic() - began) / 60:.1f} min; load now {_loadavg()})",
        header,
    ]
    for v in verdicts:
        old, new = v["old"], v["new"]
        old_range = f"{old['min']:.2f}-{old['max']:.2f}x"
        new_range = f"{new['min']:.2f}-{new['max']:.2f}x"
        lines.append(
            f"{v['row']:<28} {old['median']:>9.2f}x {old_range:>12} {new['median']:>9.2f}x "
            f"{new_range:>12} {v['tolerance']:>8.2f}x  "
            f"{'no slower' if v['no_slower'] else 'SLOWER'}"
        )
    print("\n".join(lines), flush=True)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        data = {"trees": {k: str(v) for k, v in trees.items()}, "runs": runs, "verdicts": verdicts}
        args.json_out.write_text(json.dumps(data, indent=1) + "\n")
    return 0 if all(v["no_slower"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
