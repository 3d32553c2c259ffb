"""One rank of a torchtitan training run through `SpotckptTrainer`, on the CPU, for
test_torchtitan.py.

Usage, with torchrun's variables set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
and SPOTCKPT_URI naming the checkpoint root:

    [WAIT_AT=K MARKER_FD=FD] python torchtitan_worker.py --job.dump_folder OUT TORCHTITAN-ARGS...

(torchtitan reads its command line as it was when it was imported, so the worker's own two
options come from the environment.)

The model is torchtitan's llama3 ``debugmodel``, trained by torchtitan's own Trainer, optimizer
container, LR schedulers, loss and ``ParallelAwareDataloader`` (FSDP2 over the ranks, gloo). The
data is a deterministic synthetic token stream per data-parallel rank (no tokenizer, no
download), a Stateful dataset so the loader can resume it. Two accommodations for a machine
without an accelerator: torchtitan 0.2.2 takes "cuda" as its device type when it finds no
accelerator, so the worker points it at the CPU (with a stand-in device module for its memory
monitor); and gloo has no PREMUL_SUM, so FSDP reduces gradients with plain sums.

Every rank appends each step it trained to ``OUT/steps-<rank>.txt``. With ``WAIT_AT=K``
every rank, after step K's optimizer step (before the checkpointer sees the step), writes
``REACHED K`` to file descriptor FD and blocks until a signal arrives. A run that ends normally
leaves ``OUT/digest.json`` (rank 0): the step, a SHA-256 of every full model and optimizer
tensor, the optimizer's other values and the LR scheduler state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import select
import signal
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchtitan.components.metrics as titan_metrics
import torchtitan.distributed.parallel_dims as titan_parallel_dims
import torchtitan.distributed.utils as titan_dist_utils
import torchtitan.protocols.train_spec as train_spec
import torchtitan.tools.utils as titan_utils
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

from spotckpt.integrations.torchtitan import SpotckptTrainer, main

WAIT_TIMEOUT_S = 600.0
VOCAB = 2048  # the debugmodel's vocabulary
SPEC = "spotckpt_debug"

CPU_DEVICE = types.SimpleNamespace(
    set_device=lambda device: None,
    current_device=lambda: 0,
    device_count=lambda: 1,
    synchronize=lambda: None,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 30),
    memory_stats=lambda device=None: {},
    reset_peak_memory_stats=lambda: None,
    empty_cache=lambda: None,
)


def use_the_cpu() -> None:
    """Point torchtitan's device type and module at the CPU (it defaults to "cuda")."""
    for module in (titan_utils, titan_metrics, titan_dist_utils):
        module.device_type = "cpu"  # type: ignore[attr-defined]
        module.device_module = CPU_DEVICE  # type: ignore[attr-defined]
    titan_parallel_dims.device_type = "cpu"  # type: ignore[attr-defined]


class Tokens(IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """An endless stream of random token windows, a function of (rank, index) alone."""

    def __init__(self, rank: int, seq_len: int) -> None:
        self.rank, self.seq_len, self.index = rank, seq_len, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            generator = torch.Generator().manual_seed(1_000_003 * self.rank + self.index)
            window = torch.randint(0, VOCAB, (self.seq_len + 1,), generator=generator)
            self.index += 1
            yield {"input": window[:-1]}, window[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = state["index"]


def build_loader(
    dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any, **_: Any
) -> ParallelAwareDataloader:
    return ParallelAwareDataloader(
        Tokens(dp_rank, job_config.training.seq_len),
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=job_config.training.local_batch_size,
    )


def register_spec() -> None:
    """llama3 with the synthetic loader, no tokenizer or validator, and sum-only FSDP."""
    llama3 = train_spec.get_train_spec("llama3")

    def parallelize(model: torch.nn.Module, parallel_dims: Any, job_config: Any) -> Any:
        model = llama3.parallelize_fn(model, parallel_dims, job_config)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    spec = dataclasses.replace(
        llama3,
        parallelize_fn=parallelize,
        build_dataloader_fn=build_loader,
        build_tokenizer_fn=None,
        build_validator_fn=None,
    )
    train_spec.register_train_spec(SPEC, spec)


def wait_for_signal(step: int, marker_fd: int) -> None:
    """Announce `step` on `marker_fd`, then block until a signal arrives (its handlers run)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)
    try:
        os.write(marker_fd, f"REACHED {step}\n".encode())
        os.close(marker_fd)
        select.select([read], [], [], WAIT_TIMEOUT_S)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)


def sha(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tensor.dtype}:{list(tensor.shape)}:{hashlib.sha256(raw).hexdigest()}"


def fingerprint(state: dict[str, Any]) -> dict[str, str]:
    return {
        key: sha(value) if isinstance(value, torch.Tensor) else repr(value)
        for key, value in sorted(state.items())
    }


class WorkerTrainer(SpotckptTrainer):
    """`SpotckptTrainer` that records its steps, waits where asked and leaves a digest."""

    def __init__(self, job_config: Any) -> None:
        super().__init__(job_config)
        self.out = Path(job_config.job.dump_folder)
        self.out.mkdir(parents=True, exist_ok=True)
        wait_at = os.environ.get("WAIT_AT")
        self.wait_at = int(wait_at) if wait_at else None

    def train_step(self, data_iterator: Any) -> None:
        super().train_step(data_iterator)
        with open(self.out / f"steps-{dist.get_rank()}.txt", "a") as steps:
            steps.write(f"{self.step}\n")
        if self.step == self.wait_at:
            wait_for_signal(self.step, int(os.environ["MARKER_FD"]))

    def train(self) -> None:
        super().train()  # exits with status 75 after an emergency save
        self.write_digest()

    def write_digest(self) -> None:
        """The full state, gathered on rank 0 (every rank takes part)."""
        (model,) = self.model_parts
        (optimizer,) = self.optimizers.optimizers
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        flat = StateDictOptions(
            full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
        )
        params = get_model_state_dict(model, options=full)
        moments = get_optimizer_state_dict(model, optimizer, options=flat)
        if dist.get_rank() != 0:
            return
        digest = {
            "step": self.step,
            "model": fingerprint(params),
            "optimizer": fingerprint(moments),
            "lr_scheduler": repr(self.lr_schedulers.state_dict()),
        }
        (self.out / "digest.json").write_text(json.dumps(digest, indent=1, sort_keys=True))


def run() -> None:
    torch.set_num_threads(1)
    use_the_cpu()
    register_spec()
    main(WorkerTrainer)


if __name__ == "__main__":
    run()
