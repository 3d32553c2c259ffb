"""Randomness drawn in `Dataset.__getitem__` inside DataLoader workers survives a mid-epoch resume.

Each end-to-end case runs this file as a script twice: once uninterrupted (saving a checkpoint
mid-epoch on the way, which must not disturb the run), once in a fresh process that restores that
checkpoint and continues. With `SeededDataset` the continuation is bit-identical to the rest of
the uninterrupted run; without it (the controls) the positions match but the drawn values differ.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

from spotckpt import (
    CheckpointManager,
    ResumableSampler,
    SampleKey,
    SeededDataset,
    TrainState,
    sample_seed,
    track_batches,
)
from spotckpt.state import find_resumable_sampler

LENGTH = 22  # batches of 4: five full and one of 2 per epoch
BATCH = 4
SAVE_AT = 8  # mid-epoch 1
TOTAL = 16  # into epoch 2


class Noisy(Dataset[torch.Tensor]):
    """Each sample: its index, then one draw each from torch, Python's random and NumPy."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int) -> torch.Tensor:
        draws = [float(index), torch.rand(()).item(), random.random(), float(np.random.rand())]
        return torch.tensor(draws, dtype=torch.float64)


# The child process ------------------------------------------------------------------------------


def _loader(kind: str, workers: int, seeded: bool) -> tuple[Any, Dataset[torch.Tensor]]:
    dataset: Dataset[torch.Tensor] = SeededDataset(Noisy(), seed=11) if seeded else Noisy()
    generator = torch.Generator().manual_seed(0)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader: Any = StatefulDataLoader(
            dataset, batch_size=BATCH, shuffle=True, num_workers=workers, generator=generator
        )
    elif kind == "batch-sampler":
        batches = BatchSampler(ResumableSampler(LENGTH, seed=5), BATCH, drop_last=False)
        loader = DataLoader(
            dataset, batch_sampler=batches, num_workers=workers, generator=generator
        )
    else:
        sampler = ResumableSampler(LENGTH, seed=5)
        loader = DataLoader(
            dataset, batch_size=BATCH, sampler=sampler, num_workers=workers, generator=generator
        )
    return loader, dataset


def _epochs(loader: Any, dataset: Any, extra: dict[str, Any]) -> Iterator[torch.Tensor]:
    """Batches forever; a StatefulDataLoader's epoch is kept in `extra`, which is checkpointed."""
    while True:
        if find_resumable_sampler(loader) is not None:
            yield from track_batches(loader)
            continue
        if isinstance(dataset, SeededDataset):
            dataset.set_epoch(extra["epoch"])
        yield from loader
        extra["epoch"] += 1


def child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["reference", "resume"])
    parser.add_argument("--kind", default="sampler")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    loader, dataset = _loader(args.kind, args.workers, seeded=not args.plain)
    extra: dict[str, Any] = {"epoch": 0}
    state = TrainState(dataloader=loader, extra=extra)
    manager = CheckpointManager(args.ckpt, preemption=False)
    done = 0
    if args.mode == "resume":
        if manager.restore(state) != 1:
            raise SystemExit("no checkpoint of step 1")
        done = SAVE_AT
    batches: list[list[list[str]]] = []
    main_draws: list[str] = []  # the trainer's own randomness (dropout, ...) between batches
    for batch in _epochs(loader, dataset, extra):
        batches.append([[v.hex() for v in row] for row in batch.tolist()])
        main_draws.append(torch.rand(()).item().hex())
        done += 1
        if args.mode == "reference" and done == SAVE_AT:
            manager.save(1, state)
        if done == TOTAL:
            break
    manager.close()
    args.out.write_text(json.dumps({"batches": batches, "main": main_draws}))


# The tests --------------------------------------------------------------------------------------


def _run(tmp_path: Path, mode: str, *options: str) -> dict[str, Any]:
    out = tmp_path / f"{mode}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    command = [sys.executable, __file__, mode, "--ckpt", str(tmp_path / "ck"), "--out", str(out)]
    result = subprocess.run(
        [*command, *options], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


def _interrupted(tmp_path: Path, *options: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The uninterrupted run, and the run resumed from its checkpoint after batch SAVE_AT."""
    reference = _run(tmp_path, "reference", *options)
    resumed = _run(tmp_path, "resume", *options)
    assert len(reference["batches"]) == TOTAL and len(resumed["batches"]) == TOTAL - SAVE_AT
    return reference, resumed


def _indices(batches: list[list[list[str]]]) -> list[list[str]]:
    return [[row[0] for row in batch] for batch in batches]


@pytest.mark.process
@pytest.mark.parametrize(
    ("kind", "workers"),
    [
        ("sampler", 0),
        ("sampler", 1),
        ("sampler", 2),
        ("batch-sampler", 2),
        ("stateful", 2),
    ],
)
def test_seeded_samples_resume_bit_exactly(tmp_path: Path, kind: str, workers: int) -> None:
    reference, resumed = _interrupted(tmp_path, "--kind", kind, "--workers", str(workers))
    assert resumed["batches"] == reference["batches"][SAVE_AT:]
    assert resumed["main"] == reference["main"][SAVE_AT:]
    rows = [row for batch in reference["batches"] for row in batch]
    assert len({tuple(row[1:]) for row in rows}) == len(rows)  # no draw repeats across epochs


@pytest.mark.process
@pytest.mark.parametrize(("kind", "workers"), [("sampler", 1), ("sampler", 2), ("stateful", 2)])
def test_plain_workers_draw_other_values_after_resume(
    tmp_path: Path, kind: str, workers: int
) -> None:
    reference, resumed = _interrupted(
        tmp_path, "--kind", kind, "--workers", str(workers), "--plain"
    )
    tail = reference["batches"][SAVE_AT:]
    assert _indices(resumed["batches"]) == _indices(tail)  # the position is right
    assert resumed["batches"] != tail  # but the workers' streams started over


def _main_stream(sample: Any) -> list[float]:
    torch.manual_seed(4)
    random.seed(5)
    np.random.seed(6)
    drawn = []
    for index in range(6):
        sample(index)
        drawn.extend([torch.rand(()).item(), random.random(), float(np.random.rand())])
    return drawn


def test_main_process_sampling_leaves_the_main_rng_streams_alone() -> None:
    seeded = SeededDataset(Noisy(), seed=11)
    loader = DataLoader(seeded, batch_size=2, sampler=ResumableSampler(LENGTH, seed=5))
    batches = iter(loader)
    untouched = _main_stream(lambda index: None)
    assert _main_stream(lambda index: seeded[SampleKey(index, 0)]) == untouched
    assert _main_stream(lambda index: next(batches)) == untouched
    assert _main_stream(Noisy().__getitem__) != untouched  # the unwrapped dataset does draw


def test_sample_randomness_depends_on_seed_epoch_and_index_only() -> None:
    seeded = SeededDataset(Noisy(), seed=11)
    first = seeded[SampleKey(5, 1)]
    torch.manual_seed(99)
    assert torch.equal(seeded[SampleKey(5, 1)], first)
    assert torch.equal(SeededDataset(Noisy(), seed=11)[SampleKey(5, 1)], first)
    for other in (seeded[SampleKey(5, 2)], seeded[SampleKey(6, 1)]):
        assert not torch.equal(other[1:], first[1:])
    assert not torch.equal(SeededDataset(Noisy(), seed=12)[SampleKey(5, 1)][1:], first[1:])
    seeded.set_epoch(1)  # plain-int keys take the epoch from set_epoch
    assert torch.equal(seeded[5], first)
    assert len(seeded) == LENGTH


def test_sample_key_is_an_int_that_pickles_with_its_epoch() -> None:
    key = SampleKey(3, epoch=7)
    copy = pickle.loads(pickle.dumps(key))
    assert isinstance(copy, SampleKey) and copy == 3 and copy.epoch == 7
    assert ["a", "b", "c", "d"][key] == "d" and torch.arange(10)[key].item() == 3
    sampler = ResumableSampler(4, seed=0)
    sampler.epoch = 2
    assert [k.epoch for k in sampler] == [2, 2, 2, 2] and sorted(sampler) == [0, 1, 2, 3]


def test_sample_seed_is_stable_across_processes_and_releases() -> None:
    # Pinned: a checkpoint resumed by a later spotckpt must reproduce the same augmentations.
    assert sample_seed(0, 0, 0) == 4671193281044106355
    assert sample_seed(1, 2, 3) == 14438927015193581811
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, SampleKey(3, 9))
    assert 0 <= sample_seed(-5, 10**6, 2**40) < 2**64


if __name__ == "__main__":
    child(sys.argv[1:])
