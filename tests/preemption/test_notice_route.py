"""The route of an emergency save at a notice: prefixes spread once the bucket throttled, objects
compressed where the link measured earlier makes it pay, the same on every rank; readers need
nothing new (the manifest names each object's key and encoding).

Also the rank script of the two-rank test (run as ``__main__`` by `launch_ranks`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import torch.distributed as dist

from spotckpt import CheckpointManager, PreemptionWatcher
from spotckpt.deadline import UNADAPTED, NoticeAdaptation, adapt_at_notice
from spotckpt.format.compression import ZSTD_PLANES, Compression
from spotckpt.format.encodings import RAW
from spotckpt.format.manifest import Manifest
from spotckpt.layout import compressed_object_key, manifest_key, rank_object_key
from spotckpt.storage import open_store

from dist_worker import launch_ranks
from fault_proxy import SLOW_DOWN, FaultProxy

MIB = 1 << 20
BIG = 9 * MIB
"""Floats of the state's large tensor: 36 MiB, an upload large enough to measure the link."""


@pytest.mark.parametrize(
    ("reports", "prefix_spread", "compression", "spread", "compress"),
    [
        ([(0, False)], False, "off", False, False),  # nothing seen: the settings as they are
        ([(3, False)], False, "off", True, False),  # throttled: spread
        ([(0, False), (2, False)], False, "off", True, False),  # one rank throttled: all spread
        ([(2, True)], True, "off", False, True),  # spread already: only compression adapts
        ([(0, False), (0, True)], False, "off", False, True),  # one rank's link measured
        ([(0, True)], False, "on", False, False),  # "on" compresses by itself
        ([(1, True)], False, "auto", True, False),  # "auto" decides alone; throttling spreads
    ],
)
def test_the_adaptation_follows_what_the_ranks_saw(
    reports: list[tuple[int, bool]],
    prefix_spread: bool,
    compression: str,
    spread: bool,
    compress: bool,
) -> None:
    got = adapt_at_notice(reports, prefix_spread=prefix_spread, compression=compression)
    assert (got.spread, got.compress) == (spread, compress)
    assert got.throttled == sum(count for count, _ in reports)


def test_the_adaptation_is_described_once_for_the_log() -> None:
    assert UNADAPTED.describe() is None
    assert NoticeAdaptation(spread=True, throttled=1).describe() == (
        "prefixes spread (the bucket throttled 1 request)"
    )
    both = NoticeAdaptation(spread=True, compress=True, throttled=4).describe()
    assert both == (
        "prefixes spread (the bucket throttled 4 requests); objects compressed where the "
        "measured link makes it pay"
    )


def test_at_a_notice_compression_follows_the_measured_link() -> None:
    link = Compression("off")
    zeros = torch.zeros(MIB).numpy().data.cast("B")
    noise = torch.randint(0, 256, (4 * MIB,), dtype=torch.uint8).numpy().data
    assert link.at_notice().choose([(zeros, 4)], 1 << 20) is RAW  # no link measured: raw
    link.observe(64 * MIB, 3.2)  # a 20 MiB/s link
    adapted = link.at_notice()
    assert (adapted.mode, adapted.rate, link.mode) == ("auto", link.rate, "off")
    assert adapted.choose([(zeros, 4)], 1 << 20) is ZSTD_PLANES
    assert adapted.choose([(noise, 1)], 1 << 20) is RAW  # nothing to gain: raw
    assert link.choose([(zeros, 4)], 1 << 20) is RAW  # the setting itself stays "off"


def _state(step: int, data: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    if data == "zeros":
        big = torch.zeros(BIG)
        big[:: 4099 + step] = float(step)
    else:
        big = torch.randint(0, 256, (4 * BIG,), dtype=torch.uint8, generator=g)
    return {"big": big, "small": torch.randn(64, generator=g), "step": step}


def _empty(data: str) -> dict[str, Any]:
    big = torch.empty(BIG) if data == "zeros" else torch.empty(4 * BIG, dtype=torch.uint8)
    return {"big": big, "small": torch.empty(64), "step": 0}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("big", "small")) and a["step"] == b["step"]


class SlowDownOnce:
    """The proxy's answer to the first object part (or object) written: 503 SlowDown."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answered = 0

    def __call__(self, method: str, path: str) -> tuple[int, bytes] | None:
        with self.lock:
            if method != "PUT" or self.answered:
                return None
            self.answered += 1
            return 503, SLOW_DOWN


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    name = f"route-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=name)
    return name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("data", ["zeros", "random"])
def test_an_emergency_save_after_throttling_on_a_measured_link(
    moto_endpoint: str,
    bucket: str,
    watcher: PreemptionWatcher,
    caplog: pytest.LogCaptureFixture,
    data: str,
) -> None:
    """A first save (raw, 36 MiB: it measures the link) met one SlowDown; at the notice the
    emergency step spreads its prefixes and, where its data compresses, is stored compressed;
    it restores bit-exact, verifies and survives gc under plain settings."""
    uri = f"s3://{bucket}/run"
    slow_down = SlowDownOnce()
    proxy = FaultProxy(moto_endpoint, rate=0.0, answer=slow_down)
    options = {"endpoint_url": proxy.endpoint, "part_size": 5 * MIB}
    try:
        with CheckpointManager(
            uri, preemption=watcher, interval_steps=100, keep_last=None, storage_options=options
        ) as mgr:
            mgr.save(1, _state(1, data))
            assert slow_down.answered == 1 and mgr._link.rate is not None
            watcher.trigger("test", deadline=time.monotonic() + 120.0)
            with caplog.at_level(logging.WARNING, logger="spotckpt"):
                assert mgr.maybe_save(2, _state(2, data))
            assert mgr.should_stop() and mgr.steps() == [1, 2]
            first, second = mgr.read_manifest(1), mgr.read_manifest(2)
    finally:
        proxy.close()
    compressed = data == "zeros"
    what = "prefixes spread (the bucket throttled 1 request); objects compressed"
    assert f"emergency save to the bucket: {what}" in caplog.text
    assert set(first.objects) == {rank_object_key(first.attempt, 0)}
    spread = rank_object_key(second.attempt, 0, prefix_spread=True)
    assert set(second.objects) == {compressed_object_key(spread) if compressed else spread}
    codec = second.tensors["big"].chunks[0].location.codec
    assert codec.startswith("zstd-planes") if compressed else codec == "", (codec, mgr._link.rate)

    plain = {"endpoint_url": moto_endpoint}
    with CheckpointManager(uri, preemption=False, storage_options=plain) as reader:
        assert not reader.settings.prefix_spread and reader.settings.compression == "off"
        restored = _empty(data)
        assert reader.restore(restored) == 2
        assert _same(restored, _state(2, data))
        assert reader.verify(2).ok
        report = reader.gc(keep_last=1, safety_age_s=0.0)
        assert reader.steps() == [2], report
        assert reader.verify(2).ok  # gc kept every object of the spread step
        restored = _empty(data)
        assert reader.restore(restored) == 2 and _same(restored, _state(2, data))


@pytest.mark.timeout(60)
def test_nothing_adapts_without_throttling_or_a_measured_link(
    tmp_path: Path, watcher: PreemptionWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(str(tmp_path / "ck"), preemption=watcher, interval_steps=100) as mgr:
        mgr.save(1, {"w": torch.zeros(1 << 16)})  # a local folder: no throttle; too small to time
        watcher.trigger("test", deadline=time.monotonic() + 60.0)
        with caplog.at_level(logging.WARNING, logger="spotckpt"):
            assert mgr.maybe_save(2, {"w": torch.zeros(1 << 16)})
        manifest = mgr.read_manifest(2)
    assert set(manifest.objects) == {rank_object_key(manifest.attempt, 0)}
    assert "emergency save to the bucket" not in caplog.text


@pytest.mark.process
@pytest.mark.timeout(240)
def test_ranks_agree_on_the_route_when_one_rank_was_throttled(
    tmp_path: Path, moto_endpoint: str, bucket: str
) -> None:
    """Only rank 1's store (through the proxy) met a SlowDown, and only rank 0 got the notice:
    both ranks' objects of the emergency step are spread (the coordinator, which names every
    rank's key, was never throttled)."""
    out = tmp_path / "out"
    out.mkdir()
    uri = f"s3://{bucket}/run"
    proxy = FaultProxy(moto_endpoint, rate=0.0, answer=SlowDownOnce())
    try:
        args = {"uri": uri, "out": str(out), "endpoints": [moto_endpoint, proxy.endpoint]}
        results = launch_ranks(2, "notice_route", args, worker=__file__)
    finally:
        proxy.close()
    for result in results:
        assert result.returncode == 0, result.stdout[-4000:]
    outcomes = [json.loads((out / f"outcome-{rank}.json").read_text()) for rank in (0, 1)]
    assert [o["throttled"] > 0 for o in outcomes] == [False, True]
    assert all(o["stop"] and o["steps"] == [1, 2] for o in outcomes)
    store = open_store(uri, endpoint_url=moto_endpoint)
    first = Manifest.from_json(store.get(manifest_key(1)))
    second = Manifest.from_json(store.get(manifest_key(2)))
    assert set(first.objects) == {rank_object_key(first.attempt, r) for r in (0, 1)}
    spread = {rank_object_key(second.attempt, r, prefix_spread=True) for r in (0, 1)}
    assert set(second.objects) == spread


def notice_route(rank: int, world: int, args: dict[str, Any]) -> None:
    """One rank of the two-rank test: save step 1 (rank 1 through the proxy), then rank 0 alone
    gets a notice and both make the emergency save of step 2."""
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, azure=False)
    options = {"endpoint_url": args["endpoints"][rank], "part_size": 5 * MIB}
    manager = CheckpointManager(
        args["uri"],
        preemption=watcher,
        interval_steps=100,
        keep_last=None,
        storage_options=options,
        collective_timeout_s=60,
    )
    manager.save(1, {f"w{rank}": torch.full((1 << 16,), 1.0 + rank)})
    dist.barrier()
    if rank == 0:
        watcher.trigger("test", deadline=time.monotonic() + 60.0)
    dist.barrier()
    manager.maybe_save(2, {f"w{rank}": torch.full((1 << 16,), 2.0 + rank)})
    outcome = {
        "stop": manager.should_stop(),
        "throttled": manager.store.throttle.stats().throttled,  # type: ignore[attr-defined]
        "steps": manager.steps(),
    }
    (Path(args["out"]) / f"outcome-{rank}.json").write_text(json.dumps(outcome))
    manager.close()
    watcher.stop()


def main() -> None:
    scenario, rank, world, port, raw = sys.argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    {"notice_route": notice_route}[scenario](int(rank), int(world), json.loads(raw))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
