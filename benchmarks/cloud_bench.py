"""Benchmarks under the cloud model (benchmarks/cloud_model.py), each ratio measured in one run.

    python benchmarks/cloud_bench.py proxy      # the proxy's own ceiling: direct vs proxied
    python benchmarks/cloud_bench.py throttled  # 32 ranks into one prefix under "stress"
    python benchmarks/cloud_bench.py all --ranks 32 --mib 8

- ``proxy``: one S3 store uploads and downloads the same object directly from SeaweedFS
  (moto if ``weed`` is missing) and through a `CloudProxy` whose limits are all off; the ratio
  says whether the proxy caps what it models.
- ``throttled``: `--ranks` simulated ranks (threads, each with its own S3 store, as each rank
  process has) write a rank object of `--mib` MiB (multipart) and an index part, create-only,
  into one attempt folder; the coordinator then puts the manifest. Once under the "stress"
  profile with its request rates off (bandwidth and latency only), once with them (SlowDown
  beyond them), once with them and ``prefix_spread``. Printed: seconds, failures, the throttled
  answers and the time the stores lost to them, and the ratios to the bandwidth-only save.

Nothing here contacts a non-loopback address.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_servers import BUCKET, MotoServer, Server, WeedServer, apply_fake_env, weed_binary
from cloud_model import CloudProxy, Profile, profile

from spotckpt.layout import index_part_key, rank_object_key
from spotckpt.storage.s3 import S3Store, open_s3_store

MIB = 1 << 20
OPEN = Profile("open", None, None, 0.0, None, None)


def _store(endpoint: str, prefix: str, concurrency: int = 8) -> S3Store:
    return open_s3_store(
        f"s3://{BUCKET}/{prefix}",
        {"endpoint_url": endpoint, "part_size": 5 * MIB, "max_concurrency": concurrency},
    )


def _transfer(endpoint: str, prefix: str, data: bytes) -> tuple[float, float]:
    store = _store(endpoint, prefix)
    try:
        started = time.monotonic()
        with store.open_writer("object") as writer:
            writer.write(data)
        put_s = time.monotonic() - started
        started = time.monotonic()
        got = store.get("object")
        get_s = time.monotonic() - started
        assert got == data
        return put_s, get_s
    finally:
        store.close()


def bench_proxy(server: Server, mib: int) -> dict[str, Any]:
    """Direct vs proxied throughput of one object, best of three each, interleaved."""
    data = os.urandom(mib * MIB)
    proxy = CloudProxy(server.endpoint, OPEN)
    direct: list[tuple[float, float]] = []
    proxied: list[tuple[float, float]] = []
    try:
        for rep in range(3):
            direct.append(_transfer(server.endpoint, f"proxy-bench/direct-{rep}", data))
            proxied.append(_transfer(proxy.endpoint, f"proxy-bench/proxied-{rep}", data))
    finally:
        proxy.close()
    put_d, get_d = min(p for p, _ in direct), min(g for _, g in direct)
    put_p, get_p = min(p for p, _ in proxied), min(g for _, g in proxied)
    result = {
        "mib": mib,
        "direct_put_mib_s": mib / put_d,
        "direct_get_mib_s": mib / get_d,
        "proxied_put_mib_s": mib / put_p,
        "proxied_get_mib_s": mib / get_p,
        "put_ratio": put_d / put_p,
        "get_ratio": get_d / get_p,
    }
    print(
        f"proxy ({mib} MiB, best of 3): put direct {result['direct_put_mib_s']:.0f} MiB/s, "
        f"proxied {result['proxied_put_mib_s']:.0f} MiB/s (x{result['put_ratio']:.2f}); get "
        f"direct {result['direct_get_mib_s']:.0f} MiB/s, proxied "
        f"{result['proxied_get_mib_s']:.0f} MiB/s (x{result['get_ratio']:.2f})"
    )
    return result


def ranks_save(
    endpoint: str, prefix: str, ranks: int, mib: int, spread: bool
) -> tuple[float, int, int, float]:
    """One simulated save: seconds, failed ranks, throttled answers, seconds lost to them."""
    attempt = os.urandom(8).hex()
    stores = [_store(endpoint, prefix, concurrency=4) for _ in range(ranks)]
    body = os.urandom(mib * MIB)
    start = threading.Barrier(ranks + 1)

    def rank_save(rank: int) -> bool:
        store = stores[rank]
        start.wait()
        try:
            key = f"step-000001/{rank_object_key(attempt, rank, spread)}"
            with store.open_writer(key, create_only=True) as writer:
                writer.write(body)
            store.put(f"step-000001/{index_part_key(attempt, rank)}", b"{}", create_only=True)
            return True
        except Exception as error:  # counted as a failed rank, the benchmark goes on
            print(f"rank {rank} failed: {error}", file=sys.stderr)
            return False

    with ThreadPoolExecutor(ranks) as pool:
        futures = [pool.submit(rank_save, rank) for rank in range(ranks)]
        start.wait()
        started = time.monotonic()
        done = [future.result() for future in futures]
    failed = done.count(False)
    if not failed:
        stores[0].put("step-000001/manifest.json", b"{}", create_only=True)
    seconds = time.monotonic() - started
    throttled = sum(store.throttle.stats().throttled for store in stores)
    lost = sum(store.throttle.stats().waited_s for store in stores)
    for store in stores:
        store.close()
    return seconds, failed, throttled, lost


def bench_throttled(server: Server, ranks: int, mib: int) -> dict[str, Any]:
    """The same save under the stress profile's bandwidth alone, with its request rates, and
    with its rates and prefix_spread."""
    stress = profile("stress")
    variants = {
        "bandwidth_only": (stress.scaled(writes_per_s=None, reads_per_s=None), False),
        "throttled": (stress, False),
        "throttled_spread": (stress, True),
    }
    result: dict[str, Any] = {"ranks": ranks, "mib": mib}
    for name, (limits, spread) in variants.items():
        proxy = CloudProxy(server.endpoint, limits)
        try:
            seconds, failed, throttled, lost = ranks_save(
                proxy.endpoint, f"throttle-bench/{name}", ranks, mib, spread
            )
            seen = proxy.counts["write"]
        finally:
            proxy.close()
        result[name] = {
            "seconds": seconds,
            "failed": failed,
            "throttled": throttled,
            "lost_s": lost,
            "writes": seen,
        }
        print(
            f"{ranks} ranks x {mib} MiB, {name}: {seconds:.2f} s, {failed} failed, {throttled} "
            f"SlowDown of {seen} writes, {lost:.1f} s lost to throttling (summed over requests)"
        )
    base = result["bandwidth_only"]["seconds"]
    for name in ("throttled", "throttled_spread"):
        result[name]["ratio"] = result[name]["seconds"] / base
        print(f"{name} / bandwidth_only: x{result[name]['ratio']:.2f} (target <= 1.5)")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["proxy", "throttled", "all"])
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--mib", type=int, default=8, help="MiB per rank (throttled)")
    parser.add_argument("--proxy-mib", type=int, default=256)
    parser.add_argument("--moto", action="store_true", help="moto even if weed is installed")
    args = parser.parse_args(argv)
    apply_fake_env()
    with tempfile.TemporaryDirectory(prefix="cloud-bench-") as folder:
        binary = None if args.moto else weed_binary()
        server: Server = WeedServer(Path(folder), binary) if binary else MotoServer(Path(folder))
        server.start()
        print(f"server: {type(server).__name__}")
        try:
            if args.what in ("proxy", "all"):
                bench_proxy(server, args.proxy_mib)
            if args.what in ("throttled", "all"):
                bench_throttled(server, args.ranks, args.mib)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
