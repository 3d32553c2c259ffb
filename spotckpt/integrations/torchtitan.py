"""torchtitan: a torchtitan job that checkpoints to a spotckpt URI and survives spot eviction.

    SPOTCKPT_URI=s3://bucket/runs/exp1 torchrun --nproc-per-node=8 \\
        -m spotckpt.integrations.torchtitan --job.config_file llama3_8b.toml

`SpotckptTrainer` is torchtitan's `Trainer` with its checkpointer replaced by
`SpotckptCheckpointManager`, a subclass of torchtitan's `CheckpointManager` whose ``save``,
``load`` and ``close`` go to a spotckpt `CheckpointManager` built from spotckpt's own settings
(keyword arguments, ``SPOTCKPT_*`` variables, ``spotckpt.toml``: the URI, ``keep_last``,
``async_save``, ...). `main` is torchtitan's entry point with that trainer.

What is saved is what torchtitan's own checkpointer saves, under the same keys: the model's
state dict flattened to the top level (FQNs; FSDP2/DTensor shards through DCP), ``optimizer``
(torchtitan's FQN-keyed flattened optimizer state), ``lr_scheduler``, ``train_state`` (step and
tokens seen) and ``dataloader``, plus ``rng``: every RNG of each rank. The data loader's position
is stored under its data-parallel rank's key as torchtitan does, but as one blob of
`spotckpt.values`-encoded plain values that loads with ``torch.load(weights_only=True)``, where
torchtitan's loader pickles it.

Saves follow ``checkpoint.interval`` and ``enable_first_step_checkpoint`` (and spotckpt's own
``interval_steps``, such as ``"auto"``, when set); the last step is saved in full, blocking. At
every step the spotckpt manager's `maybe_save` runs first: on a preemption notice (SIGTERM,
SIGUSR1, a cloud notice) every rank saves that step, training stops, and ``train()`` ends the
process with `spotckpt.PREEMPTED_EXIT_CODE` (75). The same command started again resumes from
the latest committed step, on the same number of ranks (each rank's RNGs and data-parallel
rank's loader position are its own; torchtitan's data loader does not reshard).

Checkpointing is on without ``checkpoint.enable`` (preemption handling needs it);
``interval``, ``load_step`` and ``exclude_from_loading`` apply; ``folder``, ``keep_latest_k``,
``last_save_model_only`` and ``export_dtype`` do not (spotckpt's URI and ``keep_last`` decide).
Options it cannot honour are refused at start: ``async_mode`` (use spotckpt's ``async_save``),
``initial_load_path``, ``initial_load_in_hf``, ``last_save_in_hf`` and ``load_only`` (a job
that may not save cannot make an emergency save).

On a machine without an accelerator torchtitan 0.2.2 still takes "cuda" as its device type and
fails in its own ``Trainer`` (``torch._C`` has no ``_cuda_setDevice``). `SpotckptTrainer` then
points torchtitan at the CPU instead (its device type ``"cpu"``, for which torchtitan's own
backend choice is gloo, and a CPU device module for its memory monitor, which reports no memory
statistics), and has FSDP reduce gradients with plain sums (gloo has no ``PREMUL_SUM``). A CUDA
memory snapshot (``profiling.enable_memory_snapshot``) is refused there.

Written for torchtitan 0.2.2. Importing this module imports torchtitan; ``import spotckpt`` does
not.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import platform
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule

from spotckpt import PREEMPTED_EXIT_CODE
from spotckpt import CheckpointManager as SpotckptManager
from spotckpt.config import Config
from spotckpt.errors import ConfigError
from spotckpt.extras import missing_extra
from spotckpt.state import RNG_KEY, RNGState, shield_workers
from spotckpt.values import decode, encode, load_plain

try:
    import torchtitan.tools.utils as titan_utils
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtitan.components.checkpoint import MODEL, CheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader, ParallelAwareDataloader
    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main
except ImportError as missing:
    raise missing_extra("torchtitan", "spotckpt.integrations.torchtitan", missing) from missing

log = logging.getLogger("spotckpt")

__all__ = ["LoaderState", "SpotckptCheckpointManager", "SpotckptTrainer", "main"]


def _check_supported(checkpoint_config: Any) -> None:
    """Refuse the torchtitan ``[checkpoint]`` options that a spotckpt checkpointer cannot honour."""
    refused = {
        "async_mode": checkpoint_config.async_mode != "disabled",
        "initial_load_path": bool(checkpoint_config.initial_load_path),
        "initial_load_in_hf": checkpoint_config.initial_load_in_hf,
        "last_save_in_hf": checkpoint_config.last_save_in_hf,
        "load_only": checkpoint_config.load_only,
    }
    named = [f"checkpoint.{name}" for name, set_ in refused.items() if set_]
    if named:
        raise ConfigError(
            f"spotckpt's torchtitan checkpointer does not support {', '.join(named)} (for "
            "asynchronous saves set spotckpt's async_save; export weights with spotckpt "
            "export-hf)"
        )


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf names: the percentages are moot
        return 1


CPU_DEVICE_MODULE = types.SimpleNamespace(
    set_device=lambda device: None,
    current_device=lambda: 0,  # torchtitan passes it to barrier(device_ids=[...])
    device_count=lambda: 1,
    synchronize=torch.cpu.synchronize,
    get_device_name=lambda device=None: f"CPU ({platform.machine() or 'unknown'})",
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=_total_memory()),
    memory_stats=lambda device=None: {},  # torchtitan reports -1 for what is missing
    reset_peak_memory_stats=lambda device=None: None,
    empty_cache=lambda: None,
)
"""What torchtitan calls on its device module (``torch.cuda`` by default), for the CPU."""


def _needs_the_cpu() -> bool:
    """True when torchtitan would use CUDA and there is none (it found no accelerator)."""
    return titan_utils.device_type == "cuda" and not torch.cuda.is_available()


def _use_the_cpu() -> None:
    """Point torchtitan's device type and device module at the CPU.

    torchtitan keeps them as module globals, set at import by ``get_device_info`` (``"cuda"`` and
    ``torch.cuda`` when it finds no accelerator) and copied by ``from ... import`` into the
    modules loaded since; each copy is replaced, and ``get_device_info`` answers the CPU for
    modules loaded later. torchtitan's own backend choice for device type ``"cpu"`` is gloo.
    """
    cuda_type, cuda_module = titan_utils.device_type, titan_utils.device_module
    titan_utils.get_device_info = lambda: ("cpu", CPU_DEVICE_MODULE)
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            continue
        globals_ = vars(module)
        if globals_.get("device_type") == cuda_type:
            globals_["device_type"] = "cpu"
        if globals_.get("device_module") is cuda_module:
            globals_["device_module"] = CPU_DEVICE_MODULE


def _sum_reductions(model_parts: list[nn.Module]) -> None:
    """Have FSDP reduce gradients with SUM (then divide), as gloo has no ``PREMUL_SUM``."""
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


class LoaderState:
    """A torchtitan data loader's position as a DCP Stateful, without torchtitan's pickle.

    ``{"dp_rank_<r>": blob}``: the `StatefulDataLoader` state of this data-parallel rank, encoded
    by `spotckpt.values` and serialized whole (so its keys need not match between a fresh loader
    and a used one, as with several workers); restored with ``torch.load(weights_only=True)``.
    The loader's workers ignore SIGTERM and SIGUSR1 until an emergency save has committed.
    """

    def __init__(self, loader: ParallelAwareDataloader) -> None:
        self.loader = loader
        self.key = f"dp_rank_{loader.dp_rank}"
        shield_workers(loader)

    def state_dict(self) -> dict[str, Any]:
        """This rank's loader position, as one blob."""
        buffer = io.BytesIO()
        torch.save(encode(StatefulDataLoader.state_dict(self.loader), self.key), buffer)
        return {self.key: buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the loader's position from a blob made by `state_dict`."""
        state = decode(load_plain(state_dict[self.key], self.key), self.key)
        StatefulDataLoader.load_state_dict(self.loader, state)


class _Part:
    """A torchtitan Stateful passed to spotckpt as a plain Stateful.

    torchtitan's ``OptimizersContainer`` is also a ``torch.optim.Optimizer``, which spotckpt
    would otherwise save through DCP's optimizer helpers for a single model; this keeps
    torchtitan's own (FQN-keyed, flattened, every model part) state dict.
    """

    def __init__(self, inner: Stateful) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        """The inner state dict."""
        state: dict[str, Any] = self.inner.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hand the loaded state to the inner Stateful."""
        self.inner.load_state_dict(state_dict)


def _part(value: Any) -> Any:
    if isinstance(value, ParallelAwareDataloader):
        return LoaderState(value)
    if isinstance(value, Stateful):
        return _Part(value)
    return value


class SpotckptCheckpointManager(CheckpointManager):
    """torchtitan's checkpointer, saving to and restoring from a spotckpt `CheckpointManager`.

    Takes torchtitan's constructor arguments plus `manager`, the spotckpt manager to use (this
    class closes it). See the module docstring for what is saved and which options apply.
    """

    def __init__(
        self,
        dataloader: BaseDataLoader | None,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        checkpoint_config: Any,
        sd_adapter: Any = None,
        base_folder: str = "",
        *,
        manager: SpotckptManager,
    ) -> None:
        _check_supported(checkpoint_config)
        # Disabled, torchtitan's constructor only builds the states (no folder, thread or group).
        super().__init__(
            dataloader=dataloader,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            checkpoint_config=dataclasses.replace(checkpoint_config, enable=False),
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        self.enable = True
        self.interval = checkpoint_config.interval
        self.enable_first_step_checkpoint = checkpoint_config.enable_first_step_checkpoint
        self.exclude_from_loading = list(checkpoint_config.exclude_from_loading)
        self.manager = manager
        self.rng = RNGState()
        self._parts = {key: _part(value) for key, value in self.states.items() if key != MODEL}

    def _state(self, *, loading: bool = False) -> dict[str, Any]:
        """torchtitan's flattened states (model FQNs at the top level) and this rank's RNGs."""
        skipped = set(self.exclude_from_loading) if loading else set()
        state = {key: part for key, part in self._parts.items() if key not in skipped}
        state[RNG_KEY] = self.rng
        state.update(self.states[MODEL].state_dict())
        return state

    def save(self, curr_step: int, last_step: bool = False) -> None:
        """At every step: an emergency save on a preemption notice, else a save when due."""
        state = self._state()
        if self.manager.maybe_save(curr_step, state):
            return
        if self._should_save(curr_step, last_step):
            self.manager.save(curr_step, state, blocking=True if last_step else None)

    def load(self, step: int = -1) -> bool:
        """Restore the latest committed step (or `step`) in place; False when there is none."""
        state = self._state(loading=True)
        restored = self.manager.restore(
            state, step=None if step < 0 else step, strict=not self.exclude_from_loading
        )
        if restored is None:
            return False
        self.states[MODEL].load_state_dict(state)  # as torchtitan does: refreshes its cache
        log.info("torchtitan: resuming after step %d", restored)
        return True

    def should_stop(self) -> bool:
        """True on every rank once a preemption save has committed."""
        return self.manager.should_stop()

    def maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: spotckpt stages a save before `save` returns."""

    def close(self) -> None:
        """Wait for a pending upload (raising its error) and close the spotckpt manager."""
        if hasattr(self, "manager"):
            self.manager.close()


class SpotckptTrainer(Trainer):
    """torchtitan's `Trainer`, checkpointing through spotckpt and stopping on preemption.

    `spotckpt_config` gives the URI and the manager's settings, each of them as given (default:
    `Config.load()`, from ``SPOTCKPT_*`` variables and ``spotckpt.toml``, the rule of every
    manager; ``Config.load(uri=...)`` gives some in code and still reads the rest there).
    `train` ends the process with status 75 after an emergency save. Without CUDA or another
    accelerator it trains on the CPU with gloo (see the module docstring).
    """

    checkpointer: SpotckptCheckpointManager

    def __init__(self, job_config: Any, *, spotckpt_config: Config | None = None) -> None:
        config = spotckpt_config if spotckpt_config is not None else Config.load()
        _check_supported(job_config.checkpoint)  # before the model is built
        if _needs_the_cpu():
            if job_config.profiling.enable_memory_snapshot:
                raise ConfigError(
                    "profiling.enable_memory_snapshot records CUDA memory: there is no CUDA "
                    "device here (torchtitan runs on the CPU), so turn it off"
                )
            log.warning("torchtitan: no CUDA device or other accelerator, training on the CPU")
            _use_the_cpu()
        disabled = dataclasses.replace(
            job_config, checkpoint=dataclasses.replace(job_config.checkpoint, enable=False)
        )
        super().__init__(disabled)  # its own checkpointer, disabled, is replaced below
        if dist.is_initialized() and dist.get_backend() == "gloo":
            _sum_reductions(self.model_parts)
        self.job_config = job_config
        self.checkpointer = SpotckptCheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            checkpoint_config=job_config.checkpoint,
            base_folder=job_config.job.dump_folder,
            manager=SpotckptManager.from_config(config),
        )

    def should_continue_training(self) -> bool:
        """torchtitan's condition, and no committed emergency save."""
        return not self.checkpointer.should_stop() and bool(super().should_continue_training())

    def train(self) -> None:
        """torchtitan's loop; after an emergency save, closes and exits with status 75."""
        super().train()
        if self.checkpointer.should_stop():
            log.warning("torchtitan: stopping at step %d for preemption", self.step)
            self.close()
            raise SystemExit(PREEMPTED_EXIT_CODE)


def main(trainer_class: type[SpotckptTrainer] = SpotckptTrainer) -> None:
    """torchtitan's command-line entry point (``--job.config_file`` ...) with `trainer_class`."""
    torchtitan_main(trainer_class)


if __name__ == "__main__":
    main()
