"""Mirrors with real gloo ranks: an FSDP2 job on 2 ranks (indexed manifests among them) mirrors
its steps; with its own root gone, the job restarts on 3 ranks (resharded) from the mirror, bit
for bit."""

from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from spotckpt import CheckpointManager, TrainState  # noqa: E402
from spotckpt.catalog import Catalog  # noqa: E402
from spotckpt.storage import open_store  # noqa: E402
from spotckpt.verify import verify_checkpoint  # noqa: E402

from dist_worker import fsdp, full_state, launch_ranks, make_model, train  # noqa: E402
from tests_support import assert_equal  # noqa: E402


def _manager(args: dict[str, Any]) -> CheckpointManager:
    return CheckpointManager(
        args["uri"], preemption=False, keep_last=None, mirrors=[args["mirror"]], async_save=True
    )


def save(rank: int, world: int, args: dict[str, Any]) -> None:
    """Train, save steps 2 and 4 (async) with a mirror; record the full state saved at 4."""
    model = fsdp(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = _manager(args)
    for step in (2, 4):
        train(model, optimizer, 2, rank + 10 * step)
        manager.save(step, TrainState(model=model, optimizer=optimizer, rng=False))
        manager.wait()
    saved = full_state(model, optimizer)  # every rank takes part in the gather
    if rank == 0:
        torch.save(saved, Path(args["out"]) / "saved.pt")
    manager.close()


def restore(rank: int, world: int, args: dict[str, Any]) -> None:
    """Restore on `world` ranks (the root gone: from the mirror); record the full state."""
    model = fsdp(make_model())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = _manager(args)
    assert manager.restore(TrainState(model=model, optimizer=optimizer, rng=False)) == 4
    restored = full_state(model, optimizer)
    if rank == 0:
        torch.save(restored, Path(args["out"]) / f"restored-{world}.pt")
        (Path(args["out"]) / "restored-from.txt").write_text(
            str(manager._restorer.last_restore_uri)
        )
    manager.close()


SCENARIOS = {"save": save, "restore": restore}


@pytest.mark.process
@pytest.mark.timeout(400)
@pytest.mark.parametrize("indexed", [False, True], ids=["flat", "indexed"])
def test_a_job_on_two_ranks_resumes_from_its_mirror_on_three(tmp_path: Path, indexed: bool) -> None:
    out = tmp_path / "out"
    out.mkdir()
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    args = {"uri": str(primary), "mirror": str(mirror), "out": str(out), "indexed": indexed}
    for rank, result in enumerate(launch_ranks(2, "save", args, worker=__file__)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    store = open_store(str(mirror))
    assert Catalog(store).steps() == [2, 4]
    assert all(verify_checkpoint(store, step).ok for step in (2, 4))
    shutil.rmtree(primary)  # the region is gone
    primary.mkdir()
    for rank, result in enumerate(launch_ranks(3, "restore", args, worker=__file__)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    assert (out / "restored-from.txt").read_text() == mirror.as_uri()
    # the new root took the mirror's identity: the job goes on as itself
    assert Catalog(open_store(str(primary))).job() == Catalog(store).job()
    saved = torch.load(out / "saved.pt", weights_only=True)
    restored = torch.load(out / "restored-3.pt", weights_only=True)
    assert_equal(restored, saved)


def main() -> None:
    scenario, rank, world, port, raw = sys.argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    args = json.loads(raw)
    if args.get("indexed"):
        import spotckpt.engine.writer

        spotckpt.engine.writer.INDEX_MIN_RANKS = 1
    SCENARIOS[scenario](int(rank), int(world), args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
