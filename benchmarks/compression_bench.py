"""Does lossless compression of checkpoint bytes pay for itself? Measured on trained state.

    python benchmarks/compression_bench.py                # ~4 M parameters, 300 steps
    python benchmarks/compression_bench.py --steps 100 --width 256

Trains a small transformer on synthetic data for `--steps` steps (no downloads), then takes its
weights in bf16 and AdamW's fp32 moments (``exp_avg``, ``exp_avg_sq``) and compresses each
tensor's bytes per block of 64 KiB (spotckpt's CRC block, so a ranged read would need only the
blocks it touches) in three ways: zstd on the bytes as they are, zstd after byte grouping (the
k-th byte of every element together: exponents compress, mantissas barely; zipnn's idea), and
the same at a higher level. Printed per state part: the size ratio (raw / compressed) and the
compression throughput of one core; then, for a link of `--link-mib` MiB/s, the time of a save
of that state raw against compressed, compression pipelined with the upload on `--cores`
cores: ``max(size / (cores * throughput), compressed / link)``, a model from the figures
measured here (not a measured upload). Targets (issue 32): bf16 weights >= 1.25x smaller, fp32
moments >= 1.1x, the compressed save faster at 100 MiB/s.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import zstandard
from torch import nn

MIB = 1 << 20
BLOCK = 64 << 10


def train(steps: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small transformer language model trained on a synthetic copying task."""
    torch.manual_seed(0)
    vocab, length = 512, 64
    model = nn.Sequential(
        nn.Embedding(vocab, width),
        nn.TransformerEncoder(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True), 4
        ),
        nn.Linear(width, vocab),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (16, length), generator=generator)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.roll(1, 1).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def as_is(block: torch.Tensor, itemsize: int) -> bytes:
    """The block's bytes unchanged."""
    return block.numpy().tobytes()


def grouped(block: torch.Tensor, itemsize: int) -> bytes:
    """The block's bytes with the k-th byte of every element together."""
    usable = len(block) - len(block) % itemsize
    planes = block[:usable].reshape(-1, itemsize).t().contiguous()
    return planes.numpy().tobytes() + block[usable:].numpy().tobytes()


def compressed_size(
    tensors: list[torch.Tensor], transform: Callable[[torch.Tensor, int], bytes], level: int
) -> tuple[int, int, float]:
    """Raw bytes, compressed bytes (per 64 KiB block) and seconds spent compressing."""
    compressor = zstandard.ZstdCompressor(level=level)
    raw = packed = 0
    seconds = 0.0
    for tensor in tensors:
        data = tensor.contiguous().view(torch.uint8).reshape(-1)
        itemsize = tensor.element_size()
        started = time.perf_counter()
        for start in range(0, len(data), BLOCK):
            block = data[start : start + BLOCK]
            packed += min(len(compressor.compress(transform(block, itemsize))), len(block))
        seconds += time.perf_counter() - started
        raw += len(data)
    return raw, packed, seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--link-mib", type=float, default=100.0)
    parser.add_argument("--cores", type=int, default=4)
    args = parser.parse_args(argv)
    started = time.monotonic()
    model, optimizer = train(args.steps, args.width)
    print(f"trained {args.steps} steps in {time.monotonic() - started:.0f} s")
    parts = {
        "bf16 weights": [p.detach().to(torch.bfloat16) for p in model.parameters()],
        "fp32 exp_avg": [s["exp_avg"] for s in optimizer.state.values()],
        "fp32 exp_avg_sq": [s["exp_avg_sq"] for s in optimizer.state.values()],
    }
    ways: dict[str, tuple[Callable[[torch.Tensor, int], bytes], int]] = {
        "zstd-1": (as_is, 1),
        "grouped+zstd-1": (grouped, 1),
        "grouped+zstd-3": (grouped, 3),
    }
    link = args.link_mib * MIB
    for name, tensors in parts.items():
        for way, (transform, level) in ways.items():
            raw, packed, seconds = compressed_size(tensors, transform, level)
            throughput = raw / seconds
            plain_s = raw / link
            packed_s = max(raw / (args.cores * throughput), packed / link)
            print(
                f"{name:16s} {way:15s} {raw / MIB:7.1f} MiB  x{raw / packed:.3f} smaller  "
                f"{throughput / MIB:6.0f} MiB/s/core  save at {args.link_mib:g} MiB/s: "
                f"{plain_s:.2f} s raw, {packed_s:.2f} s compressed (x{plain_s / packed_s:.2f})"
            )


if __name__ == "__main__":
    main()
