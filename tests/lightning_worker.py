"""A deterministic Lightning training run with `SpotckptCallback`, for test_lightning.py.

Usage: python lightning_worker.py URI OUT [--steps N] [--interval S] [--async-save]
       [--dump-at K ...] [--wait-at K --wait-in callback|module] [--workers N]

A tiny MLP with dropout, AdamW and a per-step StepLR, fed by a torchdata StatefulDataLoader of
8 shuffled batches per epoch. Into the folder OUT it writes ``losses.jsonl`` (one line per
batch), ``start.pt`` (the state when training starts, after any restore), ``at-K.pt`` (the state
after step K) and ``final.pt`` (the state when training ends); a state is the step, parameters,
optimizer and scheduler state dicts and the torch RNG.

With `--wait-at K` the run prints ``waiting at step K`` on stdout after step K and blocks until
a signal arrives: in a callback, which runs before `SpotckptCallback` sees the step (so the
callback makes the emergency save), or in the module's ``on_train_batch_end`` hook, which runs
after it (so Lightning's own SIGTERM stop ends the batch, and the callback saves in
``on_exception``). The test imports `run` to train in its own process too.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import select
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import RandomSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from spotckpt.integrations.lightning import SpotckptCallback

WAIT_TIMEOUT_S = 600.0


def wait_for_signal(step: int) -> None:
    """Announce `step` on stdout, then block until a signal arrives (its handlers run here)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)
    try:
        print(f"waiting at step {step}", file=sys.__stdout__, flush=True)
        select.select([read], [], [], WAIT_TIMEOUT_S)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)


def snapshot(trainer: pl.Trainer) -> dict[str, Any]:
    """Everything the comparison looks at, copied."""
    module = trainer.lightning_module
    (optimizer,) = trainer.optimizers
    (scheduler,) = [config.scheduler for config in trainer.lr_scheduler_configs]
    return {
        "step": trainer.global_step,
        "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "rng": torch.get_rng_state(),
    }


class Net(pl.LightningModule):
    """Two linear layers with dropout between them: four parameters, so four AdamW moments."""

    def __init__(self, wait_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1))
        self.wait_at = wait_at

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.wait_at:
            wait_for_signal(self.global_step)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Probe(pl.Callback):
    """Records losses and states into `out`; waits for a signal, or triggers a notice, if asked.

    `trigger_at_batch` (1-based, counted over the whole run) calls the preemption watcher's
    `trigger()` in that batch, as a notice from a cloud would arrive.
    """

    def __init__(
        self,
        out: Path,
        dump_at: Sequence[int] = (),
        wait_at: int | None = None,
        trigger_at_batch: int | None = None,
    ) -> None:
        self.out = out
        self.dump_at = set(dump_at)
        self.wait_at = wait_at
        self.trigger_at_batch = trigger_at_batch
        self.batches = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(snapshot(trainer), self.out / "start.pt")

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        self.batches += 1
        with open(self.out / "losses.jsonl", "a") as log:
            line = {
                "step": step,
                "epoch": trainer.current_epoch,
                "loss": outputs["loss"].item().hex(),
            }
            log.write(json.dumps(line) + "\n")
        if step in self.dump_at:
            self.dump_at.discard(step)
            torch.save(snapshot(trainer), self.out / f"at-{step}.pt")
        if step == self.wait_at:
            wait_for_signal(step)
        if self.batches == self.trigger_at_batch:
            (spot,) = [c for c in trainer.callbacks if isinstance(c, SpotckptCallback)]
            assert spot.manager is not None and spot.manager.watcher is not None
            spot.manager.watcher.trigger("test")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(snapshot(trainer), self.out / "final.pt")


def loader(shared_generator: bool = False, workers: int = 0) -> StatefulDataLoader:
    """64 fixed samples in batches of 8, shuffled by a sampler with a generator of its own.

    With `shared_generator` the loader is ``shuffle=True, generator=g`` instead: the sampler and
    the iterator's base seed draw from the one generator `g`.
    """
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(64, 8, generator=data), torch.randn(64, 1, generator=data))
    if shared_generator:
        return StatefulDataLoader(
            dataset,
            batch_size=8,
            shuffle=True,
            generator=torch.Generator().manual_seed(3),
            num_workers=workers,
        )
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(2))
    return StatefulDataLoader(
        dataset,
        batch_size=8,
        sampler=sampler,
        generator=torch.Generator().manual_seed(3),
        num_workers=workers,
    )


def run(
    uri: str,
    out: Path,
    *,
    steps: int = 20,
    interval: int | None = 3,
    accumulate: int = 1,
    async_save: bool = False,
    dump_at: Sequence[int] = (),
    wait_at: int | None = None,
    wait_in_module: bool = False,
    trigger_at_batch: int | None = None,
    shared_generator: bool = False,
    workers: int = 0,
) -> None:
    """Train to `steps` optimizer steps (resuming from `uri`), recording into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    probe = Probe(out, dump_at, None if wait_in_module else wait_at, trigger_at_batch)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SpotckptCallback(uri, interval_steps=interval, async_save=async_save), probe],
    )
    net = Net(wait_at if wait_in_module else None)
    trainer.fit(net, train_dataloaders=loader(shared_generator, workers))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("uri")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=3)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--dump-at", type=int, nargs="*", default=[])
    parser.add_argument("--wait-at", type=int)
    parser.add_argument("--wait-in", choices=["callback", "module"], default="callback")
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    torch.set_num_threads(1)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the "waiting" line only
        run(
            args.uri,
            args.out,
            steps=args.steps,
            interval=args.interval,
            wait_in_module=args.wait_in == "module",
            async_save=args.async_save,
            dump_at=args.dump_at,
            wait_at=args.wait_at,
            workers=args.workers,
        )


if __name__ == "__main__":
    main()
