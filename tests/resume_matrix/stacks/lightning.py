"""Resume-matrix stack: a Lightning ``Trainer`` and `SpotckptCallback`, as docs/lightning.md shows.

    python stacks/lightning.py --describe      # what this stack supports (no torch import)
    MATRIX_CASE='{...}' python stacks/lightning.py

docs/lightning.md's recipe as a user writes it: ``Trainer(callbacks=[SpotckptCallback(uri,
interval_steps=..., async_save=...)])`` and ``trainer.fit(model, train_dataloaders=loader,
val_dataloaders=...)``; the callback restores at fit start, saves on the interval and on a
preemption notice, and ends the process with status 75. The model is a small MLP with dropout,
AdamW and a per-step StepLR (a schedule that does not depend on the run's length), trained on 48
samples in batches of 8 (6 steps an epoch), validated every 3 training batches on 16 samples (2
batches, by the case's ``workers`` too). Loaders (case ``loader``, with ``workers`` workers):

- ``stateful-torch-sampler``: docs/lightning.md's set-up: ``StatefulDataLoader(data, sampler=
  torch.utils.data.RandomSampler(data, generator=g1), generator=g2)``;
- ``stateful``: ``StatefulDataLoader(data, shuffle=True, generator=g)``;
- ``stateful-nogen``: ``StatefulDataLoader(data, shuffle=True)``, no generator at all;
- ``stateful-augment``: docs/lightning.md's set-up over ``SeededDataset`` of a dataset that adds
  random noise in ``__getitem__``; ``data.set_epoch(epoch)`` is called before each iterator is
  created (Lightning creates the first one after ``on_fit_start``, later ones after
  ``on_train_epoch_start``).

Pause kinds (``pause.at`` is a step K: the pause is at the first such point at step K or later,
once, and only when the restored step is before K): ``step``: after optimizer step K, in a
callback that runs before `SpotckptCallback` sees the step, so the emergency save is of step K;
``epoch_end``: in ``on_train_epoch_end`` (K is the last step of an epoch; Lightning stops the run
there by itself and the callback saves step K in ``on_exception``); ``eval``: in the first
validation batch of the first validation run at or after step K; ``async``: in the module's
``on_train_batch_end`` (after the callback's) at the first interval step >= K, whose
(``async_save``) save has just started. Pausing writes ``out/paused-rank{r}`` (JSON: step, kind,
pid, pgid) and waits, at most 300 s, for the preemption flag. Before each save the worker writes
the state it expects saved as ``out/saved-rank{r}-step{s}-{pid}.json``; after its restore,
``out/restored-rank{r}-{pid}.json``; at a clean finish ``out/final-rank{r}.json`` (a sha256 per
entry: ``model/...``, ``optim/...``, ``scheduler``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from _worker import Pause, rank, serve, write_json

DESCRIBE = {
    "ranks": [1, 2],
    "loaders": ["stateful-torch-sampler", "stateful", "stateful-nogen", "stateful-augment"],
    "world_change": False,
    # On several ranks Lightning wraps torchdata's shuffling sampler (``shuffle=True``) in its
    # DistributedSamplerWrapper, which draws an epoch's order as an iterator is created; a
    # restored torchdata iterator is created twice over, so the cut epoch's order is drawn
    # twice and comes out different. spotckpt warns of it; docs/lightning.md states it.
    "one_rank_loaders": ["stateful", "stateful-nogen"],
    "steps": 20,
    "save_every": 4,
    "run_s": 15,
}

SAMPLES = 48
BATCH = 8  # 6 optimizer steps an epoch
VAL_SAMPLES = 16
VAL_EVERY = 3  # training batches between validation runs


def run(case: dict[str, Any]) -> int:
    import lightning.pytorch as pl
    import torch
    from _frameworks import stateful_loader, training_digests
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from spotckpt.integrations.lightning import SpotckptCallback

    out = Path(case["out"])
    out.mkdir(parents=True, exist_ok=True)
    me = rank()
    seed = int(case["seed"])
    save_every = int(case["save_every"])
    torch.set_num_threads(1)
    pl.seed_everything(seed, verbose=False)  # first: a loader without generator= draws from it

    def digests(trainer: pl.Trainer) -> dict[str, str]:
        """The digests of the module, its one optimizer and its one LR schedule."""
        (optimizer,) = trainer.optimizers
        (config,) = trainer.lr_scheduler_configs
        return training_digests(trainer.lightning_module, optimizer, config.scheduler)

    generator = torch.Generator().manual_seed(1000 + seed)
    samples = TensorDataset(
        torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    )
    validation = TensorDataset(
        torch.randn(VAL_SAMPLES, 8, generator=generator),
        torch.randn(VAL_SAMPLES, 1, generator=generator),
    )
    workers = int(case["workers"])
    name = case["loader"]
    loader, seeded = stateful_loader(name, samples, BATCH, workers, seed)
    val_loader = DataLoader(validation, batch_size=BATCH, num_workers=workers)  # shielded too

    progress: dict[str, Any] = {"restored": None, "saved": set()}

    def spot_of(trainer: pl.Trainer) -> SpotckptCallback:
        (found,) = [c for c in trainer.callbacks if isinstance(c, SpotckptCallback)]
        return found

    def preempted(trainer: pl.Trainer) -> bool:
        manager = spot_of(trainer).manager
        watcher = None if manager is None else manager.watcher
        return bool(trainer.received_sigterm or (watcher is not None and watcher.preempted))

    def saving(trainer: pl.Trainer) -> None:
        """The state SpotckptCallback saves at this step, written before it does."""
        step = trainer.global_step
        if step not in progress["saved"]:
            progress["saved"].add(step)
            record = {"step": step, "state": digests(trainer)}
            write_json(out / f"saved-rank{me}-step{step}-{os.getpid()}.json", record)

    pause = Pause(case.get("pause"), out, me, lambda: preempted(trainer))  # built below

    def pause_here(trainer: pl.Trainer, kind: str) -> bool:
        return pause.hold(kind, trainer.global_step)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1)
            )

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return nn.functional.mse_loss(self.net(inputs), targets)

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            loss = nn.functional.mse_loss(self.net(inputs), targets)
            self.log("val_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

        def on_fit_start(self) -> None:
            # after SpotckptCallback's restore, before Lightning creates the first iterator
            if seeded is not None:
                seeded.set_epoch(self.current_epoch)

        def on_train_epoch_start(self) -> None:
            if seeded is not None:
                seeded.set_epoch(self.current_epoch)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            # after every callback's on_train_batch_end: SpotckptCallback's save has started
            if self.trainer.global_step % save_every == 0:
                pause_here(self.trainer, "async")

    class Probe(pl.Callback):
        """Records losses, restored and saved state; pauses where the case asks."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            step = trainer.global_step
            progress["restored"] = step if step > 0 else None
            pause.arm(progress["restored"])
            state = digests(trainer) if step > 0 else {}
            record = {"step": progress["restored"], "state": state}
            write_json(out / f"restored-rank{me}-{os.getpid()}.json", record)

        def on_train_batch_end(
            self,
            trainer: pl.Trainer,
            pl_module: pl.LightningModule,
            outputs: Any,
            batch: Any,
            batch_idx: int,
        ) -> None:
            # before SpotckptCallback's on_train_batch_end (Checkpoint callbacks run last)
            step = trainer.global_step
            loss = float(outputs["loss"].item())
            record = {"step": step, "loss": loss.hex(), "epoch": trainer.current_epoch}
            with open(out / f"losses-rank{me}.jsonl", "a") as losses:
                losses.write(json.dumps(record) + "\n")
            pause_here(trainer, "step")
            if preempted(trainer) or step % save_every == 0:
                saving(trainer)  # what SpotckptCallback saves right after this hook

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if pause_here(trainer, "epoch_end"):
                saving(trainer)  # Lightning stops here; the callback saves in on_exception

        def on_validation_batch_end(
            self,
            trainer: pl.Trainer,
            pl_module: pl.LightningModule,
            outputs: Any,
            batch: Any,
            batch_idx: int,
            dataloader_idx: int = 0,
        ) -> None:
            if not trainer.sanity_checking and batch_idx == 0 and pause_here(trainer, "eval"):
                saving(trainer)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            saving(trainer)  # SpotckptCallback saves the last step after this hook

    spot = SpotckptCallback(
        case["uri"], interval_steps=save_every, async_save=bool(case["async_save"])
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_steps=int(case["steps"]),
        val_check_interval=VAL_EVERY,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[spot, Probe()],
    )
    trainer.fit(Net(), train_dataloaders=loader, val_dataloaders=val_loader)
    write_json(out / f"final-rank{me}.json", digests(trainer))
    return 0


if __name__ == "__main__":
    sys.exit(serve(DESCRIBE, run))
