"""A tiny character-level transformer that survives spot eviction.

Read this top to bottom: data, model, then the training loop, which is ordinary PyTorch plus four
spotckpt calls (`from_config`, `restore`, `maybe_save`, `should_stop`). The data loader is driven
by a `ResumableSampler`, and its dataset is wrapped in a `SeededDataset`, so that the random
masking drawn in the worker processes is reproduced exactly after a resume.

    SPOTCKPT_URI=s3://bucket/runs/tiny python examples/train.py --steps 200
    SPOTCKPT_URI=/tmp/ckpt-ddp spotckpt launch --standalone --nproc-per-node=2 examples/train.py
    SPOTCKPT_URI=s3://bucket/runs/tiny python examples/train.py --save-every 25 \
        --local-dir '/mnt/nvme/ckpt/{node}' --local-every 5

With `--local-dir` (or ``SPOTCKPT_LOCAL_DIR``) the manager keeps a fast tier on the node's own
disk: `--local-every` steps go there only, `--save-every` steps also go to the store, and a
restart on the same node restores from it. After a restore rank 0 logs where the bytes came
from (``restore read: local N B, peer N B, store N B``).

Rank 0 logs the loss every `--log-every` steps (default 10). On SIGTERM (or a cloud eviction
notice) it commits a checkpoint of the current step and exits with status 75
(`spotckpt.PREEMPTED_EXIT_CODE`); started again, it continues from there, producing exactly the
losses and final weights that an uninterrupted run produces.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from spotckpt import (
    PREEMPTED_EXIT_CODE,
    CheckpointManager,
    ResumableSampler,
    SeededDataset,
    TrainState,
    track_batches,
)

log = logging.getLogger("train")

# Data: a small synthetic corpus, generated deterministically so nothing is downloaded. ----------

WORDS = [
    "spot",
    "machines",
    "are",
    "cheap",
    "because",
    "the",
    "cloud",
    "may",
    "take",
    "them",
    "back",
    "at",
    "any",
    "moment",
    "so",
    "a",
    "job",
    "must",
    "save",
    "its",
    "state",
    "often",
    "and",
    "resume",
    "where",
    "it",
    "stopped",
    "without",
    "losing",
    "a",
    "single",
    "step",
]


def make_corpus(characters: int = 60_000, seed: int = 1234) -> str:
    """Pseudo-sentences from a fixed vocabulary."""
    rng = random.Random(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < characters:
        sentence = rng.choices(WORDS, k=rng.randint(4, 12))
        words.extend([*sentence[:-1], sentence[-1] + "."])
    return " ".join(words)[:characters]


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of characters: input and next-character target.

    As augmentation, each input character is replaced by a mask token with probability
    `mask_rate`, drawn from torch's RNG in the worker that loads the window.
    """

    def __init__(self, text: str, window: int, mask_rate: float = 0.1) -> None:
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.window = window
        self.mask_rate = mask_rate
        self.mask_token = len(self.vocab)
        self.tokens = len(self.vocab) + 1  # the characters and the mask token

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.window

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.window
        chunk = self.data[start : start + self.window + 1]
        masked = torch.rand(self.window) < self.mask_rate
        return chunk[:-1].masked_fill(masked, self.mask_token), chunk[1:]


# Model ------------------------------------------------------------------------------------------


class TinyTransformer(nn.Module):
    """Embedding, two causal transformer layers with dropout, and a linear head."""

    def __init__(self, vocab: int, window: int, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(window, width))
        layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, dropout=0.1, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(window))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(x, mask=self.mask, is_causal=True))


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to a tenth of the peak."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# Training loop -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    parser.add_argument("--save-every", type=int, default=None, help="checkpoint interval")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--corpus-chars", type=int, default=60_000, help="size of the text")
    parser.add_argument("--workers", type=int, default=2, help="data-loader worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-save", action="store_true", help="upload in the background")
    parser.add_argument(
        "--local-dir", help="fast tier: a folder on each node ({node}: the node id)"
    )
    parser.add_argument(
        "--local-every", type=int, default=None, help="fast-tier save interval (needs a local dir)"
    )
    parser.add_argument(
        "--log-every", type=int, default=10, help="log the loss every N steps on rank 0 (0: never)"
    )
    parser.add_argument("--loss-log", type=Path, help="append one JSON line per step here")
    parser.add_argument("--digest-file", type=Path, help="write the final weights' digest here")
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (demo)")
    parser.add_argument(
        "--kill-after-commit",
        type=int,
        default=None,
        help="testing: SIGKILL this process right after the checkpoint of this step commits",
    )
    return parser.parse_args(argv)


def setup_distributed() -> tuple[int, int]:
    """Join the torchrun process group (gloo) when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """SHA-256 of every parameter and every optimizer tensor, to compare runs bit for bit."""
    params = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        params.update(name.encode() + raw.tobytes())
    moments = hashlib.sha256()
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            if isinstance(value, torch.Tensor):
                raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                moments.update(f"{index}.{key}".encode() + raw.tobytes())
    return {"params": params.hexdigest(), "optimizer": moments.hexdigest()}


def log_restore_sources(sources: dict[str, int]) -> None:
    """Where the restore's bytes came from (job-wide): the node's tier, peers, the store."""
    log.info(
        "restore read: local %d B, peer %d B, store %d B",
        sources.get("local", 0),
        sources.get("peer", 0),
        sources.get("store", 0),
    )


def batches(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches forever, epoch after epoch, resuming where the sampler left off."""
    while True:
        yield from track_batches(loader)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rank, world = setup_distributed()
    torch.manual_seed(args.seed + rank)
    torch.set_num_threads(1)

    windows = CharWindows(make_corpus(args.corpus_chars), args.window)
    # Each window's masking is seeded from (seed, epoch, index), whichever worker loads it.
    dataset = SeededDataset(windows, seed=args.seed + rank)
    sampler = ResumableSampler(len(dataset), seed=args.seed + rank)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),  # keeps the global RNG untouched
    )
    model: nn.Module = TinyTransformer(windows.tokens, args.window)
    if world > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(20, args.steps))
    state = TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataloader=loader,
        extra={"tokens_seen": 0},
    )

    given = {  # options left out on the command line come from SPOTCKPT_* and spotckpt.toml
        "interval_steps": args.save_every,
        "async_save": args.async_save or None,
        "local_dir": args.local_dir,
        "local_interval_steps": args.local_every,
    }
    manager = CheckpointManager.from_config(**{k: v for k, v in given.items() if v is not None})
    restored = manager.restore(state)
    start = 1 if restored is None else restored + 1
    if rank == 0:
        log.info("starting at step %d (restored: %s)", start, restored)
        if restored is not None:
            log_restore_sources(manager.last_restore_sources)

    stream = batches(loader)
    for step in range(start, args.steps + 1):
        model.train()
        total = 0.0
        for _ in range(args.accumulate):
            tokens, targets = next(stream)
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            (loss / args.accumulate).backward()
            total += loss.item() / args.accumulate
            state.extra["tokens_seen"] += tokens.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if rank == 0 and args.log_every > 0 and step % args.log_every == 0:
            log.info("step %d: loss %.4f", step, total)
        if rank == 0 and args.loss_log:
            with open(args.loss_log, "a") as out:
                out.write(json.dumps({"step": step, "loss": float(total).hex()}) + "\n")
        if args.step_delay:
            time.sleep(args.step_delay)
        saved = manager.maybe_save(step, state, user_metadata={"loss": total})
        if saved and args.kill_after_commit == step:
            manager.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        if manager.should_stop():
            log.info("rank %d: preempted; checkpoint of step %d committed, exiting", rank, step)
            manager.close()
            return PREEMPTED_EXIT_CODE

    manager.wait()  # an asynchronous save of the last step may still be uploading
    if manager.latest_step() != args.steps:
        manager.save(args.steps, state)
    manager.close()
    if rank == 0 and args.digest_file:
        args.digest_file.write_text(json.dumps(digest(_unwrap(model), optimizer)))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


if __name__ == "__main__":
    sys.exit(main())
