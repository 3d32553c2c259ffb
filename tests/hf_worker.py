"""A tiny GPT-2, built from a config, trained by `transformers.Trainer` with `SpotckptCallback`.

Run as a child process by tests/integrations/test_transformers_integration.py:

    python hf_worker.py URI OUT_DIR --steps 14 [--stop-at K] [--workers N] [--no-resume]
        [--keep-last N]

With ``--stop-at K`` it prints ``REACHED K`` on stdout at the end of optimizer step K and waits
there for SIGTERM, so that the emergency save is of step K. On completion it writes
``OUT_DIR/digest.json``: a SHA-256 of every parameter and optimizer tensor, and the Trainer's
step, epoch and log history.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from spotckpt.integrations.transformers import SpotckptCallback

from tests_support import SignalledFlag

EXAMPLES = 44  # 11 batches of 4: with 2 accumulation steps, an epoch is 6 optimizer steps
BATCH = 4
ACCUMULATE = 2
LENGTH = 16
VOCAB = 64


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Fixed random token sequences; the labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (EXAMPLES, LENGTH), generator=generator)

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class StopAt(TrainerCallback):
    """At the end of step `step`: tell the test, then wait until SIGTERM has arrived."""

    def __init__(self, step: int | None, signalled: SignalledFlag) -> None:
        self.step = step
        self.signalled = signalled

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step == self.step:
            print(f"REACHED {self.step}", flush=True)
            if not self.signalled.wait(timeout=600):
                raise SystemExit("no SIGTERM came")


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """SHA-256 of each parameter and buffer, and of each optimizer state tensor."""

    def sha(value: torch.Tensor) -> str:
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return hashlib.sha256(raw.tobytes()).hexdigest()

    found = {f"param:{name}": sha(value) for name, value in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                found[f"optim:{index}.{key}"] = sha(value)
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("uri")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--workers", type=int, default=0, help="data-loader worker processes")
    parser.add_argument("--no-resume", action="store_true", help="do not pass the resume folder")
    parser.add_argument("--keep-last", type=int, help="retention (default: the manager's)")
    options = parser.parse_args()

    signalled = SignalledFlag()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signalled.set()  # chained to by spotckpt's handler, which records the preemption

    signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    # dropout 0.1 in embeddings, attention and residuals: every step draws random numbers
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(options.out / "trainer"),
        max_steps=options.steps,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        learning_rate=3e-3,
        weight_decay=0.01,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=options.workers,
        disable_tqdm=True,
    )
    keep = {} if options.keep_last is None else {"keep_last": options.keep_last}
    spot = SpotckptCallback(options.uri, interval_steps=options.save_every, **keep)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        callbacks=[StopAt(options.stop_at, signalled), spot],
    )
    resume = None if options.no_resume else spot.resume_from_checkpoint()
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.optimizer is not None
    result = {
        "tensors": digest(trainer.model, trainer.optimizer),
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "log_steps": [entry.get("step") for entry in trainer.state.log_history],
        "resumed_from": None if resume is None else Path(resume).name.split("-")[2],
    }
    (options.out / "digest.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
