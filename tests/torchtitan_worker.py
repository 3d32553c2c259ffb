"""One rank of a torchtitan training run through `SpotckptTrainer`, on the CPU, for
test_torchtitan.py.

Usage, with torchrun's variables set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
and SPOTCKPT_URI naming the checkpoint root:

    [WAIT_AT=K MARKER_FD=FD] python torchtitan_worker.py --job.dump_folder OUT TORCHTITAN-ARGS...

(torchtitan reads its command line as it was when it was imported, so the worker's own two
options come from the environment.) Imported, as by ``--experimental.custom_import
torchtitan_worker`` under ``torchrun -m spotckpt.integrations.torchtitan``, it only registers
its train spec, ``spotckpt_debug``.

The model is torchtitan's llama3 ``debugmodel``, trained by torchtitan's own Trainer, optimizer
container, LR schedulers, loss and ``ParallelAwareDataloader`` (FSDP2 over the ranks, gloo). The
data is a deterministic synthetic token stream per data-parallel rank (no tokenizer, no
download), a Stateful dataset so the loader can resume it. Nothing else is patched: on a
machine without an accelerator `SpotckptTrainer` itself moves torchtitan to the CPU and gloo.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchtitan.protocols.train_spec as train_spec
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader

from spotckpt.integrations.torchtitan import SpotckptTrainer, main

WAIT_TIMEOUT_S = 600.0
VOCAB = 2048  # the debugmodel's vocabulary
SPEC = "spotckpt_debug"


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
    """llama3 with the synthetic loader and no tokenizer or validator."""
    spec = dataclasses.replace(
        train_spec.get_train_spec("llama3"),
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


register_spec()


def run() -> None:
    torch.set_num_threads(1)
    main(WorkerTrainer)


if __name__ == "__main__":
    run()
