"""Moving a run between DCP and spotckpt (issue 50): the peak memory and time of
`spotckpt.dcp_convert.import_dcp` and `export_dcp` against the named alternative, DCP's own
``dcp_to_torch_save`` (which loads the whole checkpoint into memory), on one standard checkpoint.

A checkpoint of ``--tensors`` float32 tensors totalling ``--state-mib`` is written once with DCP's
``FileSystemWriter``. Each measured operation then runs in a child process of its own (so that
its peak resident memory is its own, sampled every millisecond): ``dcp_to_torch_save`` of the
DCP folder,
``import_dcp`` of it into a spotckpt root on the local folder, and ``export_dcp`` of that step back
to a DCP folder. Printed: each operation's seconds and peak RSS above the child's baseline after
imports, and the ratios of the conversions' peaks to ``dcp_to_torch_save``'s, with
``os.getloadavg()``.

    python benchmarks/dcp_convert_bench.py                        # 1 GiB in 16 tensors
    python benchmarks/dcp_convert_bench.py --state-mib 32 --tensors 8   # smoke

Nothing here contacts the network.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 1 << 20


def _rss_mib() -> float:
    """This process's resident memory now (``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / MIB


class _PeakSampler:
    """The highest resident memory seen, sampled every millisecond in a thread: ``ru_maxrss``
    would keep the peak of the imports before the operation."""

    def __init__(self) -> None:
        self.peak = _rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_mib())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_mib())


def child(operation: str, work: str) -> None:
    """One measured operation, in this (child) process: prints its seconds and peak MiB."""
    import warnings

    import torch  # noqa: F401 (imported before the baseline is taken)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from spotckpt.dcp_convert import export_dcp, import_dcp
    from spotckpt.storage import open_store

    warnings.filterwarnings("ignore")
    folder = Path(work)
    baseline = _rss_mib()
    sampler = _PeakSampler()
    started = time.perf_counter()
    if operation == "dcp_to_torch_save":
        dcp_to_torch_save(str(folder / "dcp"), str(folder / "whole.pt"))
    elif operation == "import_dcp":
        import_dcp(open_store(str(folder / "dcp")), open_store(str(folder / "spot")), step=1)
    else:
        export_dcp(open_store(str(folder / "spot")), 1, folder / "exported", overwrite=True)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "peak_mib": sampler.stop() - baseline}))


def measure(operation: str, work: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", operation, str(work)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--state-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("OPERATION", "WORK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    import torch
    import torch.distributed.checkpoint as dcp

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dcp-convert-bench-") as scratch:
        work = Path(scratch)
        numel = args.state_mib * MIB // 4 // args.tensors
        state = {f"layer{i}.weight": torch.full((numel,), float(i)) for i in range(args.tensors)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(work / "dcp")), no_dist=True)
        del state
        figures = {
            name: measure(name, work) for name in ("dcp_to_torch_save", "import_dcp", "export_dcp")
        }
    load_after = os.getloadavg()
    whole = figures["dcp_to_torch_save"]["peak_mib"]
    print(
        f"dcp conversions: {args.state_mib} MiB in {args.tensors} tensors "
        f"({args.state_mib / args.tensors:.0f} MiB each); load average before "
        f"{[round(x, 2) for x in load_before]}, after {[round(x, 2) for x in load_after]}"
    )
    print(f"{'operation':<20} {'seconds':>8} {'peak MiB':>9} {'x dcp_to_torch_save':>20}")
    for name, found in figures.items():
        ratio = found["peak_mib"] / whole if whole > 0 else float("nan")
        print(f"{name:<20} {found['seconds']:>8.2f} {found['peak_mib']:>9.0f} {ratio:>20.2f}")
    if args.json_out is not None:
        args.json_out.write_text(
            json.dumps({"args": vars(args) | {"json_out": str(args.json_out)}, "figures": figures})
        )


if __name__ == "__main__":
    main()
