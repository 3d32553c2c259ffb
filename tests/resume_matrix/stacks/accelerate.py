"""Resume-matrix stack: docs/accelerate.md's recipe, as printed, and variants of its loader.

    python stacks/accelerate.py --describe      # what this stack supports (no torch import)
    MATRIX_CASE='{...}' python stacks/accelerate.py

Loader ``recipe`` is docs/accelerate.md's recipe as printed (``Accelerator(dataloader_config=
DataLoaderConfiguration(use_stateful_dataloader=True))``, everything through
``accelerator.prepare``, `TrainState` of the prepared objects, ``step = mgr.restore(state) or
0``, the ``while step < total_steps: for batch in loader:`` loop with ``accelerator.accumulate``,
``maybe_save``, ``should_stop``, the ``break`` at ``total_steps`` and the last save), with
``cpu=True`` on 2 ranks (this machine has no GPU), and with
what the recipe leaves to the user filled in the plainest way: a ``StatefulDataLoader`` whose
sampler has a generator of its own (``sampler=torch.utils.data.RandomSampler(data,
generator=g)``; no ``generator=`` on the loader, no workers: the case's ``workers`` is
ignored), the default gradient accumulation (1), 44 samples in batches of 8 (6 steps an epoch)
and ``compute_loss``.

The other loaders are variants on the same model, optimizer and schedule, with 2 accumulated
batches of 4 a step (11 batches, 6 steps an epoch, the last one a single batch), ``workers``
worker processes, and the recipe's loop:
``stateful`` (``shuffle=True, generator=g``), ``stateful-torch-sampler`` (``sampler=
RandomSampler(data, generator=g1), generator=g2``), ``stateful-nogen`` (``shuffle=True``, no
generator) and ``stateful-augment`` (the torch-sampler set-up over ``SeededDataset`` of a
dataset that adds noise in ``__getitem__``; ``data.set_epoch(epoch)`` before each ``for batch
in loader``, which Accelerate's own ``set_epoch`` at each ``iter(loader)`` repeats).

Every run also evaluates on 16 samples (a plain DataLoader, 2 batches) after every 5th step,
before that step's ``maybe_save``. Pause kinds (``pause.at`` is a step K: the pause is at the
first such point at step K or later, once, and only when the restored step is before K):
``step`` and ``epoch_end`` (K is an epoch's last step): after step K, before its
``maybe_save``, so the emergency save is of step K; ``eval``: in the first batch of the first
evaluation at or after step K; ``async``: right after ``maybe_save`` started the interval save
of the first step >= K (``async_save``). Pausing writes ``out/paused-rank{r}`` (JSON: step,
kind, pid, pgid) and waits, at most 300 s, for the preemption flag. After each save the worker
writes the state it saved as ``out/saved-rank{r}-step{s}-{pid}.json``; after its restore,
``out/restored-rank{r}-{pid}.json``; at a clean finish ``out/final-rank{r}.json`` (a sha256 per
entry: ``model/...``, ``optim/...``, ``scheduler`` and ``rng/torch``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from _worker import Pause, rank, serve, sha, write_json

DESCRIBE = {
    "ranks": [1, 2],
    "loaders": [
        "recipe",
        "stateful",
        "stateful-torch-sampler",
        "stateful-nogen",
        "stateful-augment",
    ],
    "world_change": False,
    "steps": 24,
    "save_every": 4,
    "run_s": 14,
}

SAMPLES = 44
EVAL_SAMPLES = 16
EVAL_EVERY = 5
STEPS_PER_EPOCH = 6  # the recipe: 6 batches of 8; the variants: 11 batches of 4, 2 a step


def run(case: dict[str, Any]) -> int:
    import torch
    from _frameworks import stateful_loader, training_digests
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed
    from torch import nn
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    import spotckpt
    from spotckpt import CheckpointManager, SeededDataset, TrainState

    out = Path(case["out"])
    out.mkdir(parents=True, exist_ok=True)
    me = rank()
    seed = int(case["seed"])
    total_steps = int(case["steps"])
    save_every = int(case["save_every"])
    name = case["loader"]
    recipe = name == "recipe"
    torch.set_num_threads(1)
    set_seed(seed)

    generator = torch.Generator().manual_seed(1000 + seed)
    data: Any = TensorDataset(
        torch.randn(SAMPLES, 8, generator=generator),
        torch.randint(0, 3, (SAMPLES,), generator=generator),
    )
    validation = TensorDataset(
        torch.randn(EVAL_SAMPLES, 8, generator=generator),
        torch.randint(0, 3, (EVAL_SAMPLES,), generator=generator),
    )
    workers = int(case["workers"])
    if recipe:
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(seed))
        loader = StatefulDataLoader(data, batch_size=8, sampler=sampler)
    else:
        loader, seeded = stateful_loader(name, data, 4, workers, seed)
        data = seeded or data
    eval_loader = DataLoader(validation, batch_size=8)

    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    micro: list[float] = []

    def compute_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        features, labels = batch
        loss = nn.functional.cross_entropy(model(features), labels)
        micro.append(float(loss.detach()))
        return loss

    def digests() -> dict[str, str]:
        """The training state's digests, and the torch RNG's."""
        found = training_digests(model, optimizer, scheduler)
        found["rng/torch"] = sha(torch.get_rng_state())
        return found

    def preempted() -> bool:
        watcher = mgr.watcher
        return watcher is not None and watcher.preempted

    pause = Pause(case.get("pause"), out, me, preempted)

    def evaluate(step: int) -> None:
        model.eval()
        with torch.no_grad():
            for index, (features, labels) in enumerate(eval_loader):
                nn.functional.cross_entropy(model(features), labels)
                if index == 0:
                    pause.hold("eval", step)
        model.train()

    def after_step(step: int) -> None:
        """What the worker adds after ``step += 1``: the loss line, evaluation, pauses."""
        epoch = (step - 1) // STEPS_PER_EPOCH
        record = {"step": step, "loss": sum(micro).hex(), "epoch": epoch}
        micro.clear()
        with open(out / f"losses-rank{me}.jsonl", "a") as losses:
            losses.write(json.dumps(record) + "\n")
        if step % EVAL_EVERY == 0:
            evaluate(step)
        pause.hold("step", step)
        pause.hold("epoch_end", step)

    def after_save(step: int, saved: bool) -> None:
        if saved:
            record = {"step": step, "state": digests()}
            write_json(out / f"saved-rank{me}-step{step}-{os.getpid()}.json", record)
            if step % save_every == 0:
                pause.hold("async", step)

    def restored(step: int | None) -> None:
        pause.arm(step)
        record = {"step": step, "state": {} if step is None else digests()}
        write_json(out / f"restored-rank{me}-{os.getpid()}.json", record)

    def finished(step: int) -> int:
        write_json(out / f"final-rank{me}.json", digests())
        return 0

    # Accelerate runs several processes on the CPU as ranks only when told to (cpu=True); on
    # GPUs they are ranks by themselves.
    ranks_on_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if recipe:
        # --- docs/accelerate.md's recipe, as printed----------------------------------------------
        accelerator = Accelerator(
            cpu=ranks_on_cpu,
            dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        )
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
        state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader)
        mgr = CheckpointManager(
            case["uri"], interval_steps=save_every, async_save=bool(case["async_save"])
        )
        step = mgr.restore(state) or 0
        restored(step or None)
        while step < total_steps:
            for batch in loader:  # a restored loader resumes mid-epoch
                with accelerator.accumulate(model):
                    accelerator.backward(compute_loss(model, batch))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                if not accelerator.sync_gradients:
                    continue  # mid-accumulation: no optimizer step yet
                step += 1
                after_step(step)
                after_save(step, mgr.maybe_save(step, state))
                if mgr.should_stop():
                    mgr.close()
                    sys.exit(spotckpt.PREEMPTED_EXIT_CODE)
                if step == total_steps:
                    break
        mgr.wait()
        if mgr.latest_step() != step:
            mgr.save(step, state, blocking=True)
            after_save(step, True)
        mgr.close()
        return finished(step)

    # --- the variants: 2 batches a step; a break at total_steps and a last save -------------
    accelerator = Accelerator(
        cpu=ranks_on_cpu,
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader)
    mgr = CheckpointManager(
        case["uri"], interval_steps=save_every, async_save=bool(case["async_save"])
    )
    step = mgr.restore(state) or 0
    restored(step or None)
    while step < total_steps:
        if isinstance(data, SeededDataset):
            data.set_epoch(step // STEPS_PER_EPOCH)  # before each iter(loader)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(compute_loss(model, batch))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            after_step(step)
            after_save(step, mgr.maybe_save(step, state))
            if mgr.should_stop():
                mgr.close()
                return spotckpt.PREEMPTED_EXIT_CODE
            if step == total_steps:
                break
    mgr.wait()
    if mgr.latest_step() != step:  # the last step, unless the interval saved it
        mgr.save(step, state, blocking=True)
        after_save(step, True)
    mgr.close()
    return finished(step)


if __name__ == "__main__":
    sys.exit(serve(DESCRIBE, run))
