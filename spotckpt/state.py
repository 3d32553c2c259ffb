"""`TrainState`: everything a resumed run needs to continue exactly, as DCP `Stateful` parts.

Each part is a small Stateful adapter that DCP calls ``state_dict()`` on when saving and
``load_state_dict()`` on after loading in place:
- models and optimizers through DCP's ``get_state_dict`` / ``set_state_dict`` family, so plain,
  DDP and FSDP2 models work and optimizer state is keyed by parameter name, not position;
- schedulers, grad scalers and anything else with ``state_dict`` / ``load_state_dict``;
- the data-loader position (torchdata's StatefulDataLoader, or a plain DataLoader driven by
  `ResumableSampler`);
- every RNG of this rank (Python, NumPy, torch CPU and each CUDA device), under a per-rank key so
  ranks keep their own streams;
- the step and the extras (plain values, numpy, datetimes, ...: see `spotckpt.values`).

`as_dcp_state` wraps every part in `EncodedStateful`, so each non-tensor value is encoded to load
with ``torch.load(weights_only=True)`` (or the save is refused), and decoded again on restore.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.util
import os
import random
import re
import signal
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from spotckpt.engine.flat_state import is_stateful
from spotckpt.errors import InvalidArgumentError, InvalidTypeError
from spotckpt.loader_rng import (
    RECORD_KEY,
    LoaderRandomness,
    discard_unused_iterator,
    loader_randomness,
)
from spotckpt.seeding import SampleKey
from spotckpt.values import decode, encode

log = logging.getLogger("spotckpt")
RNG_KEY = "rng"
RANK_PREFIX = "rank_"
_PER_RANK_FQN = re.compile(r"^[^.]+\.rank_\d{5}(\.|$)")


class ModelState:
    """A model (plain, DDP or FSDP2) as a Stateful with FQN keys."""

    def __init__(self, model: nn.Module, *, strict: bool = True) -> None:
        self.model = model
        self.strict = strict

    def state_dict(self) -> dict[str, Any]:
        """The model's parameters and buffers by fully qualified name (local shards for FSDP2)."""
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy loaded values into the model."""
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=self.strict))


class OptimizerState:
    """An optimizer as a Stateful whose state is keyed by parameter FQN.

    Before the first save or load the optimizer state is created with a zero-learning-rate step
    (DCP's own approach), so a fresh optimizer offers AdamW moments for a restore to fill.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        """Moments, step counts and param-group settings by parameter FQN."""
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the optimizer in place."""
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank_key(rank: int) -> str:
    """The key segment under which a rank's own state is stored: ``rank_00003``."""
    return f"{RANK_PREFIX}{rank:05d}"


def is_per_rank_key(fqn: str) -> bool:
    """Whether a stored key belongs to one rank's own state (``<part>.rank_NNNNN.<...>``)."""
    return _PER_RANK_FQN.match(fqn) is not None


class PerRankState:
    """A Stateful whose state is stored under this rank's key, so each rank gets its own back.

    DCP stores a non-tensor value (and a plain tensor) once per key for the whole job, taking one
    rank's copy: a data-loader position, an RNG stream or an extra that differs by rank would come
    back from another rank. Keyed by rank, every rank's copy is kept. `source_rank` says which
    saved rank to read (the manager sets it on another world size: rank r reads saved rank
    ``r % saved_world``); `keyed` is False while loading a checkpoint written before this part
    was keyed by rank (earlier spotckpt releases keyed only the RNGs): then every rank reads the one
    stored copy, as those versions did.
    """

    def __init__(self, inner: Stateful) -> None:
        self.inner = inner
        self.source_rank: int | None = None
        self.keyed = True
        self.discard = False

    def key(self) -> str:
        """The per-rank key this rank reads and writes."""
        return rank_key(_rank() if self.source_rank is None else self.source_rank)

    def state_dict(self) -> dict[str, Any]:
        """``{rank_key: inner state}`` (the inner state alone while loading an unkeyed layout)."""
        inner = self.inner.state_dict()
        return {self.key(): inner} if self.keyed else inner

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hand this rank's (or the source rank's) stored state to the inner Stateful, unless
        `discard` says that state does not apply to this run (the inner one stays as it is)."""
        if not self.discard:
            self.inner.load_state_dict(state_dict[self.key()] if self.keyed else state_dict)


class RNGStreams:
    """Python, NumPy, torch CPU and CUDA RNG states of this process."""

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of every generator, as tensors and plain values."""
        version, mt_state, gauss = random.getstate()
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
        if not isinstance(np_keys, np.ndarray):
            raise InvalidTypeError("numpy's legacy RNG state has an unexpected layout")
        state: dict[str, Any] = {
            "python": {
                "version": int(version),
                "state": torch.tensor(mt_state, dtype=torch.int64),
                "gauss": gauss,
            },
            "numpy": {
                "name": str(np_name),
                "keys": torch.from_numpy(np_keys.astype(np.int64)),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "gauss": float(np_gauss),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore every generator from a snapshot made by `state_dict`."""
        python = state["python"]
        random.setstate(
            (python["version"], tuple(int(v) for v in python["state"].tolist()), python["gauss"])
        )
        numpy_state = state["numpy"]
        np.random.set_state(
            (
                numpy_state["name"],
                numpy_state["keys"].numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["gauss"],
            )
        )
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            saved = [state["cuda"][str(i)] for i in range(len(state["cuda"]))]
            torch.cuda.set_rng_state_all(saved[: torch.cuda.device_count()])


class RNGState(PerRankState):
    """Every RNG of this rank (`RNGStreams`), saved under ``rank_<r>`` (always keyed)."""

    def __init__(self) -> None:
        super().__init__(RNGStreams())


class ResumableSampler(Sampler[SampleKey]):
    """Shuffles `length` indices per epoch from `seed` and resumes mid-epoch.

    A DataLoader prefetches indices ahead of what the loop has consumed, so the sampler cannot
    know the position by itself: iterate the loader through `track_batches`, which counts each
    batch the loop actually received and rolls the epoch over at the end.

    The indices are `SampleKey` ints carrying their epoch, so that a `SeededDataset` can seed
    each sample's randomness in the worker that produces it.
    """

    def __init__(self, length: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if length < 0:
            raise InvalidArgumentError("ResumableSampler length must be non-negative")
        self.length = length
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.consumed = 0

    def order(self, epoch: int) -> list[int]:
        """The index order of an epoch."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[SampleKey]:
        epoch = self.epoch
        return (SampleKey(i, epoch) for i in self.order(epoch)[self.consumed :])

    def __len__(self) -> int:
        return self.length - self.consumed

    def state_dict(self) -> dict[str, Any]:
        """Seed, epoch and samples consumed in this epoch."""
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the saved epoch and position."""
        if int(state_dict["seed"]) != self.seed:
            raise InvalidArgumentError(
                f"sampler seed {self.seed} differs from the checkpoint's {state_dict['seed']}"
            )
        self.epoch = int(state_dict["epoch"])
        self.consumed = int(state_dict["consumed"])


def find_resumable_sampler(loader: DataLoader) -> ResumableSampler | None:
    """The ResumableSampler driving a plain DataLoader, directly or inside its batch sampler."""
    for candidate in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(candidate, ResumableSampler):
            return candidate
    return None


def track_batches(loader: DataLoader) -> Iterator[Any]:
    """Iterate one epoch of a ResumableSampler-driven DataLoader, counting what was consumed."""
    sampler = find_resumable_sampler(loader)
    if sampler is None:
        raise InvalidTypeError(
            "track_batches needs a DataLoader whose sampler is a ResumableSampler"
        )
    batch_size: int = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None) or 1
    for batch in loader:
        sampler.consumed = min(sampler.length, sampler.consumed + batch_size)
        yield batch
    sampler.epoch += 1
    sampler.consumed = 0


class DataLoaderState:
    """Adapter for a plain DataLoader driven by a ResumableSampler.

    Its state is the sampler's position plus the loader's randomness record (see
    `spotckpt.loader_rng`): the base seed a new iterator draws, from the global RNG when the
    loader has no ``generator=``, is drawn again as it was, not from the restored stream.
    """

    def __init__(self, loader: DataLoader, sampler: ResumableSampler) -> None:
        self.sampler = sampler
        self.randomness = loader_randomness(loader)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position and the loader's randomness record."""
        return {**self.sampler.state_dict(), RECORD_KEY: self.randomness.state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the sampler; replay the loader's draws at its next iterator."""
        saved = dict(state_dict)
        record = saved.pop(RECORD_KEY, None)
        if record is not None:
            self.randomness.restore(record)
        self.sampler.load_state_dict(saved)


ITERATION_KEY = "_spotckpt_iteration"
"""An Accelerate-prepared loader's epoch counter, in its state."""

ADDED_LOADER_KEYS = (RECORD_KEY, ITERATION_KEY)
"""Keys spotckpt adds to a data loader's state; checkpoints of earlier releases lack them."""


def is_added_loader_key(fqn: str) -> bool:
    """Whether a flattened state key is one spotckpt adds to a data loader's state (its
    randomness record, Accelerate's epoch count): a checkpoint of an earlier release has none,
    and the loader then keeps what it offered, its own."""
    return fqn.endswith(tuple(f".{key}" for key in ADDED_LOADER_KEYS))


class PreparedLoaderState:
    """Adapter for a loader Accelerate prepared (a wrapper around a StatefulDataLoader).

    Its ``state_dict()`` is a snapshot Accelerate takes as it yields each batch, and before the
    first one, the snapshot it took in ``prepare``: before `loader_randomness` was installed,
    so without the randomness record. A restore loads only the keys the restoring loader offers,
    and a freshly prepared loader offers that first snapshot: the record is added where missing,
    or a resume in epoch 1 or later would shuffle as epoch 0 did. The snapshot also lacks the
    loader's ``iteration`` (its epoch count), which each ``iter()`` hands to ``set_epoch`` of the
    dataset (a `SeededDataset`) or sampler; it is stored beside, or a resumed epoch would be
    seeded as epoch 0.
    """

    def __init__(self, loader: Any, randomness: LoaderRandomness) -> None:
        self.loader = loader
        self.randomness = randomness

    def state_dict(self) -> dict[str, Any]:
        """Accelerate's snapshot, with the randomness record it holds (or the current one) and
        the epoch count the next ``iter()`` is to use."""
        state = dict(self.loader.state_dict())
        state.setdefault(RECORD_KEY, self.randomness.state())
        state[ITERATION_KEY] = self._next_iteration(bool(state.get("_iterator_finished")))
        return state

    def _next_iteration(self, finished: bool) -> int:
        """The epoch count of the epoch a restored loader continues, or starts.

        Accelerate counts an epoch (``iteration += 1``) only when the loop asks for a batch past
        the last one, and marks its snapshot finished as it yields the last batch. A save made
        in that last batch's step (the loop has not asked yet, or breaks there) restores a
        finished snapshot, whose next ``iter()`` starts the next epoch: it is seeded with the
        count the uninterrupted run reaches when it asks, one more. The loader is among its
        gradient state's active loaders until then.
        """
        iteration = int(getattr(self.loader, "iteration", 0))
        references = getattr(
            getattr(self.loader, "gradient_state", None), "dataloader_references", ()
        )
        in_its_epoch = any(reference is self.loader for reference in references)
        return iteration + 1 if finished and in_its_epoch else iteration

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hand the state to the prepared loader (which passes the record to the wrapped one)."""
        state = dict(state_dict)
        iteration = state.pop(ITERATION_KEY, None)
        if iteration is not None:
            self.loader.iteration = int(iteration)
        self.loader.load_state_dict(state)


class ShieldedWorkerInit:
    """A DataLoader ``worker_init_fn`` that shields workers from preemption signals until released.

    torchrun (which signals its workers' whole process group), SLURM and ``kill -- -PGID``
    deliver SIGTERM to data-loader workers too; their default reaction is to die, and the trainer
    then fails with "DataLoader worker is killed by signal" before it can save. A shielded worker
    ignores those signals while the trainer saves. Once released (after an emergency save
    commits, and always when the trainer process exits) the next such signal ends the worker with
    status 0, so the DataLoader's and multiprocessing's shutdown, which terminate workers with
    SIGTERM, cannot hang on a worker that ignores it. Status 0, not death by the signal (torch's
    own worker handler does the same for its parent's SIGTERM): Python runs a handler when the
    worker is next scheduled, so the group's signal, sent while shielded, can be handled after the
    release, and a worker dead of it would fail the trainer's exit with "DataLoader worker is
    killed by signal".

    The release flag lives in shared memory inherited by the workers, so it works with fork,
    spawn and forkserver loaders alike.
    """

    def __init__(self, original: Any, signals: tuple[int, ...]) -> None:
        self.original = original
        self.signals = signals
        self.released = multiprocessing.RawValue("b", 0)
        _RELEASE_FLAGS.append(self.released)

    def __call__(self, worker_id: int) -> None:
        for signum in self.signals:
            signal.signal(signum, self._on_signal)
        if self.original is not None:
            self.original(worker_id)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in a worker: ignore while shielded, otherwise end at once (see the class's note).
        if self.released.value:
            os._exit(0)


_RELEASE_FLAGS: list[Any] = []
"""Every shield's flag, held strongly: a shield freed before exit must still release its workers
(they keep the flag's shared memory mapped and would ignore SIGTERM forever)."""


def release_worker_shields() -> None:
    """Release every data-loader worker shield of this process (see `ShieldedWorkerInit`)."""
    for flag in _RELEASE_FLAGS:
        flag.value = 1


def _shut_down_workers_at_exit() -> None:
    """Release the shields and shut down every live multi-worker loader iterator, in order.

    multiprocessing's exit hook terminates live workers with SIGTERM, and the DataLoader's SIGCHLD
    handler then raises "DataLoader worker is killed by signal" inside that hook (a traceback at
    every preempted exit). So first each live iterator shuts its workers down the normal way, as
    the DataLoader does when an iterator is freed: a stop message to each, then a join. They are
    found among all objects, not collected: an iterator kept alive only by a reference cycle (a
    frame held by a traceback is enough) and freed by the collector has its queues' feeder threads
    closed (their finalizers run before the iterator's own) before its shutdown sends the stop
    messages, which then never arrive, and each worker costs a 5 s join timeout: an exit past
    a launcher's kill deadline turns a preempted job's status 75 into a SIGKILL.
    """
    release_worker_shields()
    if not _RELEASE_FLAGS:
        return  # spotckpt shielded no multi-worker loader in this process
    for iterator in [o for o in gc.get_objects() if issubclass(type(o), _BaseDataLoaderIter)]:
        shut_down = getattr(iterator, "_shutdown_workers", None)  # a multi-worker iterator's
        if not callable(shut_down) or getattr(iterator, "_shutdown", True):
            continue
        try:
            shut_down()
        except Exception as error:  # at exit: report, and let the other loaders shut down
            log.warning("could not shut down a data loader's workers at exit: %s", error)


# Registered after multiprocessing's own exit hook (imported above), so it runs first.
atexit.register(_shut_down_workers_at_exit)


def shield_workers(
    loader: Any, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)
) -> None:
    """Install `ShieldedWorkerInit` on a DataLoader (once), keeping its own worker_init_fn.

    An iterator torchdata started for a ``state_dict()`` before the shield (Accelerate's
    ``prepare`` asks for one) has unshielded workers: it is discarded, unused.
    """
    current = getattr(loader, "worker_init_fn", None)
    if getattr(loader, "num_workers", 0) > 0 and not isinstance(current, ShieldedWorkerInit):
        loader.worker_init_fn = ShieldedWorkerInit(current, signals)
        discard_unused_iterator(loader)


def dataloader_stateful(loader: Any) -> Stateful:
    """The Stateful for a data loader: its own (StatefulDataLoader) or its ResumableSampler's.

    Either way the loader's randomness is recorded and replayed (`spotckpt.loader_rng`), so a
    loader with or without ``generator=``, with any sampler, resumes the cut epoch exactly.
    """
    base = getattr(loader, "base_dataloader", None)  # Accelerate's prepared loaders wrap one
    if base is not None and not hasattr(base, "state_dict"):
        raise InvalidTypeError(
            f"{type(loader).__name__} wraps a plain DataLoader, which cannot be resumed: pass "
            "dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True) to the "
            "Accelerator"
        )
    if isinstance(loader, DataLoader) and not hasattr(loader, "load_state_dict"):
        sampler = find_resumable_sampler(loader)
        if sampler is None:
            raise InvalidTypeError(
                "a plain DataLoader cannot be resumed: give it a spotckpt ResumableSampler, or "
                "use torchdata's StatefulDataLoader"
            )
        stateful: Stateful = DataLoaderState(loader, sampler)
    elif base is not None:
        stateful = PreparedLoaderState(loader, loader_randomness(base))
    elif isinstance(loader, Stateful):
        loader_randomness(loader)
        stateful = loader
    else:
        raise InvalidTypeError(f"{type(loader).__name__} has no state_dict()/load_state_dict()")
    shield_workers(base if base is not None else loader)  # the workers are the wrapped loader's
    return stateful


class ValuesState:
    """The step and the extras; restored in place into the given dict.

    Extras may hold what `spotckpt.values` stores (plain values, numpy, datetimes, BytesIO,
    allow-listed Enums, nested in lists, tuples and dicts); anything else fails the save.
    """

    def __init__(self, extra: dict[str, Any]) -> None:
        self.extra = extra
        self.step = -1

    def state_dict(self) -> dict[str, Any]:
        """Step and extras."""
        return {"step": self.step, "extra": dict(self.extra)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step and update the extras dict (and the dicts nested in it) in place."""
        self.step = int(state_dict["step"])
        _merge_into(self.extra, state_dict["extra"])


def _merge_into(target: Any, loaded: Any) -> Any:
    """`loaded`, written into `target` in place where both are dicts (so references stay live)."""
    if not (isinstance(target, dict) and isinstance(loaded, dict)):
        return loaded
    for key, value in loaded.items():
        target[key] = _merge_into(target.get(key), value)
    return target


class TrainState:
    """Model(s), optimizer(s), scheduler(s), scaler, data loader, RNGs, step and extras.

    Pass single objects or dicts of named objects for `model`, `optimizer` and `scheduler`.
    Optimizers are matched to the model they were built for (the single model, or the model of
    the same name). Restored in place by `CheckpointManager.restore`.
    """

    def __init__(
        self,
        *,
        model: nn.Module | Mapping[str, nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        dataloader: Any = None,
        extra: dict[str, Any] | None = None,
        rng: bool = True,
        strict: bool = True,
    ) -> None:
        self.models = _named(model, "model")
        self.optimizers = _named(optimizer, "optimizer")
        self.schedulers = _named(scheduler, "scheduler")
        self.scaler = scaler
        self.dataloader = dataloader
        self.extra = extra if extra is not None else {}
        self.values = ValuesState(self.extra)
        self.rng = RNGState() if rng else None
        self.strict = strict
        self._parts = self._build_parts()

    @property
    def step(self) -> int:
        """The step of the last save or restore (-1 before either)."""
        return self.values.step

    def _build_parts(self) -> dict[str, Stateful]:
        parts: dict[str, Stateful] = {}
        for name, model in self.models.items():
            parts[f"model.{name}" if len(self.models) > 1 else "model"] = ModelState(
                model, strict=self.strict
            )
        for name, optimizer in self.optimizers.items():
            model = self._model_for(name)
            key = f"optimizer.{name}" if len(self.optimizers) > 1 else "optimizer"
            parts[key] = OptimizerState(model, optimizer)
        for name, scheduler in self.schedulers.items():
            parts[f"scheduler.{name}" if len(self.schedulers) > 1 else "scheduler"] = _stateful(
                scheduler, "scheduler"
            )
        if self.scaler is not None:
            parts["scaler"] = _stateful(self.scaler, "scaler")
        if self.dataloader is not None:
            parts["dataloader"] = PerRankState(dataloader_stateful(self.dataloader))
        if self.rng is not None:
            parts[RNG_KEY] = self.rng
        parts["train"] = PerRankState(self.values)
        return parts

    def _model_for(self, optimizer_name: str) -> nn.Module:
        if optimizer_name in self.models:
            return self.models[optimizer_name]
        if len(self.models) == 1:
            return next(iter(self.models.values()))
        raise InvalidArgumentError(
            f"optimizer {optimizer_name!r} needs a model of the same name (models: "
            f"{sorted(self.models)})"
        )

    def parts(self, step: int | None = None) -> dict[str, Stateful]:
        """The Stateful parts DCP saves or loads, by top-level key; sets the step if given."""
        if step is not None:
            self.values.step = step
        return dict(self._parts)

    @contextlib.contextmanager
    def restoring(
        self, step: int, saved_world: int, rank: int, world: int, stored: Iterable[str] = ()
    ) -> Iterator[None]:
        """Around a load of `step` saved by `saved_world` ranks into rank `rank` of `world`.

        Every per-rank part (RNG streams, data-loader position and randomness, step and extras)
        is read from this rank's own key; on another world size rank r reads saved rank
        ``r % saved_world``'s, whole (never a mix of ranks). `stored` are the checkpoint's keys:
        a part stored without rank keys (by an earlier release) is read from its one copy.
        `step` becomes this state's step only when the load succeeded.
        """
        present: set[str] = set()
        keyed: set[str] = set()
        for fqn in stored:
            top = fqn.split(".", 1)[0]
            present.add(top)
            if is_per_rank_key(fqn):
                keyed.add(top)
        per_rank = {k: p for k, p in self.parts().items() if isinstance(p, PerRankState)}
        for name, part in per_rank.items():
            part.source_rank = None if saved_world == world else rank % saved_world
            part.keyed = isinstance(part, RNGState) or name in keyed or name not in present
        loader = per_rank.get("dataloader")
        if loader is not None and saved_world != world:
            loader.discard = _splits_by_rank(self.dataloader)
            if loader.discard:
                log.warning(
                    "step %d was saved by %d ranks and restores on %d: the data loader's "
                    "DistributedSampler deals each rank another share of the data, so its "
                    "position does not carry over and the cut epoch starts again from its first "
                    "batch on every rank",
                    step,
                    saved_world,
                    world,
                )
        try:
            yield
        finally:
            for part in per_rank.values():
                part.source_rank = None
                part.keyed = True
                part.discard = False
        self.values.step = step


State = TrainState | Mapping[str, Any]
"""What a manager saves and restores: a `TrainState`, or a plain dict of state."""


def _splits_by_rank(loader: Any) -> bool:
    """Whether the loader's sampler is a DistributedSampler, whose share of an epoch depends on
    the number of ranks (its position on one world size means other samples on another)."""
    samplers = [getattr(loader, "sampler", None)]
    samplers.append(getattr(getattr(loader, "batch_sampler", None), "sampler", None))
    return any(isinstance(sampler, DistributedSampler) for sampler in samplers)


def _named(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    return {what: value}


def _stateful(value: Any, what: str) -> Stateful:
    if not isinstance(value, Stateful):
        raise InvalidTypeError(
            f"{what} {type(value).__name__} has no state_dict()/load_state_dict()"
        )
    return value


class EncodedStateful:
    """A Stateful whose non-tensor values are encoded on save and decoded on load.

    See `spotckpt.values`: a value with no safe encoding fails `state_dict` with an
    UnsupportedValueError naming its key path (under `path`, the part's top-level key).
    """

    def __init__(self, inner: Stateful, path: str) -> None:
        self.inner = inner
        self.path = path

    def state_dict(self) -> dict[str, Any]:
        """The inner state with every value encoded; tensors are the inner ones, not copies."""
        encoded: dict[str, Any] = encode(self.inner.state_dict(), self.path)
        return encoded

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Decode the loaded values, then hand them to the inner Stateful."""
        self.inner.load_state_dict(decode(state_dict, self.path))


def as_dcp_state(state: TrainState | Mapping[str, Any], step: int | None = None) -> dict[str, Any]:
    """The dict DCP saves or loads for a TrainState or a user dict.

    In a user dict, modules and optimizers are wrapped like TrainState does (optimizers need the
    dict's single module); tensors pass through. Every Stateful becomes an `EncodedStateful`, and
    every other value is encoded by `spotckpt.values.encode` (which refuses what cannot restore).
    """
    if isinstance(state, TrainState):
        return {key: EncodedStateful(part, key) for key, part in state.parts(step).items()}
    if not isinstance(state, Mapping):
        raise InvalidTypeError(f"state must be a TrainState or a dict, got {type(state).__name__}")
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    converted: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            converted[key] = EncodedStateful(ModelState(value), str(key))
        elif isinstance(value, torch.optim.Optimizer):
            if len(modules) != 1:
                raise InvalidArgumentError(
                    f"optimizer {key!r} needs exactly one model in the same dict (found "
                    f"{len(modules)}); use TrainState for several"
                )
            converted[key] = EncodedStateful(OptimizerState(modules[0], value), str(key))
        elif is_stateful(value):
            converted[key] = EncodedStateful(value, str(key))
        else:
            converted[key] = encode(value, str(key))
    return converted


def write_back(state: TrainState | Mapping[str, Any], loaded: dict[str, Any]) -> None:
    """Decode the loaded plain values (ints, strings, numpy, ...) into the caller's dict.

    DCP loads tensors in place but replaces non-tensor values in the dict it was given, which
    for a user dict is the encoded copy made by `as_dcp_state`; nested dicts of the caller's
    are updated in place.
    """
    if isinstance(state, TrainState) or not isinstance(state, MutableMapping):
        return
    for key, value in loaded.items():
        if isinstance(value, EncodedStateful):
            continue
        restored = _merge_into(state.get(key), decode(value, str(key)))
        if state.get(key) is not restored:
            state[key] = restored
