"""Cost accounting: the requests a run's stores counted, in its events and in ``spotckpt stats``,
against what the cloud model proxy in front of moto saw."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from spotckpt import CheckpointManager, TrainState
from spotckpt.cost import DEFAULT_PRICES, PriceTable, load_prices
from spotckpt.errors import InvalidArgumentError
from spotckpt.goodput import EventLog
from spotckpt.stats import load_stats, stats_from_totals
from spotckpt.storage import open_store
from spotckpt.storage.requests import RequestTally, request_class

from tests_support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from cloud_model import CloudProxy, Profile

MIB = 1 << 20
OPEN = Profile("open", None, None, 0.0, None, None)


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[CloudProxy]:
    proxy = CloudProxy(moto_endpoint, OPEN)
    yield proxy
    proxy.close()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1536), nn.ReLU(), nn.Linear(1536, 8))  # ~6 MiB


def test_request_classes() -> None:
    assert request_class("put s3://b/k") == "write"
    assert request_class("upload part 3 of s3://b/k") == "write"
    assert request_class("list s3://b/p by '/'") == "write"
    assert request_class("get bytes 0-9 of s3://b/k") == "read"
    assert request_class("head s3://b/k") == "read"
    assert request_class("delete 3 objects under s3://b") == "delete"
    assert request_class("abort upload s3://b/k") == "delete"


def test_price_table_and_its_override(tmp_path: Path) -> None:
    tally = RequestTally(write=2000, read=10_000, delete=5, sent=0, received=0)
    assert DEFAULT_PRICES.requests_cost(tally) == pytest.approx(2 * 0.005 + 10 * 0.0004)
    assert DEFAULT_PRICES.storage_cost_per_month(2e9) == pytest.approx(0.046)
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"write_per_1000": 1.0, "currency": "EUR"}))
    table = load_prices(path)
    assert table == PriceTable(write_per_1000=1.0, currency="EUR")
    path.write_text(json.dumps({"writes": 1.0}))
    with pytest.raises(InvalidArgumentError, match="unknown prices"):
        load_prices(path)
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        PriceTable(read_per_1000=-1)


def test_stats_estimate_matches_the_requests_the_proxy_saw(
    proxy: CloudProxy, s3_uri: str, moto_endpoint: str, tmp_path: Path
) -> None:
    options = {"endpoint_url": proxy.endpoint, "part_size": 5 * MIB}
    model = _model()
    with CheckpointManager(s3_uri, preemption=False, keep_last=2, storage_options=options) as mgr:
        for step in range(1, 5):
            mgr.save(step, TrainState(model=model, rng=False))
    with CheckpointManager(s3_uri, preemption=False, storage_options=options) as mgr:
        assert mgr.restore(TrainState(model=_model(), rng=False)) == 4
    seen = RequestTally(
        write=proxy.counts["write"], read=proxy.counts["read"], delete=proxy.counts["free"]
    )
    assert proxy.counts["free"] > 0  # retention deleted older steps

    stats = load_stats(open_store(s3_uri, endpoint_url=moto_endpoint))  # not through the proxy
    assert stats.saves == 4 and stats.restores == 1
    assert stats.write_requests == pytest.approx(seen.write, rel=0.05)
    assert stats.read_requests == pytest.approx(seen.read, rel=0.05)
    assert stats.cost_requests_total == pytest.approx(DEFAULT_PRICES.requests_cost(seen), rel=0.05)
    assert stats.bytes_sent == pytest.approx(proxy.bytes_in, rel=0.05)
    assert stats.requests_per_checkpoint is not None and stats.requests_per_checkpoint > 3
    assert stats.retained_bytes is not None and stats.retained_bytes > 2 * 6 * MIB
    assert stats.cost_retention_per_month == pytest.approx(
        DEFAULT_PRICES.storage_cost_per_month(stats.retained_bytes)
    )

    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"write_per_1000": 1000.0, "read_per_1000": 0.0}))
    cli = str(Path(sys.executable).parent / "spotckpt")
    endpoint = f"endpoint_url={moto_endpoint}"
    result = subprocess.run(
        [cli, "stats", s3_uri, "--json", "--prices", str(prices), "--storage-option", endpoint],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert any("requests" in key for key in document) and any("cost" in key for key in document)
    assert document["cost_requests_total"] == pytest.approx(stats.write_requests, rel=1e-9)
    text = subprocess.run(
        [cli, "stats", s3_uri, "--storage-option", endpoint],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    ).stdout
    assert "per checkpoint" in text and "USD (estimated)" in text


def test_events_without_request_counts_report_no_cost(memory_uri: str) -> None:
    store = open_store(memory_uri)
    EventLog(store).record({"kind": "save", "stall_s": 1.0, "train_s": 60.0, "bytes": 100})
    stats = load_stats(store)
    assert stats.cost_requests_total is None and stats.cost_per_checkpoint is None
    assert "not counted by this store" in stats.text()
    totals = EventLog(store).totals()
    assert stats_from_totals(store.uri, totals).write_requests == 0


def test_request_counts_survive_compaction(
    memory_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Events fold into ``events/summary.json``; the counts and medians come through whole."""
    store = open_store(memory_uri)
    log = EventLog(store, max_events=4)
    counted = RequestTally(write=10, read=3, delete=1, sent=1000, received=50).to_dict()
    for _ in range(9):
        log.record({"kind": "save", "stall_s": 1.0, "train_s": 60.0, "bytes": 100, **counted})
    assert store.exists("events/summary.json")
    with caplog.at_level("WARNING", logger="spotckpt"):
        stats = load_stats(store)
    assert not [r for r in caplog.records if "malformed" in r.getMessage()]
    assert (stats.saves, stats.write_requests, stats.read_requests) == (9, 90, 27)
    assert stats.requests_per_checkpoint == 14
    assert stats.cost_per_checkpoint == pytest.approx(
        DEFAULT_PRICES.requests_cost(RequestTally(write=10, read=3, delete=1))
    )
