"""Data loaders resume the cut epoch exactly: same batches, same global RNG stream afterwards.

Each case runs a loader for four epochs, drawing from the global torch RNG after every batch
(as dropout does), and compares it with a run cut after `stop` batches: state saved, a new
loader (as a restarted process builds it) given the saved loader state and global RNG, and run
to the end. Real torchdata loaders, with 0 and 2 worker processes. Without spotckpt's record
(`spotckpt.loader_rng`) these set-ups diverge; the control test shows that they do.
"""

from __future__ import annotations

import gc
import io
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from spotckpt import ResumableSampler, track_batches
from spotckpt.loader_rng import RECORD_KEY, loader_randomness
from spotckpt.state import DataLoaderState
from spotckpt.values import ValueLoadError

SAMPLES, BATCH, EPOCHS = 10, 2, 4
PER_EPOCH = SAMPLES // BATCH
KINDS = ["shuffle-gen", "shuffle-nogen", "torch-sampler-gen", "torch-sampler-two-gens", "sharded"]
STOPS = [3, PER_EPOCH, 8, 12, PER_EPOCH * 3]  # mid-epoch, epoch ends, later epochs
SHARDS = 2
"""``sharded``: Accelerate's ``BatchSamplerShard`` (its loader on one of 2 processes) around a
torch ``RandomSampler(generator=)``: the generator is two wrappers deep, and the shard's index
stream starts (and the permutation is drawn) only at the first batch."""
SHARDED_PER_EPOCH = -(-PER_EPOCH // SHARDS)  # the shard wraps around to even the processes
SHARDED_STOPS = [2, SHARDED_PER_EPOCH, 5, 7, SHARDED_PER_EPOCH * 3]


def per_epoch(kind: str) -> int:
    return SHARDED_PER_EPOCH if kind == "sharded" else PER_EPOCH


def stops(kind: str) -> list[int]:
    return SHARDED_STOPS if kind == "sharded" else STOPS


def make(kind: str, workers: int) -> StatefulDataLoader:
    """A loader as a user builds it; the global seed is set first, as a training script does."""
    torch.manual_seed(123)
    data = list(range(SAMPLES))
    options: dict[str, Any] = {"batch_size": BATCH, "num_workers": workers}
    if kind == "shuffle-gen":
        return StatefulDataLoader(data, shuffle=True, generator=seeded(5), **options)
    if kind == "shuffle-nogen":
        return StatefulDataLoader(data, shuffle=True, **options)
    sampler = RandomSampler(data, generator=seeded(5))
    if kind == "sharded":
        from accelerate.data_loader import BatchSamplerShard

        batches = BatchSampler(sampler, BATCH, drop_last=False)
        shard = BatchSamplerShard(batches, num_processes=SHARDS, process_index=1)
        return StatefulDataLoader(data, batch_sampler=shard, num_workers=workers)
    if kind == "torch-sampler-gen":
        return StatefulDataLoader(data, sampler=sampler, **options)
    return StatefulDataLoader(data, sampler=sampler, generator=seeded(7), **options)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


Trace = list[tuple[int, list[int], float]]


def run(loader: Any, epochs: range, trace: Trace, stop: int | None = None) -> Any:
    """Iterate `epochs`, one global draw per batch; at `stop` batches return the saved state."""
    for epoch in epochs:
        for batch in loader:
            trace.append((epoch, batch.tolist(), torch.rand(1).item()))
            if stop is not None and len(trace) == stop:
                return loader.state_dict(), torch.get_rng_state()
    return None


def cut_and_resume(kind: str, workers: int, stop: int, hooked: bool) -> tuple[Trace, Trace]:
    reference: Trace = []
    run(fresh(kind, workers, hooked), range(EPOCHS), reference)
    resumed: Trace = []
    saved, rng = run(fresh(kind, workers, hooked), range(EPOCHS), resumed, stop)
    loader = fresh(kind, workers, hooked)
    loader.load_state_dict(saved)
    torch.set_rng_state(rng)
    # The loop finishes the cut epoch first (nothing is left of it when cut at its end).
    run(loader, range((stop - 1) // per_epoch(kind), EPOCHS), resumed)
    return reference, resumed


def fresh(kind: str, workers: int, hooked: bool) -> StatefulDataLoader:
    """A new loader, made after a garbage collection: the iterators of the runs before (one cut
    mid-epoch holds its workers in a reference cycle) must not be left for a forked worker's
    collector, whose finalizers then import during the worker's first import (numpy.random)
    and break it with a KeyError in importlib's module lock (Python 3.11). Whether that happens
    depended on the allocation counts of whatever the process imported before."""
    gc.collect()
    return hook(make(kind, workers), hooked)


def hook(loader: StatefulDataLoader, hooked: bool) -> StatefulDataLoader:
    if hooked:
        loader_randomness(loader)
    return loader


def _cut_points() -> list[Any]:
    """Every kind at every stop without workers; with 2 workers, a covering in the default run
    (each kind at two stops, each stop met) and the rest of the product marked slow."""
    cases = []
    for index, kind in enumerate(KINDS):
        points = stops(kind)
        covered = {points[index % len(points)], points[(index + len(KINDS)) % len(points)]}
        for stop in points:
            cases.append(pytest.param(kind, 0, stop, id=f"{kind}-0-{stop}"))
            marks = () if stop in covered else (pytest.mark.slow,)
            cases.append(pytest.param(kind, 2, stop, id=f"{kind}-2-{stop}", marks=marks))
    return cases


@pytest.mark.process
@pytest.mark.parametrize(("kind", "workers", "stop"), _cut_points())
def test_resumed_epoch_matches(kind: str, workers: int, stop: int) -> None:
    reference, resumed = cut_and_resume(kind, workers, stop, hooked=True)
    assert [r[:2] for r in resumed] == [r[:2] for r in reference]  # the same batches
    assert resumed == reference  # and the same global draws after each


@pytest.mark.parametrize("kind", KINDS)
def test_without_the_record_these_loaders_diverge(kind: str) -> None:
    diverged = [
        stop for stop in stops(kind) if len(set(map(str, cut_and_resume(kind, 0, stop, False)))) > 1
    ]
    assert diverged, f"{kind}: expected plain torchdata to diverge somewhere"


def test_state_dict_carries_the_record_and_load_takes_it_out() -> None:
    loader = make("torch-sampler-gen", 0)
    loader_randomness(loader)
    assert loader_randomness(loader) is loader_randomness(loader)  # installed once
    iterator = iter(loader)
    next(iterator)
    saved = loader.state_dict()
    record = torch.load(io.BytesIO(saved[RECORD_KEY]), weights_only=True)
    assert set(record["epoch_start"]) == {"sampler", "global"}
    assert set(record["now"]) == {"sampler"}
    fresh = make("torch-sampler-gen", 0)
    loader_randomness(fresh)
    fresh.load_state_dict(saved)
    assert RECORD_KEY not in (fresh.next_iter_state or {})  # torchdata never sees it


def test_a_save_before_any_iterator_restores_the_generators_at_once() -> None:
    loader = make("torch-sampler-gen", 0)
    randomness = loader_randomness(loader)
    loader.sampler.generator.manual_seed(99)
    record = randomness.state()
    assert torch.load(io.BytesIO(record), weights_only=True)["epoch_start"] == {}
    fresh = make("torch-sampler-gen", 0)
    loader_randomness(fresh).restore(record)
    assert torch.equal(fresh.sampler.generator.get_state(), seeded(99).get_state())


@pytest.mark.process
@pytest.mark.parametrize("stop", [3, PER_EPOCH, 12])
@pytest.mark.parametrize("workers", [0, 2])
def test_resumable_sampler_without_generator_keeps_the_global_stream(
    workers: int, stop: int
) -> None:
    """A plain DataLoader's iterator draws its base seed from the global RNG (no generator=)."""

    def build() -> tuple[DataLoader, DataLoaderState]:
        torch.manual_seed(123)
        sampler = ResumableSampler(SAMPLES, seed=3)
        data = list(range(SAMPLES))
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=workers)
        return loader, DataLoaderState(loader, sampler)

    def steps(loader: DataLoader, trace: Trace, epochs: int, stop: int | None = None) -> Any:
        for epoch in range(epochs):
            for batch in track_batches(loader):
                trace.append((epoch, batch.tolist(), torch.rand(1).item()))
                if len(trace) == stop:
                    return
        return

    reference: Trace = []
    steps(build()[0], reference, EPOCHS)
    resumed: Trace = []
    loader, adapter = build()
    steps(loader, resumed, EPOCHS, stop)
    saved, rng = adapter.state_dict(), torch.get_rng_state()
    loader, adapter = build()
    adapter.load_state_dict(saved)
    torch.set_rng_state(rng)
    steps(loader, resumed, EPOCHS - (stop - 1) // PER_EPOCH)
    assert [r[1:] for r in resumed] == [r[1:] for r in reference]


@pytest.mark.parametrize(
    "record",
    [b"", b"not a torch file", "text", 7],
    ids=["empty", "garbage", "str", "int"],
)
def test_a_damaged_record_is_a_clear_error(record: Any) -> None:
    with pytest.raises(ValueLoadError, match="randomness record"):
        loader_randomness(make("shuffle-gen", 0)).restore(record)


def test_a_record_of_another_layout_is_refused() -> None:
    buffer = io.BytesIO()
    torch.save({"epoch_start": {"sampler": torch.zeros(3)}, "now": {}}, buffer)  # not uint8
    with pytest.raises(ValueLoadError, match="unexpected layout"):
        loader_randomness(make("shuffle-gen", 0)).restore(buffer.getvalue())
