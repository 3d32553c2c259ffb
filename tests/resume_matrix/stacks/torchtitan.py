"""Resume-matrix stack: torchtitan's own Trainer through `SpotckptTrainer` (docs/torchtitan.md).

    python stacks/torchtitan.py --describe      # what this stack supports (no torch import)
    MATRIX_CASE='{...}' spotckpt launch --standalone --nproc-per-node=2 stacks/torchtitan.py

What docs/torchtitan.md's ``spotckpt launch ... -m spotckpt.integrations.torchtitan
--job.config_file ...`` runs, in code (``torchtitan.train.main(SpotckptTrainer)``, which that
page names): the
URI and ``async_save`` come from spotckpt's settings (``SPOTCKPT_URI``, ``SPOTCKPT_ASYNC_SAVE``,
set here from the case), torchtitan's options from its command line (set here before torchtitan
is imported). The model is torchtitan's llama3 ``debugmodel`` (FSDP2 over the ranks, gloo, on
the CPU as `SpotckptTrainer` arranges it without an accelerator), with torchtitan's AdamW, a
warm-up then linear decay over a fixed 100-step horizon (``lr_scheduler.total_steps``, so that
the schedule does not depend on ``training.steps``), its loss and its ``ParallelAwareDataloader``
(``workers`` worker processes, ``generator=`` of its own). Saves follow ``checkpoint.interval``.
One rank may also be started directly (``python stacks/torchtitan.py``): the worker then sets
torchrun's variables for a world of one.

The data is a train spec of this file: per data-parallel rank, 24 fixed token windows (6 steps of
4 an epoch), visited in a fresh permutation each epoch, endlessly, by a Stateful
IterableDataset (split between loader workers); ``titan-augment`` also replaces random tokens,
drawn from a generator seeded with ``spotckpt.sample_seed(seed, epoch, index)`` (what
docs/data-loaders.md says to do where ``SeededDataset`` does not apply). The llama3 debugmodel
has no dropout: the training step itself draws no random numbers.

Evaluation: a validator of this spec runs after the checkpointer at step 1 and every 5th step
(2 fixed batches, no gradients). Pause kinds (``pause.at`` is a step K: the pause is at the first
such point at step K or later, once, and only when the restored step is before K): ``step`` and
``epoch_end`` (K is an epoch's last step): after step K's optimizer step, before the
checkpointer sees the step, so the emergency save is of step K; ``eval``: in the first batch of
the first evaluation at step >= K (the emergency save is of the next step); ``async``: right
after the checkpointer started the interval save of the first step >= K (``async_save``).
Pausing writes ``out/paused-rank{r}`` (JSON: step, kind, pid, pgid) and waits, at most 300 s, for
the preemption flag. After each save every rank writes what was saved as
``out/saved-rank{r}-step{s}-{pid}.json``; after its restore ``out/restored-rank{r}-{pid}.json``;
at a clean finish ``out/final-rank{r}.json`` (a sha256 per entry of the full, gathered model and
optimizer state, ``model/...`` and ``optim/...``, and of the LR schedulers, ``scheduler``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _worker import Pause, serve, sha, write_json

DESCRIBE = {
    "ranks": [1, 2],
    "loaders": ["titan", "titan-augment"],
    "world_change": False,
    "steps": 20,
    "save_every": 4,
    "run_s": 40,
}

SPEC = "spotckpt_matrix"
VOCAB = 2048  # the debugmodel's vocabulary
WINDOWS = 24  # per data-parallel rank
LOCAL_BATCH = 4  # 6 steps an epoch
SEQ_LEN = 32
EVAL_EVERY = 5


def one_rank_environment() -> None:
    """torchrun's variables for a world of one, when started without a launcher."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def run(case: dict[str, Any]) -> int:
    out = Path(case["out"])
    out.mkdir(parents=True, exist_ok=True)
    seed = int(case["seed"])
    save_every = int(case["save_every"])
    augment = case["loader"] == "titan-augment"
    if case["loader"] not in ("titan", "titan-augment"):
        raise SystemExit(f"torchtitan stack: unknown loader {case['loader']!r}")
    workers = int(case["workers"])
    one_rank_environment()
    os.environ["SPOTCKPT_URI"] = case["uri"]
    os.environ["SPOTCKPT_ASYNC_SAVE"] = "true" if case["async_save"] else "false"
    # torchtitan parses its command line from sys.argv
    sys.argv = [
        sys.argv[0],
        "--job.dump_folder", str(out / "titan"),
        "--model.name", SPEC,
        "--model.flavor", "debugmodel",
        "--training.steps", str(int(case["steps"])),
        "--training.local_batch_size", str(LOCAL_BATCH),
        "--training.seq_len", str(SEQ_LEN),
        "--training.mixed_precision_param", "float32",
        "--lr_scheduler.warmup_steps", "2",
        "--lr_scheduler.total_steps", "100",
        "--activation_checkpoint.mode", "none",
        "--metrics.log_freq", "1",
        "--debug.seed", str(seed),
        "--checkpoint.interval", str(save_every),
        "--validation.enable",
        "--validation.freq", str(EVAL_EVERY),
    ]  # fmt: skip

    import dataclasses

    import torch
    import torch.distributed as dist
    import torchtitan.protocols.train_spec as train_spec
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.utils.data import IterableDataset, get_worker_info
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.validate import BaseValidator

    from spotckpt import sample_seed
    from spotckpt.integrations.torchtitan import SpotckptTrainer, main

    torch.set_num_threads(1)

    Batch = tuple[dict[str, torch.Tensor], torch.Tensor]

    class Windows(IterableDataset[Batch]):
        """Fixed token windows of one data-parallel rank, a new permutation every epoch."""

        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.windows = [
                torch.randint(
                    0,
                    VOCAB,
                    (SEQ_LEN + 1,),
                    generator=torch.Generator().manual_seed(1_000_003 * rank + index),
                )
                for index in range(WINDOWS)
            ]
            self.epoch, self.position = 0, 0  # the next window: this epoch's `position`-th

        def order(self, epoch: int) -> list[int]:
            generator = torch.Generator().manual_seed(seed * 7919 + 31 * self.rank + epoch)
            return torch.randperm(WINDOWS, generator=generator).tolist()

        def __iter__(self) -> Iterator[Batch]:
            info = get_worker_info()
            worker, count = (0, 1) if info is None else (info.id, info.num_workers)
            while True:
                order = self.order(self.epoch)
                while self.position < WINDOWS:
                    position = self.position
                    self.position += 1
                    if position % count != worker:
                        continue
                    window = self.windows[order[position]].clone()
                    if augment:  # seeded per sample, as docs/data-loaders.md says for such datasets
                        random = torch.Generator().manual_seed(
                            sample_seed(seed + self.rank, self.epoch, position)
                        )
                        where = torch.rand(window.shape, generator=random) < 0.1
                        noise = torch.randint(0, VOCAB, window.shape, generator=random)
                        window[where] = noise[where]
                    yield {"input": window[:-1]}, window[1:]
                self.epoch, self.position = self.epoch + 1, 0

        def state_dict(self) -> dict[str, Any]:
            return {"epoch": self.epoch, "position": self.position}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def build_loader(
        dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any, **_: Any
    ) -> ParallelAwareDataloader:
        return ParallelAwareDataloader(
            Windows(dp_rank),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=job_config.training.local_batch_size,
            num_workers=workers,
            generator=torch.Generator().manual_seed(seed + 1),
        )

    trainers: list[MatrixTrainer] = []

    class Evaluation(BaseValidator):
        """Two fixed batches through the model, without gradients, every EVAL_EVERY steps."""

        def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
            (model,) = model_parts
            data = Windows(10_000 + dist.get_rank())
            model.eval()
            with torch.no_grad():
                for batch in range(2):
                    rows = data.windows[batch * LOCAL_BATCH : (batch + 1) * LOCAL_BATCH]
                    model(torch.stack(rows)[:, :-1])
                    if batch == 0:
                        trainers[0].pause_here("eval", step)
            model.train()

    def build_validator(job_config: Any, **_: Any) -> BaseValidator:
        return Evaluation(job_config)

    llama3 = train_spec.get_train_spec("llama3")
    train_spec.register_train_spec(
        SPEC,
        dataclasses.replace(
            llama3,
            build_dataloader_fn=build_loader,
            build_tokenizer_fn=None,
            build_validator_fn=build_validator,
        ),
    )

    class MatrixTrainer(SpotckptTrainer):
        """`SpotckptTrainer` that records losses and state digests, and pauses where asked."""

        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            trainers.append(self)
            self.me = dist.get_rank()
            self.pause = Pause(case.get("pause"), out, self.me, self.preempted)
            self.losses: list[float] = []
            checkpointer = self.checkpointer
            load, save = checkpointer.load, checkpointer.save

            def loading(step: int = -1) -> bool:
                found = load(step)
                restored = self.step if found else None
                self.pause.arm(restored)
                state = self.digests() if found else {}
                record = {"step": restored, "state": state}
                write_json(out / f"restored-rank{self.me}-{os.getpid()}.json", record)
                return found

            def saving(curr_step: int, last_step: bool = False) -> None:
                save(curr_step, last_step)
                emergency = checkpointer.should_stop()
                periodic = curr_step % save_every == 0 or last_step
                if emergency or periodic:
                    record = {"step": curr_step, "state": self.digests()}
                    name = f"saved-rank{self.me}-step{curr_step}-{os.getpid()}.json"
                    write_json(out / name, record)
                if periodic and not emergency:
                    self.pause_here("async", curr_step)

            checkpointer.load = loading  # type: ignore[method-assign]
            checkpointer.save = saving  # type: ignore[method-assign]

        def digests(self) -> dict[str, str]:
            """A sha256 per entry of the full state (every rank takes part in gathering it)."""
            (model,) = self.model_parts
            (optimizer,) = self.optimizers.optimizers
            full = StateDictOptions(full_state_dict=True)
            flat = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
            found = {
                f"model/{key}": sha(value)
                for key, value in get_model_state_dict(model, options=full).items()
            }
            moments = get_optimizer_state_dict(model, optimizer, options=flat)
            for key, value in moments.items():
                found[f"optim/{key}"] = sha(value)
            found["scheduler"] = sha(self.lr_schedulers.state_dict())
            return found

        def preempted(self) -> bool:
            watcher = self.checkpointer.manager.watcher
            return watcher is not None and watcher.preempted

        def pause_here(self, kind: str, step: int) -> None:
            self.pause.hold(kind, step)

        def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
            loss = super().forward_backward_step(**kwargs)
            self.losses.append(float(loss.detach()))
            return loss

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            step = self.step
            loss = sum(self.losses)
            self.losses.clear()
            epoch = (step - 1) * LOCAL_BATCH // WINDOWS
            record = {"step": step, "loss": loss.hex(), "epoch": epoch}
            with open(out / f"losses-rank{self.me}.jsonl", "a") as losses:
                losses.write(json.dumps(record) + "\n")
            self.pause_here("step", step)
            self.pause_here("epoch_end", step)

        def train(self) -> None:
            super().train()  # exits with status 75 after an emergency save
            write_json(out / f"final-rank{self.me}.json", self.digests())

    main(MatrixTrainer)
    return 0


if __name__ == "__main__":
    sys.exit(serve(DESCRIBE, run))
