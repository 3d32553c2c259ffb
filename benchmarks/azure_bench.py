"""spotckpt save and restore against raw azure-storage-blob transfers of the same bytes, on Azurite,
in one run.

    python benchmarks/azure_bench.py                 # 256 MiB in 16 MiB tensors, 3 repetitions
    python benchmarks/azure_bench.py --mib 64 --reps 1

Starts Azurite (``make azurite`` installs it; ``$AZURITE_BLOB_COMMAND`` points elsewhere) in memory
on 127.0.0.1. Each repetition measures, on the same state dict:

- ``spotckpt save``: `CheckpointManager.save` of the state to ``az://`` (safetensors objects,
  staged blocks, the create-only manifest), with the store's defaults (16 MiB blocks, 8 in
  flight, MD5 of each block);
- ``raw save``: one ``upload_blob`` per tensor of its bytes, copied out of the tensor before
  the clock starts (the SDK's own parallel block upload, 8 in flight, MD5 of each block as
  well, so that both send the same checks);
- ``spotckpt restore``: `CheckpointManager.restore` into preallocated tensors;
- ``raw restore``: one ``download_blob(max_concurrency=8).readinto`` per tensor into its memory.

It prints the medians and the ratios spotckpt / raw (below 1.0: spotckpt was faster). Azurite is
a single Node.js process: the absolute numbers say more about it than about Azure; the ratios
say what spotckpt adds on top of the SDK.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from azure.storage.blob import BlobServiceClient

from spotckpt import CheckpointManager

MIB = 1 << 20
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def azurite() -> Iterator[str]:
    """Azurite in memory on a free loopback port; yields its connection string."""
    command = os.environ.get("AZURITE_BLOB_COMMAND") or str(
        ROOT / ".azurite/node_modules/.bin/azurite-blob"
    )
    if not Path(command).exists():
        raise SystemExit("Azurite is not installed: run `make azurite`")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workspace = tempfile.mkdtemp(prefix="azurite-bench-")
    args = [command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--silent"]
    args += ["--skipApiVersionCheck", "--loose", "--inMemoryPersistence", "--disableTelemetry"]
    process = subprocess.Popen(args, cwd=workspace, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise SystemExit("Azurite did not start") from None
                time.sleep(0.05)
        yield (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"
        )
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(workspace, ignore_errors=True)


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state size (default 256)")
    parser.add_argument("--tensor-mib", type=int, default=16, help="tensor size (default 16)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    count = max(1, args.mib // args.tensor_mib)
    numel = args.tensor_mib * MIB // 4
    state = {f"layer{i}": torch.randn(numel) for i in range(count)}
    target = {name: torch.empty_like(t) for name, t in state.items()}
    total = count * args.tensor_mib * MIB
    times: dict[str, list[float]] = {
        k: [] for k in ("spot_save", "raw_save", "spot_load", "raw_load")
    }
    with azurite() as connection_string:
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string
        client = BlobServiceClient.from_connection_string(
            connection_string, max_block_size=16 * MIB
        )
        for rep in range(args.reps):
            for name, seconds in one_repetition(client, rep + 1, state, target).items():
                times[name].append(seconds)
            print(
                f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                flush=True,
            )
    median = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\n{total / MIB:.0f} MiB in {count} tensors on Azurite, {args.reps} repetitions (medians)"
    )
    for op, spot, raw in (("save", "spot_save", "raw_save"), ("restore", "spot_load", "raw_load")):
        spot_rate, raw_rate = total / MIB / median[spot], total / MIB / median[raw]
        print(
            f"{op:8s} spotckpt {median[spot]:6.2f} s ({spot_rate:6.1f} MiB/s)  "
            f"raw azure-storage-blob {median[raw]:6.2f} s ({raw_rate:6.1f} MiB/s)  "
            f"ratio {median[spot] / median[raw]:.2f}"
        )
    return 0


def one_repetition(
    client: BlobServiceClient,
    step: int,
    state: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
) -> dict[str, float]:
    """The four timings of one repetition, in a container of its own (deleted after)."""
    container = f"bench-{uuid.uuid4().hex[:8]}"
    client.create_container(container)
    box = client.get_container_client(container)
    uri = f"az://{container}/runs/bench"

    payloads = {name: tensor.numpy().tobytes() for name, tensor in state.items()}  # untimed

    def raw_save() -> None:
        for name, payload in payloads.items():
            box.upload_blob(
                f"raw/{name}",
                payload,
                overwrite=True,
                max_concurrency=8,
                validate_content=True,
            )

    def raw_load() -> None:
        for name, tensor in target.items():
            stream = _Into(memoryview(tensor.numpy()).cast("B"))
            box.download_blob(f"raw/{name}", max_concurrency=8).readinto(stream)

    found: dict[str, float] = {}
    with CheckpointManager(uri, preemption=False) as manager:
        found["spot_save"] = timed(lambda: manager.save(step, state))
    found["raw_save"] = timed(raw_save)
    with CheckpointManager(uri, preemption=False) as manager:
        found["spot_load"] = timed(lambda: manager.restore(target))
    assert all(torch.equal(target[k], state[k]) for k in state)
    for tensor in target.values():
        tensor.zero_()
    found["raw_load"] = timed(raw_load)
    assert all(torch.equal(target[k], state[k]) for k in state)
    client.delete_container(container)
    return found


class _Into:
    """A writable stream over a memoryview, so the SDK's download lands in a tensor's memory."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.at = 0

    def write(self, data: bytes) -> int:
        self.view[self.at : self.at + len(data)] = data
        self.at += len(data)
        return len(data)

    def seekable(self) -> bool:
        return True  # the SDK writes its parallel chunks at their offsets

    def seek(self, offset: int, whence: int = 0) -> int:
        self.at = offset if whence == 0 else self.at + offset
        return self.at

    def tell(self) -> int:
        return self.at


if __name__ == "__main__":
    sys.exit(main())
