"""Resume-matrix stack: the Hugging Face ``Trainer`` and `SpotckptCallback` (docs/transformers.md).

    python stacks/hf.py --describe      # what this stack supports (no torch import)
    MATRIX_CASE='{...}' python stacks/hf.py

docs/transformers.md's recipe as a user writes it::

    spot = SpotckptCallback(uri, interval_steps=..., async_save=...)
    args = TrainingArguments(output_dir=..., max_steps=..., save_strategy="no", ...)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=..., callbacks=[...])
    trainer.train(resume_from_checkpoint=spot.resume_from_checkpoint())

A tiny GPT-2 built from a config (dropout 0.1 everywhere), the Trainer's own AdamW and an
``inverse_sqrt`` warm-up schedule (one that does not depend on ``max_steps``), 44 token sequences
in batches of 4 with 2 accumulated batches a step (11 batches, 6 optimizer steps an epoch, the
last one a single batch), logging every 2 steps and an evaluation on 8 sequences (2 batches)
every 4 steps. The Trainer builds its own loader from the Dataset (``hf-default``), with
``workers`` worker processes; ``hf-augment`` is the same over ``SeededDataset`` of a dataset
that replaces random tokens in ``__getitem__`` (the Trainer calls the dataset's ``set_epoch``).
A step's loss is the sum of its micro-batches' model losses (a forward hook on the model).

Pause kinds (``pause.at`` is a step K: the pause is at the first such point at step K or later,
once, and only when the restored step is before K): ``step`` and ``epoch_end`` (K is an epoch's
last step): at the end of optimizer step K, in a callback before `SpotckptCallback`, so the
emergency save is of step K; ``eval``: in the first batch of the first evaluation at or after
step K (the callback offers the step after that evaluation); ``async``: in a callback after
`SpotckptCallback`, right after it started the interval save of the first step >= K
(``async_save``). Pausing writes ``out/paused-rank{r}`` (JSON: step, kind, pid, pgid) and waits,
at most 300 s, for the preemption flag. Before each save the worker writes the state it expects
saved as ``out/saved-rank{r}-step{s}-{pid}.json``; after its restore,
``out/restored-rank{r}-{pid}.json``; at a clean finish ``out/final-rank{r}.json`` (a sha256 per
entry: ``model/...``, ``optim/...``, ``scheduler``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from _worker import Pause, rank, serve, write_json

DESCRIBE = {
    "ranks": [1],
    "loaders": ["hf-default", "hf-augment"],
    "world_change": False,
    "steps": 20,
    "save_every": 4,
    "run_s": 22,
}

EXAMPLES = 44  # 11 batches of 4: with 2 accumulated batches, 6 optimizer steps an epoch
EVAL_EXAMPLES = 8
BATCH = 4
ACCUMULATE = 2
LENGTH = 16
VOCAB = 64


def run(case: dict[str, Any]) -> int:
    import torch
    from _frameworks import training_digests
    from torch.utils.data import Dataset
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
        set_seed,
    )

    from spotckpt import SeededDataset
    from spotckpt.integrations.transformers import SpotckptCallback

    out = Path(case["out"])
    out.mkdir(parents=True, exist_ok=True)
    me = rank()
    seed = int(case["seed"])
    save_every = int(case["save_every"])
    torch.set_num_threads(1)
    set_seed(seed)

    class Tokens(Dataset[dict[str, torch.Tensor]]):
        """Fixed random token sequences; the labels are the inputs (causal LM)."""

        def __init__(self, count: int, data_seed: int) -> None:
            generator = torch.Generator().manual_seed(data_seed)
            self.ids = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[index], "labels": self.ids[index]}

    class Masked(Dataset[dict[str, torch.Tensor]]):
        """Random augmentation in ``__getitem__``: a few tokens replaced, from the global RNG."""

        def __init__(self, base: Tokens) -> None:
            self.base = base

        def __len__(self) -> int:
            return len(self.base)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            sample = self.base[index]
            ids = sample["input_ids"].clone()
            where = torch.rand(ids.shape) < 0.2
            ids[where] = torch.randint(0, VOCAB, ids.shape)[where]
            return {"input_ids": ids, "labels": sample["labels"]}

    name = case["loader"]
    train: Dataset[dict[str, torch.Tensor]]
    if name == "hf-default":
        train = Tokens(EXAMPLES, 1000 + seed)
    elif name == "hf-augment":
        train = SeededDataset(Masked(Tokens(EXAMPLES, 1000 + seed)), seed=seed)
    else:
        raise SystemExit(f"hf stack: unknown loader {name!r}")
    evaluation = Tokens(EVAL_EXAMPLES, 2000 + seed)

    progress: dict[str, Any] = {"restored": None, "micro": [], "saved": set()}

    def preempted() -> bool:
        watcher = None if spot.manager is None else spot.manager.watcher
        return watcher is not None and watcher.preempted

    pause = Pause(case.get("pause"), out, me, preempted)

    def saving(step: int, kwargs: dict[str, Any]) -> None:
        """The state SpotckptCallback saves at this step, written before it does."""
        if step not in progress["saved"]:
            progress["saved"].add(step)
            state = training_digests(kwargs["model"], kwargs["optimizer"], kwargs["lr_scheduler"])
            record = {"step": step, "state": state}
            write_json(out / f"saved-rank{me}-step{step}-{os.getpid()}.json", record)

    class Probe(TrainerCallback):
        """Before `SpotckptCallback`: step losses, saved state; pauses at a step or an eval."""

        def on_step_end(
            self,
            args: TrainingArguments,
            trainer_state: TrainerState,
            control: TrainerControl,
            **kwargs: Any,
        ) -> None:
            step = trainer_state.global_step
            loss = math.fsum(progress["micro"])
            progress["micro"].clear()
            epoch = math.ceil(trainer_state.epoch or 0) - 1  # the epoch this step's batches are of
            record = {"step": step, "loss": loss.hex(), "epoch": epoch}
            with open(out / f"losses-rank{me}.jsonl", "a") as losses:
                losses.write(json.dumps(record) + "\n")
            # epoch_end: K is an epoch's last step, so this is the epoch's end as well
            pause.hold("step", step)
            pause.hold("epoch_end", step)
            if preempted() or step % save_every == 0 or step >= trainer_state.max_steps:
                saving(step, kwargs)  # what SpotckptCallback saves when it is offered the step

        def on_prediction_step(
            self,
            args: TrainingArguments,
            trainer_state: TrainerState,
            control: TrainerControl,
            **kwargs: Any,
        ) -> None:
            if pause.hold("eval", trainer_state.global_step):
                saving(trainer_state.global_step, kwargs)  # offered after this evaluation

    class Tail(TrainerCallback):
        """After `SpotckptCallback`: records the restored state; pauses after an async save."""

        def on_train_begin(
            self,
            args: TrainingArguments,
            trainer_state: TrainerState,
            control: TrainerControl,
            **kwargs: Any,
        ) -> None:
            step = trainer_state.global_step
            progress["restored"] = step if step > 0 else None
            pause.arm(progress["restored"])
            state = {}
            if step > 0:
                model, optimizer = kwargs["model"], kwargs["optimizer"]
                state = training_digests(model, optimizer, kwargs["lr_scheduler"])
            record = {"step": progress["restored"], "state": state}
            write_json(out / f"restored-rank{me}-{os.getpid()}.json", record)

        # SpotckptCallback offers a step to maybe_save in on_step_end, or after its logging, or
        # after its evaluation: the same events here, after it, see the save started.
        def on_step_end(
            self,
            args: TrainingArguments,
            trainer_state: TrainerState,
            control: TrainerControl,
            **kwargs: Any,
        ) -> None:
            if not (control.should_log or control.should_evaluate):
                self.offered(trainer_state)

        def on_log(
            self,
            args: TrainingArguments,
            trainer_state: TrainerState,
            control: TrainerControl,
            **kwargs: Any,
        ) -> None:
            if not control.should_evaluate:
                self.offered(trainer_state)

        def on_evaluate(
            self,
            args: TrainingArguments,
            trainer_state: TrainerState,
            control: TrainerControl,
            **kwargs: Any,
        ) -> None:
            self.offered(trainer_state)

        def offered(self, trainer_state: TrainerState) -> None:
            if trainer_state.global_step % save_every == 0:
                pause.hold("async", trainer_state.global_step)

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)

    def record_loss(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if module.training and getattr(output, "loss", None) is not None:
            progress["micro"].append(float(output.loss.detach()))

    model.register_forward_hook(record_loss)
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=int(case["steps"]),
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=3e-3,
        weight_decay=0.01,
        lr_scheduler_type="inverse_sqrt",
        warmup_steps=3,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=seed,
        dataloader_num_workers=int(case["workers"]),
        disable_tqdm=True,
    )
    spot = SpotckptCallback(
        case["uri"], interval_steps=save_every, async_save=bool(case["async_save"])
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        callbacks=[Probe(), spot, Tail()],
    )
    trainer.train(resume_from_checkpoint=spot.resume_from_checkpoint())
    final = training_digests(trainer.model, trainer.optimizer, trainer.lr_scheduler)
    write_json(out / f"final-rank{me}.json", final)
    return 0


if __name__ == "__main__":
    sys.exit(serve(DESCRIBE, run))
