"""`SpotckptCallback`: spot-safe checkpoints for the Hugging Face `transformers.Trainer`.

    spot = SpotckptCallback("s3://bucket/runs/exp1", interval_steps=200)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[spot])
    trainer.train(resume_from_checkpoint=spot.resume_from_checkpoint())

Saves: after each optimizer step the callback calls `CheckpointManager.maybe_save` with the
model, the optimizer, the LR scheduler, every RNG of this process and the `TrainerState`, at the
point where the Trainer's own save would happen (after that step's logging and evaluation, which
may draw random numbers). On a preemption notice that save is the emergency save; then training
stops and the process exits with status 75 (`spotckpt.PREEMPTED_EXIT_CODE`).

Resuming goes through the Trainer's own mechanism, so that it skips the batches already trained
on, in the right epoch, with the right gradient-accumulation grouping, exactly as when it resumes
from one of its own checkpoint folders. The Trainer only resumes from a local folder that holds
``trainer_state.json`` and the model weights, so `resume_from_checkpoint` writes one: the
weights (through `spotckpt.export.export_hf`) and the `TrainerState` (kept in the manifest's user
metadata, without the log history) of the step a restore would load. The Trainer's starting step
cannot change once it is fixed, so that step is chosen with every byte checked first
(`CheckpointManager.restorable_step`: a corrupt newer step is quarantined, as a restore does). Once
the Trainer has prepared its model and optimizer, `on_train_begin` restores the whole checkpoint in
place (model, optimizer, scheduler, RNGs, log history) and deletes the folder; the RNG states
are set again where the Trainer sets its own after skipping batches (before the first step of a
resumed epoch, or at the start of the epoch when resuming at an epoch boundary).

Importing this module imports `transformers`; ``import spotckpt`` does not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from spotckpt.extras import missing_extra

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import IntervalStrategy
except ImportError as missing:
    raise missing_extra("transformers", "spotckpt.integrations.transformers", missing) from missing

from spotckpt import PREEMPTED_EXIT_CODE
from spotckpt.errors import CheckpointError
from spotckpt.export import export_hf
from spotckpt.manager import CheckpointManager
from spotckpt.state import TrainState, shield_workers

log = logging.getLogger("spotckpt")

TRAINER_STATE_KEY = "trainer_state"
"""The user-metadata key under which each manifest keeps the `TrainerState` (no log history)."""
TRAINER_STATE_FILE = "trainer_state.json"  # the name the Trainer reads in a checkpoint folder


class SpotckptCallback(TrainerCallback):
    """Interval and emergency saves, and resumption, for `transformers.Trainer`.

    `uri` and `manager_options` (`interval_steps`, `keep_last`, `async_save`,
    `storage_options`, ...) are those of `CheckpointManager`: what is not given comes from
    ``SPOTCKPT_*`` variables and ``spotckpt.toml`` (a missing `uri` from ``SPOTCKPT_URI``), as
    for every manager. The manager is built when the Trainer is (after
    the distributed process group exists) and is available as `manager`. With
    `exit_on_preemption` (the default) the process exits with status 75 once the emergency save
    has committed; otherwise the Trainer stops and `preempted` is true.

    Give the Trainer ``save_strategy="no"`` unless its own checkpoints are wanted too.
    """

    def __init__(
        self, uri: str | None = None, *, exit_on_preemption: bool = True, **manager_options: Any
    ) -> None:
        self.uri = uri
        self.manager_options = manager_options
        self.exit_on_preemption = exit_on_preemption
        self.manager: CheckpointManager | None = None
        self.preempted = False
        self._args: TrainingArguments | None = None
        self._state: TrainState | None = None
        self._extra: dict[str, Any] = {"log_history": "[]"}  # JSON of TrainerState.log_history
        self._logged = 0  # length of the log history last encoded into `_extra`
        self._resume_step: int | None = None
        self._resume_folder: Path | None = None
        self._rng: dict[str, Any] | None = None
        self._rng_at = ""  # "epoch" or "step": where the restored RNG states are set again
        self._pending = False  # an optimizer step ended and was not offered to maybe_save yet
        self._awaits_evaluation = False  # the step is offered after its scheduled evaluation

    # Resuming ---------------------------------------------------------------------------

    def resume_from_checkpoint(self) -> str | None:
        """A local folder for ``trainer.train(resume_from_checkpoint=...)``; None on a fresh run.

        Call it after building the Trainer. The folder (under the Trainer's ``output_dir``)
        holds the model weights and the `TrainerState` of the newest committed checkpoint that
        checks out whole (a corrupt newer one is quarantined, with a warning); the rest of that
        checkpoint is restored in place when training begins, and the folder is deleted then.
        """
        args = self._args
        if args is None:
            raise CheckpointError("call resume_from_checkpoint() after building the Trainer")
        manager = self._manager()
        step = manager.restorable_step()
        if step is None:
            return None
        trainer_state = manager.read_manifest(step).user_metadata.get(TRAINER_STATE_KEY)
        if not isinstance(trainer_state, dict):
            raise CheckpointError(
                f"checkpoint step {step} in {manager.uri} has no {TRAINER_STATE_KEY!r} metadata: "
                "it was not written by SpotckptCallback"
            )
        parent = Path(args.output_dir or tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f"spotckpt-resume-{step}-", dir=parent))
        export_hf(manager.store, step, str(folder))
        (folder / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state))
        self._resume_step, self._resume_folder = step, folder
        log.info("checkpoint step %d staged in %s for the Trainer to resume from", step, folder)
        return str(folder)

    # Trainer events ---------------------------------------------------------------------

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Remember the arguments and build the manager."""
        self._args = args
        self._manager()

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Build the `TrainState` from the prepared objects; restore it when resuming."""
        self._args = args
        self._state = TrainState(
            model=kwargs["model"],
            optimizer=_unwrap_optimizer(kwargs["optimizer"]),
            scheduler=kwargs["lr_scheduler"],
            extra=self._extra,
        )
        loader = kwargs.get("train_dataloader")
        if loader is not None:  # Accelerate's wrapper iterates the DataLoader it holds
            shield_workers(getattr(loader, "base_dataloader", loader))
        manager = self._manager()
        if self._resume_step is None or state.global_step != self._resume_step:
            latest = manager.latest_step()
            if latest is not None:
                raise CheckpointError(
                    f"{manager.uri} holds checkpoint step {latest}, but this Trainer did not "
                    "resume from it: pass resume_from_checkpoint=callback."
                    "resume_from_checkpoint() to trainer.train(), or use another URI"
                )
            return
        self._restore(args, state, manager, self._resume_step)

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Set the restored RNG states again where the Trainer sets its own (epoch boundary); in
        an epoch resumed midway, tell the training dataset its epoch.

        The Trainer resumes an epoch through Accelerate's loader that skips the trained batches,
        whose ``set_epoch`` reaches the sampler but not the dataset: a `spotckpt.SeededDataset`
        would seed the rest of the epoch as epoch 0's samples.
        """
        if self._rng_at == "epoch":
            self._set_rng()
        elif self._rng_at == "step":
            loader = kwargs.get("train_dataloader")
            set_epoch = getattr(getattr(loader, "dataset", None), "set_epoch", None)
            if callable(set_epoch):
                set_epoch(int(state.epoch or 0))

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Set the restored RNG states again after the Trainer skipped the trained batches."""
        if self._rng_at == "step":
            self._set_rng()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Offer the step to `maybe_save` now, or after this step's logging and evaluation.

        The evaluation the Trainer adds after the last step (``max_steps`` reached off its
        evaluation schedule) is not waited for: a longer run, which a restart with more steps
        continues as, makes no evaluation there, and its draws from the RNGs must not be saved.
        """
        self._pending = True
        self._awaits_evaluation = control.should_evaluate and _evaluates_on_schedule(args, state)
        if not (control.should_log or self._awaits_evaluation):
            self._offer(state, control)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """The step's log entry is in the history: offer the step unless an evaluation follows."""
        if self._pending and not self._awaits_evaluation:
            self._offer(state, control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The step's evaluation is done: offer the step."""
        if self._pending:
            self._offer(state, control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """After the emergency save, no end-of-epoch evaluation or save: stop at once."""
        if self.preempted:
            control.should_save = control.should_evaluate = control.should_log = False

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Wait for uploads in flight and close the manager."""
        self._close()

    # Internals --------------------------------------------------------------------------

    def _manager(self) -> CheckpointManager:
        if self.manager is None:
            self.manager = CheckpointManager.from_config(uri=self.uri, **self.manager_options)
        return self.manager

    def _restore(
        self, args: TrainingArguments, state: TrainerState, manager: CheckpointManager, step: int
    ) -> None:
        train_state = self._state
        if train_state is None or train_state.rng is None:
            raise CheckpointError("SpotckptCallback: no state to restore into")
        manager.restore(train_state, step=step)
        state.log_history[:] = json.loads(self._extra["log_history"])
        self._logged = len(state.log_history)
        self._rng = train_state.rng.state_dict()
        resumes_mid_epoch = not args.ignore_data_skip and not float(state.epoch or 0).is_integer()
        self._rng_at = "step" if resumes_mid_epoch else "epoch"
        if self._resume_folder is not None:
            shutil.rmtree(self._resume_folder, ignore_errors=True)
        self._resume_folder = None

    def _set_rng(self) -> None:
        if self._state is not None and self._state.rng is not None and self._rng is not None:
            self._state.rng.load_state_dict(self._rng)
        self._rng, self._rng_at = None, ""

    def _offer(self, state: TrainerState, control: TrainerControl) -> None:
        """`maybe_save` this step (and save the last step in any case); stop when preempted."""
        self._pending = False
        manager, train_state = self._manager(), self._state
        if train_state is None:
            raise CheckpointError("SpotckptCallback: a step ended before training began")
        if len(state.log_history) != self._logged:
            self._extra["log_history"] = json.dumps(state.log_history)
            self._logged = len(state.log_history)
        step = state.global_step
        metadata = {TRAINER_STATE_KEY: _trainer_state_json(state)}
        saved = manager.maybe_save(step, train_state, user_metadata=metadata)
        if not saved and step >= state.max_steps:
            manager.save(step, train_state, user_metadata=metadata)
        if not manager.should_stop():
            return
        self.preempted = True
        control.should_training_stop = True
        control.should_save = control.should_evaluate = control.should_log = False
        log.warning("preempted: checkpoint of step %d committed; training stops", step)
        if self.exit_on_preemption:
            self._close()
            raise SystemExit(PREEMPTED_EXIT_CODE)

    def _close(self) -> None:
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.close()


def _evaluates_on_schedule(args: TrainingArguments, state: TrainerState) -> bool:
    """Whether the Trainer evaluates after this step by its ``eval_steps`` schedule, as its
    ``DefaultFlowCallback`` decides (which also evaluates once more after the last step)."""
    return (
        args.eval_strategy == IntervalStrategy.STEPS
        and bool(state.eval_steps)
        and state.global_step % state.eval_steps == 0
        and args.eval_delay <= state.global_step
    )


def _trainer_state_json(state: TrainerState) -> dict[str, Any]:
    """The `TrainerState` as ``trainer_state.json`` holds it, less the (growing) log history."""
    fields = {
        f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "log_history"
    }
    return json.loads(json.dumps(fields))


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper (whose step() is gated and scaled)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer
