"""State that differs by rank comes back to the rank that saved it (gloo ranks, local store).

DCP keeps one copy of a non-tensor value per key for the whole job, so a data-loader position,
an RNG stream or an extra that differs by rank must be stored under a per-rank key. Each rank
here saves a sampler seeded by its rank at its own position, its own extras and RNG stream; a
restore on the same world gives each rank its own back; on another world rank r gets saved rank
``r % saved_world``'s, whole; a checkpoint of an earlier release (one copy for the job) still
restores. A DistributedSampler's position carries over on the same world only: on another,
its epoch starts again (each rank now holds another share of it), with a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from dist_worker import launch_ranks, run_ranks


def _read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("per-rank")
    uri = str(out / "ckpt")
    run_ranks(2, "per_rank_state", {"uri": uri, "out": str(out), "mode": "save"})
    return uri, out


@pytest.mark.process
def test_each_rank_gets_its_own_state_back(saved_by_two: tuple[str, Path]) -> None:
    uri, out = saved_by_two
    run_ranks(2, "per_rank_state", {"uri": uri, "out": str(out), "mode": "restore"})
    for rank in range(2):
        saved = _read(out, f"saved-rank{rank}.json")
        restored = _read(out, f"restored-world2-rank{rank}.json")
        assert restored == saved, f"rank {rank}"
    first, second = (_read(out, f"saved-rank{r}.json") for r in range(2))
    assert first["sampler"] != second["sampler"] and first["extra"] != second["extra"]


@pytest.mark.process
def test_each_rank_gets_its_own_state_back_from_compressing_ranks(tmp_path: Path) -> None:
    """Ranks whose objects are written by the compressing writer (headerless, raw values)."""
    uri, out = str(tmp_path / "ckpt"), tmp_path
    for mode in ("save", "restore"):
        args = {"uri": uri, "out": str(out), "mode": mode, "compression": "on"}
        run_ranks(2, "per_rank_state", args)
    assert len(list((tmp_path / "ckpt").rglob("r*-000.zblocks"))) == 2
    for rank in range(2):
        saved = _read(out, f"saved-rank{rank}.json")
        assert _read(out, f"restored-world2-rank{rank}.json") == saved, f"rank {rank}"


@pytest.mark.process
def test_more_ranks_than_saved_refuse_a_sampler_seeded_by_rank(
    saved_by_two: tuple[str, Path],
) -> None:
    """Rank 2 of 3 reads saved rank 0's position: a sampler seeded by rank 2 refuses it."""
    uri, out = saved_by_two
    results = launch_ranks(3, "per_rank_state", {"uri": uri, "out": str(out), "mode": "restore"})
    assert results[2].returncode != 0
    assert "sampler seed 2 differs from the checkpoint's 0" in results[2].stdout


@pytest.mark.process
@pytest.mark.parametrize("world", [1])
def test_another_world_takes_rank_modulo_saved_world(
    saved_by_two: tuple[str, Path], world: int
) -> None:
    uri, out = saved_by_two
    run_ranks(world, "per_rank_state", {"uri": uri, "out": str(out), "mode": "restore"})
    for rank in range(world):
        saved = _read(out, f"saved-rank{rank % 2}.json")
        assert _read(out, f"restored-world{world}-rank{rank}.json") == saved, f"rank {rank}"


@pytest.mark.process
def test_a_checkpoint_with_one_copy_for_the_job_still_restores(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    run_ranks(
        2, "per_rank_state", {"uri": uri, "out": str(tmp_path), "mode": "save", "layout": "legacy"}
    )
    run_ranks(
        2,
        "per_rank_state",
        {"uri": uri, "out": str(tmp_path), "mode": "restore", "layout": "legacy"},
    )
    kept = {_read(tmp_path, f"restored-world2-rank{r}.json")["extra"]["rank_value"] for r in (0, 1)}
    assert len(kept) == 1  # one stored copy, the same on every rank (as that release did)


def _epoch_share(rank: int, world: int) -> list[list[int]]:
    """The batches of 4 that a fresh DistributedSampler deals `rank` of `world` in epoch 1."""
    sampler = DistributedSampler(list(range(40)), num_replicas=world, rank=rank, seed=3)
    sampler.set_epoch(1)
    order = list(sampler)
    return [order[i : i + 4] for i in range(0, len(order), 4)]


@pytest.mark.process
@pytest.mark.parametrize(
    ("saved_world", "world", "taken"),
    [(2, 2, 3), (1, 2, 7), (2, 1, 4)],
    ids=["2to2-carries-over", "1to2-past-the-new-share", "2to1"],
)
def test_a_distributed_sampler_position_carries_over_on_the_same_world_only(
    tmp_path: Path, saved_world: int, world: int, taken: int
) -> None:
    """1 -> 2 with 7 of 10 batches taken: a rank's new share has 5, so the position cannot
    apply (torchdata's fast-forward would run past the end of the epoch)."""
    uri = str(tmp_path / "ckpt")
    args = {"uri": uri, "out": str(tmp_path), "taken": taken}
    run_ranks(saved_world, "distributed_sampler", {**args, "mode": "save"})
    results = launch_ranks(world, "distributed_sampler", {**args, "mode": "restore"})
    for rank, result in enumerate(results):
        assert result.returncode == 0, result.stdout[-4000:]
        rest = _read(tmp_path, f"rest-world{world}-rank{rank}.json")
        if saved_world == world:
            assert rest == _read(tmp_path, f"saved-world{world}-rank{rank}.json")
            assert "starts again" not in result.stdout
        else:
            assert rest == _epoch_share(rank, world)
    if saved_world != world:  # said once for the job, by rank 0
        assert "the cut epoch starts again from its first batch" in results[0].stdout
