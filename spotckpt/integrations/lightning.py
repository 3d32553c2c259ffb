"""PyTorch Lightning: `SpotckptCallback` makes a `Trainer` survive spot eviction.

    from spotckpt.integrations.lightning import SpotckptCallback

    trainer = Trainer(callbacks=[SpotckptCallback("s3://bucket/runs/exp1", interval_steps=500)])
    trainer.fit(model, datamodule)   # resumes from the latest committed checkpoint, if any

What is saved is the full Lightning checkpoint, as ``Trainer`` dumps it for a ``.ckpt`` file:
the LightningModule's parameters and buffers and every optimizer's state go through `TrainState`
(DCP tensors, optimizer state keyed by parameter name, so nothing depends on how a serializer
treats the optimizer's integer keys); everything else (loops and their progress, including a
stateful data loader's position; LR schedulers; callbacks' state; the precision plugin; the
datamodule's state; what ``on_save_checkpoint`` hooks add) is one value, encoded by
`spotckpt.values` and serialized whole, so every key and value keeps its exact type; plus this
rank's RNGs. Hyper-parameters are left out: the restarted script builds its own module.

At fit start the latest committed checkpoint is restored through Lightning's own restore steps
(module and datamodule hooks, callbacks, precision plugin, loops, optimizers, schedulers); it
takes precedence over ``fit(ckpt_path=...)``, which then only seeds a run that has none. After
each optimizer step the callback calls `CheckpointManager.maybe_save` with ``trainer.global_step``.
On a preemption notice (SIGTERM, SIGUSR1, a cloud notice) it saves that step, stops the trainer
and ends the process with `spotckpt.PREEMPTED_EXIT_CODE` (75): started again, the same command
continues bit for bit. When training ends, the last step is saved too.

For an exact mid-epoch resume, train from a torchdata ``StatefulDataLoader`` (Lightning stores
its position in the loop state), with any sampler and with or without ``generator=``: the
callback has the training loaders record the generators each epoch's iterator draws from
(`spotckpt.loader_rng`), so a resumed epoch is shuffled and seeded as the cut one was.

Lightning stops a run by itself on SIGTERM (at the end of the batch, or of an epoch or a
validation batch); a signal that lands after this callback's check of a batch is handled there:
the state, still that of a completed optimizer step, is saved and the exit status becomes 75.
"""

from __future__ import annotations

import functools
import io
import logging
import signal
import threading
import warnings
import weakref
from typing import Any

import torch

from spotckpt import PREEMPTED_EXIT_CODE
from spotckpt.errors import CheckpointError
from spotckpt.extras import missing_extra
from spotckpt.loader_rng import loader_randomness
from spotckpt.manager import CheckpointManager
from spotckpt.state import PerRankState, TrainState, shield_workers
from spotckpt.values import decode, encode, load_plain

try:
    import lightning.pytorch as pl
except ImportError as missing:  # only the standalone package is installed, or none
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError:
        raise missing_extra("lightning", "spotckpt.integrations.lightning", missing) from None

log = logging.getLogger("spotckpt")

CHECKPOINT_KEY = "lightning"
"""The top-level key of the Lightning checkpoint's non-tensor part in the stored state."""

_OWN_PARTS = ("state_dict", "optimizer_states")
"""Checkpoint entries that `TrainState` stores as tensors and that are rebuilt on restore."""

_LEFT_OUT = tuple(
    getattr(owner, f"CHECKPOINT_HYPER_PARAMS_{what}")
    for owner in (pl.LightningModule, pl.LightningDataModule)
    for what in ("KEY", "NAME", "TYPE")
)
"""Hyper-parameter entries: not needed to resume, and free to hold any Python object."""


def _connector(trainer: pl.Trainer) -> Any:
    """Lightning's checkpoint connector: the one place that dumps and restores a checkpoint."""
    return trainer._checkpoint_connector


def pack_checkpoint(checkpoint: dict[str, Any]) -> bytes:
    """The checkpoint, encoded (or refused) by `spotckpt.values`, serialized as one blob."""
    buffer = io.BytesIO()
    torch.save(encode(checkpoint, CHECKPOINT_KEY), buffer)
    return buffer.getvalue()


def unpack_checkpoint(data: bytes) -> dict[str, Any]:
    """The inverse of `pack_checkpoint`; loads with ``torch.load(weights_only=True)`` only."""
    unpacked: dict[str, Any] = decode(load_plain(data, CHECKPOINT_KEY), CHECKPOINT_KEY)
    return unpacked


class TrainerCheckpoint:
    """The Lightning checkpoint minus model and optimizer tensors, as a DCP Stateful.

    `state_dict` dumps the trainer only when a save asks for it (so checkpoint hooks run at
    saves, not at every step); while `restoring`, it offers DCP an empty slot to load into.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.restoring = False
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """``{"blob": bytes}``: the packed checkpoint (``None`` while restoring)."""
        if self.restoring:
            return {"blob": None}
        checkpoint = _connector(self.trainer).dump_checkpoint(weights_only=False)
        for key in (*_OWN_PARTS, *_LEFT_OUT):
            checkpoint.pop(key, None)
        return {"blob": pack_checkpoint(checkpoint)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the unpacked checkpoint for `SpotckptCallback` to hand to Lightning."""
        self.loaded = unpack_checkpoint(state_dict["blob"])


class LightningTrainState(TrainState):
    """`TrainState` of a trainer: its LightningModule, optimizers, RNGs and `TrainerCheckpoint`."""

    def __init__(self, trainer: pl.Trainer) -> None:
        optimizers = {str(index): opt for index, opt in enumerate(trainer.optimizers)}
        super().__init__(model=trainer.lightning_module, optimizer=optimizers or None)
        self.checkpoint = TrainerCheckpoint(trainer)
        self._checkpoint_part = PerRankState(self.checkpoint)

    def parts(self, step: int | None = None) -> dict[str, Any]:
        """TrainState's parts plus the Lightning checkpoint under `CHECKPOINT_KEY`, per rank.

        The checkpoint holds this rank's loop state, loader positions and randomness records,
        which differ by rank: keyed by rank, each rank gets its own back.
        """
        return {**super().parts(step), CHECKPOINT_KEY: self._checkpoint_part}


class SpotckptCallback(pl.callbacks.Checkpoint):
    """Restore at fit start, save every `interval_steps` and on preemption (then exit 75).

    As a `Checkpoint` callback it runs after the other callbacks, so that a save includes what
    they did in the same batch; the Trainer then adds no default ``ModelCheckpoint`` (add one
    for ``.ckpt`` files) and needs ``enable_checkpointing=True`` (its default).

    `uri` and `manager_options` are `CheckpointManager`'s arguments (`interval_steps`,
    `keep_last`, `async_save`, `storage_options`, ...); what is not given comes from
    ``SPOTCKPT_*`` variables and ``spotckpt.toml`` (a missing `uri` from ``SPOTCKPT_URI``), as
    for every manager. The manager is created when fitting starts (after Lightning has set up
    the process group) as `manager`, and closed when fitting ends.
    """

    def __init__(self, uri: str | None = None, **manager_options: Any) -> None:
        self.uri = uri
        self.options = manager_options
        self.manager: CheckpointManager | None = None
        self._state: LightningTrainState | None = None
        self._step = 0  # global step of the last optimizer step seen
        self._saved: int | None = None  # last step saved or restored
        self._at_step_end = True  # the state is that of a completed optimizer step
        self._sigterm_handler: Any = None  # the watcher's, installed by the manager in setup

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Open the manager (and its preemption watcher) for a fit."""
        if stage == "fit":
            self.manager = CheckpointManager(self.uri, **self.options)
            self._sigterm_handler = signal.getsignal(signal.SIGTERM)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """On several ranks, take SIGTERM back from Lightning: the watcher alone handles it.

        Lightning's own SIGTERM handler broadcasts from inside the handler, on every rank and
        for every signal, at whatever point each rank is interrupted (a launcher that forwards
        SIGTERM and a torchrun agent that sends its own make two on some ranks): broadcasts
        that pair with the wrong collective and hang the job; and in evaluation each rank
        stops on its own flag, one rank in the emergency save's collectives while another
        evaluates on. Put back, the watcher's handler only flags the notice; the ranks agree on
        it at the next optimizer step's `maybe_save` (`CheckpointManager`'s rule), save that
        step together and exit with 75. A single process keeps Lightning's handler, which then
        makes no collective and stops at the next batch; the callback saves in `on_exception`.
        """
        if (
            trainer.world_size > 1
            and self._sigterm_handler is not None
            and threading.current_thread() is threading.main_thread()
        ):
            signal.signal(signal.SIGTERM, self._sigterm_handler)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Restore the latest committed checkpoint into the trainer, if there is one."""
        manager = self._manager()
        loaders = _TrainingLoaders(trainer)
        self._state = LightningTrainState(trainer)
        self._state.checkpoint.restoring = True
        try:
            step = manager.restore(self._state)
        finally:
            self._state.checkpoint.restoring = False
        self._step, self._saved, self._at_step_end = trainer.global_step, step, True
        loaded = self._state.checkpoint.loaded
        if step is None or loaded is None:
            log.info("no committed checkpoint under %s: training from the start", manager.uri)
            return
        self._state.checkpoint.loaded = None
        loaders.epoch_ended_at_restore = _restore_trainer(trainer, loaded)
        self._step = trainer.global_step
        log.info("resumed from step %d (%s)", step, manager.uri)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """From here until the batch's optimizer step the state is not one to save."""
        self._at_step_end = False

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """After an optimizer step: save if due or preempted; after a preemption save, exit."""
        step = trainer.global_step
        self._at_step_end = step != self._step
        if not self._at_step_end:
            return  # gradients are being accumulated: no step to save yet
        self._step = step
        self._maybe_save(step)
        manager = self._manager()
        if step == trainer.max_steps and self._saved != step and self._state is not None:
            # The last step is saved here, where the loops' counters are those of a step within
            # its epoch: saved in on_train_end, they say the epoch is over, and a later fit
            # with more steps would start the next epoch instead of finishing this one.
            manager.wait()
            manager.save(step, self._state)
            self._saved = step
        if manager.should_stop():
            raise SystemExit(PREEMPTED_EXIT_CODE)  # on_exception logs it and closes the manager

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save the last step, unless it is saved already."""
        manager = self._manager()
        manager.wait()
        if self._saved != trainer.global_step and self._state is not None:
            manager.save(trainer.global_step, self._state)
            self._saved = trainer.global_step

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Lightning stopped the run (on SIGTERM it does so by itself): save, exit with 75."""
        try:
            if isinstance(exception, SystemExit) and self.manager is not None:
                self._stopped(trainer, exception)
        finally:
            self._close()

    def _stopped(self, trainer: pl.Trainer, exception: SystemExit) -> None:
        step = trainer.global_step
        if self._at_step_end and self._saved != step:
            self._maybe_save(step)
        manager = self._manager()
        noticed = manager.watcher is not None and manager.watcher.preempted
        if manager.should_stop() or noticed or trainer.received_sigterm:
            log.warning(
                "preempted: the run resumes after step %s; exiting with status %d",
                self._saved,
                PREEMPTED_EXIT_CODE,
            )
            exception.code = PREEMPTED_EXIT_CODE

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the manager: wait for uploads in flight, stop the preemption watcher."""
        if stage == "fit":
            self._close()

    def _maybe_save(self, step: int) -> None:
        if self._state is not None and self._manager().maybe_save(step, self._state):
            self._saved = step

    def _manager(self) -> CheckpointManager:
        if self.manager is None:
            raise CheckpointError("SpotckptCallback is used outside Trainer.fit")
        return self.manager

    def _close(self) -> None:
        manager, self.manager, self._state = self.manager, None, None
        if manager is not None:
            manager.close()


_ORIGINAL = "spotckpt_original"
"""The attribute of spotckpt's wrapper of a Lightning method that holds Lightning's own."""


class _TrainingLoaders:
    """What spotckpt does to the fit loop's training loaders when Lightning loads their states.

    Lightning builds the training loaders (re-creating them for a distributed sampler), loads
    their saved states and creates the first iterator in one step, with no hook in between but
    its fit loop's ``_load_combined_loader_states``, which runs right before that iterator. So
    there, once per fit, `spotckpt.loader_rng` is installed on the loaders (through the wrapped
    ``load_state_dict`` it takes the saved record back) and their workers are shielded; and when
    the restored step was an epoch's last batch, the restored iterators are ended without
    drawing (`_end_without_drawing`).
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.loop = trainer.fit_loop
        self.epoch_ended_at_restore = False
        load_states = getattr(self.loop, "_load_combined_loader_states", None)
        original = getattr(load_states, _ORIGINAL, load_states)  # a later fit re-wraps Lightning's
        if not callable(original):
            warnings.warn(
                "this Lightning version has no fit_loop._load_combined_loader_states: the data "
                "order of a resumed epoch may differ from the uninterrupted run's",
                stacklevel=3,
            )
            return
        wrapped = functools.partial(self._install_then_load, original)
        setattr(wrapped, _ORIGINAL, original)
        self.loop._load_combined_loader_states = wrapped  # type: ignore[method-assign]
        _shield_evaluation_workers(self.loop.epoch_loop.val_loop)

    def _install_then_load(self, original: Any) -> None:
        combined = self.loop._combined_loader
        loaders = [] if combined is None else combined.flattened
        # the epoch Lightning's fit loop gives set_epoch: a _ProcessedTracker, typed as its base
        epoch = self.loop.epoch_progress.current.processed  # type: ignore[attr-defined]
        for loader in loaders:
            if hasattr(loader, "_get_iterator"):
                loader_randomness(loader)
            shield_workers(loader)
            _set_sampler_epoch(loader, epoch)
            _warn_of_a_wrapped_sampler(loader)
        original()
        if self.epoch_ended_at_restore:
            self.epoch_ended_at_restore = False
            for loader in loaders:
                _end_without_drawing(loader)


def _warn_of_a_wrapped_sampler(loader: Any) -> None:
    """Warn when Lightning wrapped the loader's sampler in its ``DistributedSamplerWrapper``.

    On several ranks Lightning replaces torch's ``RandomSampler`` with a ``DistributedSampler``
    (whose order is a function of the epoch: exact), but wraps any other sampler, torchdata's
    ``shuffle=True`` one among them. The wrapper draws the epoch's order as an iterator is made,
    and torchdata makes a restored iterator's index stream twice, so a resumed epoch is drawn
    twice and differs from the cut one.
    """
    if type(getattr(loader, "sampler", None)).__name__ == "DistributedSamplerWrapper":
        warnings.warn(
            "Lightning wrapped this loader's sampler in its DistributedSamplerWrapper: an epoch "
            "cut by a preemption resumes in another order. For an exact resume on several "
            "ranks, shuffle with torch.utils.data.RandomSampler(data, generator=...) (Lightning "
            "then uses its DistributedSampler) instead of shuffle=True",
            stacklevel=2,
        )


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Tell the loader's samplers the restored epoch before the restored iterator exists.

    Lightning sets a sampler's epoch at each epoch's start, but it creates the first iterator of
    a fit before that, and after a restart keeps that iterator for the restored epoch. A sampler
    whose order is a function of its epoch (the ``DistributedSampler`` Lightning puts in on
    several ranks) would then replay epoch 0's order into a later epoch. Lightning's own epoch
    setter is private; this one is the same rule: ``set_epoch`` on the loader's sampler and its
    batch sampler's sampler, each once.
    """
    samplers = [
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ]
    for index, sampler in enumerate(samplers):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch) and all(sampler is not s for s in samplers[:index]):
            set_epoch(epoch)


def _end_without_drawing(loader: Any) -> None:
    """Have the loader's next iterator (the restored one) end its epoch without drawing.

    After a save at an epoch's last batch, the uninterrupted run never asked that iterator for
    another batch (Lightning knows the epoch's length), but the resumed run asks it once, to end
    the epoch it restored into. A sampler draws as it ends (torch's ``RandomSampler`` draws a
    last, empty permutation from its generator), and that draw, which the uninterrupted run
    never made, would shift every later epoch's order. So the restored iterator gets an empty
    index stream: it ends at once and leaves the sampler untouched.
    """
    create = getattr(loader, "_get_iterator", None)
    if not callable(create):
        return
    owner = weakref.ref(loader)  # the loader holds this function until it runs: no cycle

    def create_ended() -> Any:
        held = owner()
        if held is not None:
            object.__setattr__(held, "_get_iterator", create)
        iterator = create()
        if hasattr(iterator, "_sampler_iter"):
            iterator._sampler_iter = iter(())
        return iterator

    object.__setattr__(loader, "_get_iterator", create_ended)


def _shield_evaluation_workers(loop: Any) -> None:
    """Shield the validation loaders' workers from preemption signals, as the training ones are.

    A SIGTERM to the process group during validation would otherwise kill them, and the fit
    would fail ("DataLoader worker ... is killed by signal") before the emergency save. The loop
    creates their iterator in ``reset``, right after it built the loaders, so the shields are
    installed there, once per fit.
    """
    reset = loop.reset
    if isinstance(reset, functools.partial):
        return

    def shield_then_reset(original: Any) -> None:
        combined = loop._combined_loader
        for loader in [] if combined is None else combined.flattened:
            shield_workers(loader)
        original()

    loop.reset = functools.partial(shield_then_reset, reset)


def _count_the_last_batch_once(checkpoint: dict[str, Any]) -> bool:
    """Restore a save made at the end of an epoch's last batch as one made within the epoch;
    True when the checkpoint was such a save.

    Lightning 2.x, restarting from such a save (its own ``ModelCheckpoint(every_n_train_steps)``
    makes them too), counts the epoch as finished in its fit loop's ``reset`` and again when the
    epoch ends: ``current_epoch`` comes back one too high, so a ``set_epoch`` seeded by it shuffles
    another order, and ``max_epochs`` ends the run an epoch early. Without the last-batch mark,
    the restored loader, which has nothing left in that epoch, ends it once, as the
    uninterrupted run did.
    """
    loops = checkpoint.get("loops")
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    progress = fit_loop.get("epoch_loop.batch_progress") if isinstance(fit_loop, dict) else None
    if isinstance(progress, dict) and progress.get("is_last_batch"):
        progress["is_last_batch"] = False
        return True
    return False


def _restore_trainer(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """Hand a checkpoint to Lightning's own restore steps, as ``fit(ckpt_path=...)`` would; True
    when it was saved at an epoch's last batch.

    The module and optimizers already hold the restored tensors: their entries are rebuilt from
    them, with the key types torch itself uses.
    """
    strategy = trainer.strategy
    epoch_ended = _count_the_last_batch_once(checkpoint)
    checkpoint["state_dict"] = strategy.lightning_module_state_dict()
    checkpoint["optimizer_states"] = [strategy.optimizer_state(o) for o in trainer.optimizers]
    connector = _connector(trainer)
    connector._loaded_checkpoint = checkpoint
    try:
        connector.restore_datamodule()
        connector.restore_model()
        connector.restore_callbacks()
        connector.restore_training_state()
    finally:
        connector._loaded_checkpoint = {}
    return epoch_ended
