"""Does lossless compression of checkpoint bytes pay for itself? Measured on trained state.

    python benchmarks/compression_bench.py                # ~4 M parameters, 300 steps
    python benchmarks/compression_bench.py --steps 100 --width 256
    python benchmarks/compression_bench.py --saves        # also real saves over a 100 MiB/s link

Trains a small transformer on synthetic data for `--steps` steps (no downloads), then takes its
weights in bf16 and AdamW's fp32 moments (``exp_avg``, ``exp_avg_sq``) and compresses each
tensor's bytes per block of 64 KiB (spotckpt's CRC block, so a ranged read would need only the
blocks it touches) in four ways: zstd on the bytes as they are, zstd after byte grouping (the
k-th byte of every element together: exponents compress, mantissas barely; zipnn's idea), the
same at a higher level, and spotckpt's codec (`spotckpt.format.compression`: each byte plane
compressed on its own, kept raw where that does not pay). Printed per state part: the size
ratio (raw / compressed) and the compression throughput of one core; then, for a link of
`--link-mib` MiB/s, the time of a save of that state raw against compressed, compression
pipelined with the upload on `--cores` cores:
``max(size / (cores * throughput), compressed / link)``, a model from the figures measured here
(not a measured upload). Targets (issue 32): bf16 weights >= 1.25x smaller, fp32
moments >= 1.1x, the compressed save faster at 100 MiB/s.

With ``--saves``, the same state (bf16 weights, fp32 moments) is also saved and restored for
real by `spotckpt.CheckpointManager` into a moto S3 server behind the cloud model's proxy
(benchmarks/cloud_model.py) limited to `--link-mib` MiB/s for the node and 20 ms to the first
byte: ``compression="off"`` against ``"on"`` (spotckpt's codec, `spotckpt.format.compression`),
each `--repeats` times, medians printed with their ratio, and the restores checked bit-exact.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import zstandard
from torch import nn

from spotckpt.format.compression import encode_block

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
    tensors: list[torch.Tensor], transform: Callable[[torch.Tensor, int], bytes] | None, level: int
) -> tuple[int, int, float]:
    """Raw bytes, compressed bytes (per 64 KiB block) and seconds spent compressing; without a
    `transform`, spotckpt's own codec (each plane compressed on its own)."""
    compressor = zstandard.ZstdCompressor(level=level)
    raw = packed = 0
    seconds = 0.0
    for tensor in tensors:
        data = tensor.contiguous().view(torch.uint8).reshape(-1)
        itemsize = tensor.element_size()
        started = time.perf_counter()
        for start in range(0, len(data), BLOCK):
            block = data[start : start + BLOCK]
            if transform is None:
                packed += len(encode_block(memoryview(block.numpy()), itemsize, compressor))
                continue
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
    parser.add_argument("--saves", action="store_true", help="also real saves over the link")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.monotonic()
    model, optimizer = train(args.steps, args.width)
    print(f"trained {args.steps} steps in {time.monotonic() - started:.0f} s")
    parts = {
        "bf16 weights": [p.detach().to(torch.bfloat16) for p in model.parameters()],
        "fp32 exp_avg": [s["exp_avg"] for s in optimizer.state.values()],
        "fp32 exp_avg_sq": [s["exp_avg_sq"] for s in optimizer.state.values()],
    }
    ways: dict[str, tuple[Callable[[torch.Tensor, int], bytes] | None, int]] = {
        "zstd-1": (as_is, 1),
        "grouped+zstd-1": (grouped, 1),
        "grouped+zstd-3": (grouped, 3),
        "spotckpt planes": (None, 1),
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
    if args.saves:
        state = {
            f"{part.replace(' ', '_')}.{number}": tensor.contiguous()
            for part, tensors in parts.items()
            for number, tensor in enumerate(tensors)
        }
        measured_saves(state, args.link_mib, args.repeats)


def measured_saves(state: dict[str, torch.Tensor], link_mib: float, repeats: int) -> None:
    """Median save and restore seconds of `state` with compression off and on, over the link."""
    import sys
    import tempfile
    from pathlib import Path
    from statistics import median

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench_servers import BUCKET, MotoServer, apply_fake_env
    from cloud_model import CloudProxy, Profile

    from spotckpt import CheckpointManager

    apply_fake_env()
    raw_bytes = sum(t.numel() * t.element_size() for t in state.values())
    link = Profile("link", link_mib * MIB, link_mib * MIB, 0.02, None, None)
    with tempfile.TemporaryDirectory(prefix="compression-bench-") as folder:
        server = MotoServer(Path(folder))
        server.start()
        proxy = CloudProxy(server.endpoint, link)
        options = {"endpoint_url": proxy.endpoint}
        try:
            seconds: dict[str, tuple[list[float], list[float]]] = {}
            for mode in ("off", "on"):
                saves, restores = seconds.setdefault(mode, ([], []))
                uri = f"s3://{BUCKET}/compression-{mode}"
                for step in range(repeats):
                    with CheckpointManager(
                        uri, compression=mode, preemption=False, storage_options=options
                    ) as mgr:
                        started = time.perf_counter()
                        mgr.save(step, state)
                        saves.append(time.perf_counter() - started)
                        stored = mgr.catalog.read_manifest(step).total_bytes
                        loaded = {k: torch.empty_like(v) for k, v in state.items()}
                        started = time.perf_counter()
                        mgr.restore(loaded, step)
                        restores.append(time.perf_counter() - started)
                    if not all(torch.equal(loaded[k], v) for k, v in state.items()):
                        raise AssertionError(f"compression={mode}: restore differs")
                print(
                    f"compression={mode:3s} {raw_bytes / MIB:7.1f} MiB -> {stored / MIB:7.1f} MiB "
                    f"stored; save {median(saves):.2f} s, restore {median(restores):.2f} s "
                    f"(medians of {repeats}, {link_mib:g} MiB/s link)"
                )
            (off_save, off_restore), (on_save, on_restore) = seconds["off"], seconds["on"]
            print(
                f"compressed save x{median(off_save) / median(on_save):.2f} faster, restore "
                f"x{median(off_restore) / median(on_restore):.2f} faster than uncompressed"
            )
        finally:
            proxy.close()
            server.stop()


if __name__ == "__main__":
    main()
