"""TrainState parts round-trip alone: each RNG, the sampler position, extras, key errors."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from spotckpt import (
    CheckpointManager,
    KeyMismatchError,
    ResumableSampler,
    TrainState,
    track_batches,
)


@pytest.fixture
def manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "ck"), preemption=False)


def _draws() -> tuple[float, float, float, float]:
    return (random.random(), random.gauss(0, 1), float(np.random.rand()), torch.rand(1).item())


def test_every_rng_round_trips(manager: CheckpointManager) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leave a cached gauss value in Python's state
    state = TrainState()
    manager.save(1, state)
    expected = _draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draws() != expected
    assert manager.restore(TrainState()) == 1
    assert _draws() == expected


@pytest.mark.process
def test_sampler_position_round_trips(manager: CheckpointManager) -> None:
    data = TensorDataset(torch.arange(40))
    sampler = ResumableSampler(len(data), seed=5)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    seen = []
    for i, (batch,) in enumerate(track_batches(loader)):
        seen.extend(batch.tolist())
        if i == 3:
            break
    assert sampler.consumed == 16 and sampler.epoch == 0
    manager.save(1, TrainState(dataloader=loader, rng=False))

    fresh = ResumableSampler(len(data), seed=5)
    fresh_loader = DataLoader(data, batch_size=4, sampler=fresh, num_workers=2)
    manager.restore(TrainState(dataloader=fresh_loader, rng=False))
    rest = [x for (batch,) in track_batches(fresh_loader) for x in batch.tolist()]
    assert seen + rest == sampler.order(0)
    assert fresh.epoch == 1 and fresh.consumed == 0
    assert sorted(seen + rest) == list(range(40))


def test_sampler_shuffles_per_epoch_from_seed() -> None:
    sampler = ResumableSampler(10, seed=1)
    assert sampler.order(0) != sampler.order(1)
    assert sampler.order(0) == ResumableSampler(10, seed=1).order(0)


def test_plain_dataloader_without_resumable_sampler_is_refused() -> None:
    loader = DataLoader(TensorDataset(torch.arange(4)), shuffle=True)
    with pytest.raises(TypeError, match="ResumableSampler"):
        TrainState(dataloader=loader)


def test_stateful_dataloader_round_trips(manager: CheckpointManager) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = TensorDataset(torch.arange(30))
    loader = StatefulDataLoader(
        data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    iterator = iter(loader)
    first = [next(iterator)[0].tolist() for _ in range(4)]
    manager.save(1, TrainState(dataloader=loader, rng=False))
    expected = [batch[0].tolist() for batch in iterator]

    again = StatefulDataLoader(
        data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    manager.restore(TrainState(dataloader=again, rng=False))
    assert [batch[0].tolist() for batch in again] == expected
    assert first


def test_scheduler_scaler_extras_and_step(manager: CheckpointManager) -> None:
    model = nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(5):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    extra = {"tokens_seen": 1234, "name": "run-a", "history": [0.5, 0.25]}
    state = TrainState(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, extra=extra
    )
    manager.save(5, state)

    model2 = nn.Linear(3, 3)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=2, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0)
    extra2 = {"tokens_seen": 0, "name": "", "history": [0.0, 0.0]}
    restored = TrainState(
        model=model2, optimizer=optimizer2, scheduler=scheduler2, scaler=scaler2, extra=extra2
    )
    assert manager.restore(restored) == 5 and restored.step == 5
    assert extra2 == extra
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert scaler2.get_scale() == 1024.0
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_extras_must_be_plain_values(manager: CheckpointManager) -> None:
    with pytest.raises(TypeError, match=r"extra\.bad is a object"):
        manager.save(1, TrainState(extra={"bad": object()}))


def test_state_mismatch_names_the_part(manager: CheckpointManager) -> None:
    manager.save(1, TrainState(model=nn.Linear(2, 2), rng=False))
    with pytest.raises(
        KeyMismatchError,
        match=r"missing from the checkpoint: model\.0\.bias, .*model\.1\.weight",
    ):
        manager.restore(
            TrainState(model=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), rng=False)
        )


@pytest.mark.process
def test_dataloader_workers_survive_sigterm() -> None:
    """A SIGTERM sent to the process group (torchrun, SLURM) must not kill loader workers."""
    import os
    import signal

    data = TensorDataset(torch.arange(64))
    loader = DataLoader(data, batch_size=4, sampler=ResumableSampler(64, seed=0), num_workers=2)
    TrainState(dataloader=loader, rng=False)
    iterator = iter(loader)
    first = [next(iterator), next(iterator)]  # one batch from each worker: both have started
    for worker in iterator._workers:  # type: ignore[attr-defined]
        os.kill(worker.pid, signal.SIGTERM)
    rest = list(iterator)
    assert len(rest) == 14 and all(batch[0].numel() == 4 for batch in first)
