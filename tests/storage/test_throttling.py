"""Many ranks saving into one prefix under the cloud model's "stress" profile: no save fails, the
stores back off and lower their concurrency, nothing partial is visible, and every request the
stores counted is one the proxy saw.

Each simulated rank is a thread with an S3 store of its own (as each rank process has), writing
what a rank writes in a save: its data object (a multipart upload) and its index part, both
create-only, into one attempt's folder; the coordinator puts the manifest once all are done.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from spotckpt.layout import index_part_key, rank_object_key
from spotckpt.storage.requests import RequestTally
from spotckpt.storage.retry import Deadline
from spotckpt.storage.s3 import S3Store, open_s3_store
from spotckpt.storage.throttle import Throttle

from tests_support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from cloud_model import CloudProxy, profile

MIB = 1 << 20
RANKS = 16
ATTEMPT = "0123456789abcdef"


@pytest.fixture
def stress_proxy(moto_endpoint: str) -> Iterator[CloudProxy]:
    proxy = CloudProxy(moto_endpoint, profile("stress"))
    yield proxy
    proxy.close()


def _rank_bytes(rank: int) -> bytes:
    return bytes([rank]) * (5 * MIB + 4096 * (rank + 1))  # two parts each


def _save_as_ranks(endpoint: str, bucket: str, spread: bool) -> list[S3Store]:
    stores = [
        open_s3_store(
            f"s3://{bucket}/runs/exp1",
            {"endpoint_url": endpoint, "part_size": 5 * MIB, "max_concurrency": 4},
        )
        for _ in range(RANKS)
    ]
    start = threading.Barrier(RANKS)

    def rank_save(rank: int) -> None:
        store = stores[rank]
        start.wait()
        with store.open_writer(
            f"step-000001/{rank_object_key(ATTEMPT, rank, spread)}", create_only=True
        ) as writer:
            writer.write(_rank_bytes(rank))
        store.put(f"step-000001/{index_part_key(ATTEMPT, rank)}", b"{}", create_only=True)

    with ThreadPoolExecutor(RANKS) as pool:
        list(pool.map(rank_save, range(RANKS)))  # raises the first failure
    stores[0].put("step-000001/manifest.json", b"{}", create_only=True)
    return stores


def _total(stores: list[S3Store]) -> RequestTally:
    total = RequestTally()
    for store in stores:
        total = total.plus(store.requests.tally())
    return total


@pytest.mark.parametrize("spread", [False, True])
def test_ranks_saving_at_once_under_throttling(
    stress_proxy: CloudProxy, s3_client, s3_bucket: str, spread: bool
) -> None:  # type: ignore[no-untyped-def]
    stores = _save_as_ranks(stress_proxy.endpoint, s3_bucket, spread)
    try:
        throttled = sum(store.throttle.stats().throttled for store in stores)
        assert throttled == sum(stress_proxy.throttled.values())
        if not spread:
            assert throttled > 0  # the profile binds: otherwise this test exercises nothing
            assert any(store.throttle.stats().limit < 4 for store in stores)
            assert sum(store.throttle.stats().waited_s for store in stores) > 0
        # nothing partial: no open upload, every object whole
        assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
        for rank in range(RANKS):
            key = f"runs/exp1/step-000001/{rank_object_key(ATTEMPT, rank, spread)}"
            body = s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
            assert body == _rank_bytes(rank)
        # what the stores counted is what the proxy saw
        total = _total(stores)
        assert total.write == stress_proxy.counts["write"]
        assert total.read == stress_proxy.counts["read"]
        # the proxy also saw request documents (CompleteMultipartUpload's list of parts)
        assert total.sent <= stress_proxy.bytes_in <= total.sent * 1.01
        assert total.sent == sum(len(_rank_bytes(r)) + 2 for r in range(RANKS)) + 2
    finally:
        for store in stores:
            store.close()


def test_spreading_prefixes_throttles_less(moto_endpoint: str, s3_client) -> None:  # type: ignore[no-untyped-def]
    seen = {}
    for spread in (False, True):
        bucket = f"spread-{int(spread)}-{ATTEMPT[:6]}"
        s3_client.create_bucket(Bucket=bucket)
        proxy = CloudProxy(moto_endpoint, profile("stress"))
        try:
            for store in _save_as_ranks(proxy.endpoint, bucket, spread):
                store.close()
            seen[spread] = sum(proxy.throttled.values())
        finally:
            proxy.close()
    assert seen[True] < seen[False]


class _SlowDown(Exception):
    pass


def test_throttle_halves_on_slow_down_and_grows_back() -> None:
    throttle = Throttle(8, initial_backoff_s=0.0, max_backoff_s=0.0)
    answers = iter([_SlowDown(), "ok"])

    def request() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    deadline = Deadline.after("test", 60)
    assert throttle.run(request, lambda e: isinstance(e, _SlowDown), deadline) == "ok"
    stats = throttle.stats()
    assert stats.throttled == 1
    assert 4 <= stats.limit < 4.5  # halved, then one success added 1/limit
    for _ in range(200):
        throttle.run(lambda: None, lambda e: False, deadline)
    assert throttle.stats().limit == 8  # never above the store's concurrency


def test_throttle_gives_up_at_the_deadline_and_passes_other_errors() -> None:
    throttle = Throttle(2, initial_backoff_s=10.0, max_backoff_s=10.0)
    short = Deadline.after("test", 0.001)

    def always() -> None:
        raise _SlowDown()

    with pytest.raises(_SlowDown):
        throttle.run(always, lambda e: isinstance(e, _SlowDown), short)
    with pytest.raises(KeyError):
        throttle.run(lambda: {}["x"], lambda e: False, Deadline.after("test", 60))
    assert throttle.stats().throttled == 1


def test_which_answers_are_throttling() -> None:
    import botocore.exceptions
    from google.api_core import exceptions as api_exceptions

    from spotckpt.storage import gcs

    def s3_error(code: str, status: int) -> botocore.exceptions.ClientError:
        answer: Any = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return botocore.exceptions.ClientError(answer, "PutObject")

    store = open_s3_store("s3://bucket/p", {"endpoint_url": "http://127.0.0.1:9"})
    try:
        assert store.is_throttle(s3_error("SlowDown", 503))
        assert store.is_throttle(s3_error("", 429))
        assert not store.is_throttle(s3_error("InternalError", 500))
        assert not store.is_throttle(s3_error("AccessDenied", 403))
    finally:
        store.close()
    assert gcs.is_throttle(api_exceptions.TooManyRequests("slow down"))
    assert not gcs.is_throttle(api_exceptions.ServiceUnavailable("later"))
