"""The lazy reader against a manager's restore, in one run: what reading weights alone costs.

    python benchmarks/lazy_read.py                      # 256 MiB on moto (loopback) and a folder
    python benchmarks/lazy_read.py --mib 64 --repeat 1  # a quick look

Saves a model of `--mib` MiB in 4 tensors (and its AdamW moments, so the checkpoint holds 3x
that) once per store, then times, each the median of `--repeat` runs: `CheckpointManager.restore`
of the model alone (the training path), `spotckpt.load_weights` into a fresh model, and
`open_checkpoint(...).get_slice(name)[rows]` of 1/64 of one tensor's rows, whose bytes read are
counted. Prints seconds and the ratios against the restore measured in the same run.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import boto3
import torch
from moto.server import ThreadedMotoServer
from torch import nn

import spotckpt
from spotckpt import CheckpointManager, TrainState
from spotckpt.storage import open_store

WIDTH = 4096


class _Counting:
    """A store whose ranged reads count their bytes; everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bytes_read = 0

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        placed: int = self.inner.get_range_into(key, start, buffer)
        self.bytes_read += placed
        return placed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _model(mib: int) -> nn.Module:
    rows = mib * (1 << 20) // (4 * WIDTH * 4)  # 4 float32 tensors of rows x WIDTH
    return nn.ModuleList(nn.Linear(WIDTH, rows, bias=False) for _ in range(4))


def _median(repeat: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bench(uri: str, mib: int, repeat: int) -> None:
    model = _model(mib)
    optimizer = torch.optim.AdamW(model.parameters())
    for layer in model:
        layer(torch.zeros(1, WIDTH)).sum().backward()
    optimizer.step()  # AdamW moments: the checkpoint holds more than the weights
    with CheckpointManager(uri, preemption=False) as manager:
        manager.save(1, TrainState(model=model, optimizer=optimizer, rng=False), blocking=True)

    def restore() -> None:
        with CheckpointManager(uri, preemption=False) as manager:
            manager.restore(TrainState(model=_model(mib), rng=False), strict=False)

    def load() -> None:
        spotckpt.load_weights(uri, _model(mib))

    store = _Counting(open_store(uri))
    rows = model[0].weight.shape[0] // 64

    def read_slice() -> None:
        with spotckpt.open_checkpoint(store) as checkpoint:  # type: ignore[arg-type]
            checkpoint.get_slice("model.0.weight")[:rows]

    restored = _median(repeat, restore)
    loaded = _median(repeat, load)
    before = store.bytes_read
    sliced = _median(repeat, read_slice)
    slice_bytes = (store.bytes_read - before) // repeat
    tensor_bytes = model[0].weight.numel() * 4
    store.inner.close()
    kind = "s3 (moto)" if uri.startswith("s3://") else "local folder"
    print(f"{kind}: {mib} MiB of weights, {3 * mib} MiB checkpoint")
    print(f"  restore (model only)   {restored:7.3f} s  1.00x")
    print(f"  load_weights           {loaded:7.3f} s  {loaded / restored:.2f}x of restore")
    print(
        f"  get_slice 1/64 rows    {sliced:7.3f} s  {sliced / restored:.3f}x of restore, "
        f"{slice_bytes / tensor_bytes:.4f}x the tensor's bytes read"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="spotckpt-lazy-") as folder:
        _bench(f"{folder}/ckpt", args.mib, args.repeat)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
        )
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="lazy")
        _bench("s3://lazy/ckpt", args.mib, args.repeat)
    finally:
        server.stop()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
