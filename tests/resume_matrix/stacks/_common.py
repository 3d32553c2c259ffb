"""What the core stack workers (plain, ddp, fsdp2, raw_dcp) share: the case, a tiny model and
dataset, the loader set-ups, the training loop, the pause, and the digests (see ../harness.py).

A stack imports this only after ``--describe`` was answered, so describing never imports torch.
The run is deterministic: dropout, a noisy augmentation, and a loss scale drawn from Python's and
NumPy's RNGs each step, so every generator a checkpoint must restore changes the losses.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from _worker import Pause, sha, write_json
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import spotckpt
from spotckpt import ResumableSampler, SeededDataset, track_batches

SAMPLES = 48  # 6 batches of 8 per epoch on one rank (3 per rank with a DistributedSampler on 2)
VALIDATION = 16
BATCH = 8
FEATURES = 16
CLASSES = 4
EVAL_EVERY = 5
DATA_SEED = 1234
EXACT_PAUSES = ("step", "epoch_end")  # the harness picks K from the reference: pause at K itself


# The case --------------------------------------------------------------------------------------


@dataclass
class Case:
    """What MATRIX_CASE asks for."""

    uri: str
    out: Path
    steps: int
    save_every: int
    loader: str
    workers: int
    pause: dict[str, Any] | None
    seed: int
    async_save: bool

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Case:
        """The case from its ``MATRIX_CASE`` form."""
        return cls(
            uri=raw["uri"],
            out=Path(raw["out"]),
            steps=int(raw["steps"]),
            save_every=int(raw["save_every"]),
            loader=raw["loader"],
            workers=int(raw["workers"]),
            pause=raw.get("pause"),
            seed=int(raw.get("seed", 0)),
            async_save=bool(raw.get("async_save", False)),
        )


# Data and model --------------------------------------------------------------------------------


class Toy(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Fixed random features and labels; `augment` adds noise drawn from torch's RNG of the
    process that loads the sample (a loader worker, or the trainer with ``num_workers=0``)."""

    def __init__(self, length: int, data_seed: int, augment: bool = False) -> None:
        generator = torch.Generator().manual_seed(data_seed)
        self.x = torch.randn(length, FEATURES, generator=generator)
        self.y = torch.randint(0, CLASSES, (length,), generator=generator)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i = int(index)
        x = self.x[i]
        if self.augment:
            x = x + 0.1 * torch.randn(FEATURES)
        return x, self.y[i], torch.tensor(i)


def make_model(seed: int) -> nn.Module:
    """A small MLP with dropout, the same on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, 32),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(32, CLASSES),
    )


def schedule(step: int) -> float:
    """Warm-up then exponential decay: independent of the total steps (finish-then-more)."""
    return min(1.0, (step + 1) / 4) * 0.97 ** max(0, step - 4)


# Loaders ---------------------------------------------------------------------------------------


@dataclass
class LoaderSetup:
    """A data loader and how to iterate one epoch of it."""

    loader: Any
    dataset: Any
    sampler: Any
    tracked: bool  # a ResumableSampler: iterate through track_batches
    steps_per_epoch: int

    def epoch(self, epoch: int) -> Iterator[Any]:
        """One epoch's batches (what is left of it after a mid-epoch restore)."""
        for part in (self.dataset, self.sampler):
            if hasattr(part, "set_epoch"):
                part.set_epoch(epoch)
        return track_batches(self.loader) if self.tracked else iter(self.loader)

    def stateful(self) -> Any:
        """What holds the position: the StatefulDataLoader, or the ResumableSampler."""
        return self.sampler if self.tracked else self.loader

    def saved_state(self) -> Any:
        """The position as a save takes it."""
        return position(self.stateful().state_dict())

    def restored_state(self) -> Any:
        """The position a restore loaded, without starting an iterator (which would draw from
        the RNGs and start workers): a StatefulDataLoader keeps it until its next iterator."""
        if self.tracked:
            return position(self.sampler.state_dict())
        return position(getattr(self.loader, "next_iter_state", None))


def position(state: Any) -> Any:
    """A loader state without what spotckpt adds to it (``_spotckpt...`` keys, its own record
    of the loader's randomness): the position, as the loader itself keeps it."""
    if isinstance(state, dict):
        return {k: v for k, v in state.items() if not str(k).startswith("_spotckpt")}
    return state


def build_loader(name: str, workers: int, rank: int, world: int, seed: int) -> LoaderSetup:
    """The loader set-up called `name` (see the harness's contract)."""

    def generator(offset: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(seed + offset)

    augment = name in ("resumable-augment", "stateful-augment", "per-rank-seed")
    base = Toy(SAMPLES, DATA_SEED, augment=augment)
    common: dict[str, Any] = {"batch_size": BATCH, "num_workers": workers, "drop_last": True}
    per_epoch = SAMPLES // BATCH
    if name in ("stateful", "stateful-nogen"):
        loader = StatefulDataLoader(
            base, shuffle=True, generator=None if name.endswith("nogen") else generator(), **common
        )
        return LoaderSetup(loader, base, None, False, per_epoch)
    if name == "stateful-torch-sampler":
        sampler = RandomSampler(base, generator=generator(1))
        loader = StatefulDataLoader(base, sampler=sampler, generator=generator(), **common)
        return LoaderSetup(loader, base, sampler, False, per_epoch)
    if name == "stateful-augment":
        seeded = SeededDataset(base, seed=seed)
        loader = StatefulDataLoader(seeded, shuffle=True, generator=generator(), **common)
        return LoaderSetup(loader, seeded, None, False, per_epoch)
    if name == "distributed":
        distributed = DistributedSampler(
            base, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        loader = StatefulDataLoader(base, sampler=distributed, generator=generator(), **common)
        return LoaderSetup(loader, base, distributed, False, (SAMPLES // world) // BATCH)
    if name in ("resumable", "resumable-augment", "per-rank-seed"):
        own = seed + rank if name == "per-rank-seed" else seed
        data: Any = SeededDataset(base, seed=own) if augment else base
        resumable = ResumableSampler(len(data), seed=own)
        loader = DataLoader(data, sampler=resumable, generator=generator(), **common)
        return LoaderSetup(loader, data, resumable, True, per_epoch)
    if name == "shuffle-plain":
        loader = DataLoader(base, shuffle=True, generator=generator(), **common)
        return LoaderSetup(loader, base, None, False, per_epoch)
    raise SystemExit(f"unknown loader {name!r}")


# Digests ---------------------------------------------------------------------------------------


def plain(value: Any) -> Any:
    """`value` as JSON-able data: tensors and arrays by digest, dict keys as strings."""
    if isinstance(value, torch.Tensor):
        return "tensor:" + sha(value)
    if isinstance(value, np.ndarray):
        return "ndarray:" + hashlib.sha256(value.tobytes()).hexdigest() + str(value.dtype)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return plain(value.item())
    return repr(value)


def json_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(plain(value), sort_keys=True).encode()).hexdigest()


def rng_digests() -> dict[str, str]:
    return {
        "rng/python": json_digest(random.getstate()),
        "rng/numpy": json_digest(list(np.random.get_state(legacy=True))),
        "rng/torch": sha(torch.get_rng_state()),
    }


# The job ---------------------------------------------------------------------------------------


class Checkpoints(Protocol):
    """How a stack saves and restores (the manager, or raw DCP)."""

    def restore(self) -> int | None: ...
    def maybe_save(self, step: int) -> bool: ...
    def preempted(self) -> bool: ...
    def should_stop(self) -> bool: ...
    def finish(self, step: int) -> bool: ...
    def close(self) -> None: ...


@dataclass
class Job:
    """Everything a run trains with."""

    case: Case
    rank: int
    world: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: LoaderSetup
    validation: DataLoader[Any]
    extra: dict[str, Any] = field(default_factory=lambda: {"samples_seen": 0, "order_hash": 0})

    def digests(self, loader_state: Any) -> dict[str, str]:
        """A sha256 per state entry; collective for sharded models (every rank calls it)."""
        options = StateDictOptions(full_state_dict=True)
        found = {
            f"model/{fqn}": sha(value)
            for fqn, value in get_model_state_dict(self.model, options=options).items()
        }
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        for fqn, entries in optimizer["state"].items():
            for key, value in entries.items():
                digest = sha(value) if isinstance(value, torch.Tensor) else json_digest(value)
                found[f"optim/{fqn}/{key}"] = digest
        found["optim/param_groups"] = json_digest(optimizer["param_groups"])
        found["scheduler"] = json_digest(self.scheduler.state_dict())
        if loader_state is not None:
            found["loader"] = json_digest(loader_state)
        found.update(rng_digests())
        found["extra"] = json_digest(self.extra)
        return found

    def write(self, name: str, document: Any) -> None:
        """Write a JSON file into the case's out folder, atomically."""
        write_json(self.case.out / name, document)


def make_job(case: Case, wrap: Callable[[nn.Module], nn.Module] | None, distributed: bool) -> Job:
    """Process group (for distributed stacks), model, optimizer, scheduler and loaders."""
    torch.set_num_threads(1)
    if distributed and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model = make_model(case.seed)
    if wrap is not None:
        model = wrap(model)
    # Each rank's own dropout, loss-scale and augmentation streams.
    torch.manual_seed(case.seed + 1000 * (rank + 1))
    random.seed(case.seed + rank)
    np.random.seed(case.seed + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    data = build_loader(case.loader, case.workers, rank, world, case.seed)
    validation = DataLoader(
        Toy(VALIDATION, DATA_SEED + 1),
        batch_size=BATCH,
        generator=torch.Generator().manual_seed(0),
    )
    case.out.mkdir(parents=True, exist_ok=True)
    return Job(case, rank, world, model, optimizer, scheduler, data, validation)


def train_step(job: Job, batch: Any) -> float:
    x, y, index = batch
    job.model.train()
    # A loss scale from Python's and NumPy's RNGs: a wrong restore of either changes the loss.
    scale = 1.0 + 0.05 * random.random() + 0.05 * float(np.random.rand())
    loss = nn.functional.cross_entropy(job.model(x), y) * scale
    loss.backward()
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    job.extra["samples_seen"] += len(index)
    digest = job.extra["order_hash"]
    for i in index.tolist():
        digest = (digest * 1_000_003 + i + 1) % (2**61 - 1)
    job.extra["order_hash"] = digest
    return float(loss.item())


def evaluate(job: Job, step: int, pause: Pause) -> float:
    """A validation pass (no dropout, no gradients); the ``eval`` pause happens inside it."""
    job.model.eval()
    total = 0.0
    with torch.no_grad():
        for n, (x, y, _) in enumerate(job.validation):
            logits = job.model(x)
            total += float(nn.functional.cross_entropy(logits, y, reduction="sum").item())
            if n == 0:
                pause.hold("eval", step)
    job.model.train()
    return total / VALIDATION


def run(job: Job, checkpoints: Checkpoints) -> int:
    """Restore, train to ``case.steps`` with periodic saves, and stop on preemption (75)."""
    case = job.case
    restored = checkpoints.restore()
    state = job.digests(job.data.restored_state()) if restored is not None else {}
    job.write(f"restored-rank{job.rank}-{os.getpid()}.json", {"step": restored, "state": state})
    pause = Pause(case.pause, case.out, job.rank, checkpoints.preempted, exact=EXACT_PAUSES)
    pause.arm(restored)
    losses = open(case.out / f"losses-rank{job.rank}.jsonl", "a")  # noqa: SIM115
    step = 1 if restored is None else restored + 1
    empty_passes = 0
    while step <= case.steps:
        epoch = (step - 1) // job.data.steps_per_epoch
        got = False
        for batch in job.data.epoch(epoch):
            got = True
            loss = train_step(job, batch)
            entry: dict[str, Any] = {"step": step, "loss": loss.hex(), "epoch": epoch}
            if step % EVAL_EVERY == 0:
                entry["eval"] = evaluate(job, step, pause).hex()
            losses.write(json.dumps(entry) + "\n")
            losses.flush()
            pause.hold("step", step)
            pause.hold("epoch_end", step)
            if checkpoints.maybe_save(step):
                saved = job.digests(job.data.saved_state())
                job.write(
                    f"saved-rank{job.rank}-step{step}-{os.getpid()}.json",
                    {"step": step, "state": saved},
                )
                pause.hold("async", step)
            if checkpoints.should_stop():
                losses.close()
                checkpoints.close()
                return spotckpt.PREEMPTED_EXIT_CODE
            step += 1
            if step > case.steps:
                break
        empty_passes = 0 if got else empty_passes + 1
        if empty_passes > 1:
            raise RuntimeError(f"the loader yields nothing at step {step}")
    losses.close()
    if checkpoints.finish(case.steps):
        saved = job.digests(job.data.saved_state())
        job.write(
            f"saved-rank{job.rank}-step{case.steps}-{os.getpid()}.json",
            {"step": case.steps, "state": saved},
        )
    final = job.digests(None)
    checkpoints.close()
    job.write(f"final-rank{job.rank}.json", final)
    return 0


def finish_process(code: int) -> int:
    """Leave the process group (when there is one) and hand back the exit status."""
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


# Checkpointing through the manager -------------------------------------------------------------


class ManagerCheckpoints:
    """`CheckpointManager` + `TrainState`, as docs/training-loop.md shows."""

    def __init__(self, job: Job) -> None:
        self.state = spotckpt.TrainState(
            model=job.model,
            optimizer=job.optimizer,
            scheduler=job.scheduler,
            dataloader=job.data.loader,
            extra=job.extra,
        )
        self.manager = spotckpt.CheckpointManager(
            job.case.uri, interval_steps=job.case.save_every, async_save=job.case.async_save
        )

    def restore(self) -> int | None:
        return self.manager.restore(self.state)

    def maybe_save(self, step: int) -> bool:
        return self.manager.maybe_save(step, self.state)

    def preempted(self) -> bool:
        watcher = self.manager.watcher
        return watcher is not None and watcher.preempted

    def should_stop(self) -> bool:
        return self.manager.should_stop()

    def finish(self, step: int) -> bool:
        """Wait for an upload in flight; save the last step unless it is saved already."""
        self.manager.wait()
        if self.manager.latest_step() == step:
            return False
        self.manager.save(step, self.state, blocking=True)
        return True

    def close(self) -> None:
        self.manager.close()


def main(
    case: dict[str, Any],
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    distributed: bool = False,
) -> int:
    """A manager-based stack: build the job, train, exit 0 or 75."""
    job = make_job(Case.from_json(case), wrap, distributed)
    return finish_process(run(job, ManagerCheckpoints(job)))
