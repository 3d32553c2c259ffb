"""docs/accelerate.md's recipe, run as a child process by test_accelerate_recipe.py.

    python accelerate_worker.py URI OUT_DIR --steps 14 [--stop-at K] [--loader L] [--workers N]

A small classifier with dropout, AdamW, a warm-up schedule and a shuffled loader, all passed
through `accelerator.prepare`, with gradient accumulation over 2 batches (11 batches an epoch, so
each epoch ends on a partial accumulation). The prepared objects go into `TrainState` as they
are; the loader is a `StatefulDataLoader` (``use_stateful_dataloader=True``), which keeps its
position. ``--loader`` picks its sampler: ``torchdata`` (torchdata's stateful RandomSampler),
``torch-sampler`` (torch's ``RandomSampler(generator=g)``, whose permutation a resume must draw
again) or ``augment`` (the torch sampler over a `SeededDataset` that adds noise in
``__getitem__``: Accelerate's own ``set_epoch`` seeds each epoch); ``--workers`` its worker
processes. With ``--stop-at K`` it prints ``REACHED K`` after optimizer step K and waits there
for SIGTERM. On completion it writes ``OUT_DIR/digest.json`` (a SHA-256 of every parameter and
optimizer tensor).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
from pathlib import Path
from types import FrameType

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch import nn
from torch.utils.data import Dataset, RandomSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as TorchdataRandomSampler

from spotckpt import PREEMPTED_EXIT_CODE, CheckpointManager, SeededDataset, TrainState

from tests_support import SignalledFlag

ACCUMULATE = 2


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random augmentation: noise from torch's RNG of the process that loads the sample."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        features, label = self.base[index]
        return features + 0.1 * torch.randn(features.shape), label


def make_loader(kind: str, workers: int) -> StatefulDataLoader[tuple[torch.Tensor, ...]]:
    """44 examples in shuffled batches of 4; the loader's own generator leaves the global RNG."""
    generator = torch.Generator().manual_seed(1234)
    features = torch.randn(44, 8, generator=generator)
    labels = torch.randint(0, 3, (44,), generator=generator)
    data: Dataset[tuple[torch.Tensor, ...]] = TensorDataset(features, labels)
    shuffle = torch.Generator().manual_seed(0)
    if kind == "augment":
        data = SeededDataset(Noisy(TensorDataset(features, labels)), seed=5)
    sampler = (
        TorchdataRandomSampler(data, generator=shuffle)
        if kind == "torchdata"
        else RandomSampler(data, generator=shuffle)
    )
    return StatefulDataLoader(
        data,
        batch_size=4,
        sampler=sampler,
        generator=torch.Generator().manual_seed(1),
        num_workers=workers,
    )


def sha(value: torch.Tensor) -> str:
    raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("uri")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--loader", choices=["torchdata", "torch-sampler", "augment"])
    parser.add_argument("--workers", type=int, default=0)
    options = parser.parse_args()
    signalled = SignalledFlag()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signalled.set()  # chained to by spotckpt's handler, which records the preemption

    signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    # --- the recipe ---------------------------------------------------------------------------
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=ACCUMULATE,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, make_loader(options.loader or "torchdata", options.workers), scheduler
    )
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader)
    manager = CheckpointManager(options.uri, interval_steps=3)
    step = manager.restore(state) or 0  # the last optimizer step done
    while step < options.steps:
        for features, labels in loader:  # a restored loader resumes mid-epoch
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(features), labels)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue  # within an accumulation: no optimizer step yet
            step += 1
            if step == options.stop_at:
                print(f"REACHED {step}", flush=True)
                signalled.wait(timeout=600)
            manager.maybe_save(step, state)
            if manager.should_stop():
                manager.close()
                return PREEMPTED_EXIT_CODE
            if step == options.steps:
                break
    manager.close()
    # ------------------------------------------------------------------------------------------

    tensors = {f"param:{name}": sha(value) for name, value in model.state_dict().items()}
    for index, moments in optimizer.state_dict()["state"].items():
        for key, value in moments.items():
            tensors[f"optim:{index}.{key}"] = sha(value)
    (options.out / "digest.json").write_text(json.dumps({"tensors": tensors, "step": step}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
