"""The cloud model proxy (benchmarks/cloud_model.py) in front of moto: its limits bind, and it
counts what it saw."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import boto3
import botocore.config
import botocore.exceptions
import pytest

from tests_support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from cloud_model import PROFILES, CloudProxy, Profile, billing_class, profile, rate_prefix

MIB = 1 << 20
OPEN = Profile("open", None, None, 0.0, None, None)


@pytest.fixture
def make_proxy(moto_endpoint: str) -> Iterator[object]:
    proxies: list[CloudProxy] = []

    def make(limits: Profile) -> CloudProxy:
        proxies.append(CloudProxy(moto_endpoint, limits))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.close()


def _client(endpoint: str):  # type: ignore[no-untyped-def]
    config = botocore.config.Config(retries={"total_max_attempts": 1, "mode": "standard"})
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=config)


def test_profiles_are_named_and_complete() -> None:
    assert {"s3-standard", "gcs", "s3-express", "stress"} <= set(PROFILES)
    assert profile("s3-standard").writes_per_s == 3500
    assert profile("s3-standard").reads_per_s == 5500
    with pytest.raises(ValueError, match="unknown cloud profile"):
        profile("nowhere")


def test_billing_class_and_prefix() -> None:
    assert billing_class("PUT", "partNumber=1&uploadId=x") == "write"
    assert billing_class("GET", "list-type=2&prefix=a") == "write"
    assert billing_class("GET", "") == "read"
    assert billing_class("HEAD", "") == "read"
    assert billing_class("DELETE", "") == "free"
    assert billing_class("POST", "delete") == "free"
    assert rate_prefix("/bkt/runs/a/b.bin?uploads") == "/bkt/runs/a"


def test_forwards_objects_unchanged_and_counts(make_proxy, s3_bucket: str) -> None:  # type: ignore[no-untyped-def]
    proxy = make_proxy(OPEN)
    client = _client(proxy.endpoint)
    data = bytes(range(256)) * (3 * MIB // 256 + 7)
    client.put_object(Bucket=s3_bucket, Key="a/b", Body=data)
    assert client.get_object(Bucket=s3_bucket, Key="a/b")["Body"].read() == data
    ranged = client.get_object(Bucket=s3_bucket, Key="a/b", Range="bytes=10-19")["Body"].read()
    assert ranged == data[10:20]
    assert client.head_object(Bucket=s3_bucket, Key="a/b")["ContentLength"] == len(data)
    client.delete_object(Bucket=s3_bucket, Key="a/b")
    assert proxy.counts["PUT"] == 1 and proxy.counts["GET"] == 2 and proxy.counts["HEAD"] == 1
    assert proxy.counts["write"] == 1 and proxy.counts["read"] == 3 and proxy.counts["free"] == 1
    assert proxy.bytes_in == len(data)
    assert proxy.bytes_out >= len(data) + 10


def test_request_rate_per_prefix_answers_slow_down(make_proxy, s3_bucket: str) -> None:  # type: ignore[no-untyped-def]
    proxy = make_proxy(OPEN.scaled(writes_per_s=1.0, burst_s=1.0))
    client = _client(proxy.endpoint)
    started = time.monotonic()
    codes = []
    for index in range(10):
        try:
            client.put_object(Bucket=s3_bucket, Key=f"hot/{index}", Body=b"x")
            codes.append("ok")
        except botocore.exceptions.ClientError as error:
            assert error.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            codes.append(error.response["Error"]["Code"])
    elapsed = time.monotonic() - started
    # one token at the start, one more per second since
    assert codes.count("ok") <= 1 + int(elapsed) + 1
    assert set(codes) <= {"ok", "SlowDown"} and "SlowDown" in codes
    assert proxy.throttled["write"] == codes.count("SlowDown")
    # another prefix has its own rate; reads are not limited here
    client.put_object(Bucket=s3_bucket, Key="cold/0", Body=b"x")
    assert client.get_object(Bucket=s3_bucket, Key="cold/0")["Body"].read() == b"x"


def test_slow_down_before_a_large_body_leaves_the_client_working(
    make_proxy, s3_bucket: str
) -> None:  # type: ignore[no-untyped-def]
    """botocore sends a large body after ``Expect: 100-continue``: a refusal comes before it."""
    proxy = make_proxy(OPEN.scaled(writes_per_s=0.5, burst_s=2.0))
    client = _client(proxy.endpoint)
    body = b"y" * (2 * MIB)
    client.put_object(Bucket=s3_bucket, Key="big/0", Body=body)
    with pytest.raises(botocore.exceptions.ClientError, match="SlowDown"):
        client.put_object(Bucket=s3_bucket, Key="big/1", Body=body)
    for _ in range(100):
        try:
            client.put_object(Bucket=s3_bucket, Key="big/1", Body=body)
            break
        except botocore.exceptions.ClientError:
            time.sleep(0.2)
    assert client.get_object(Bucket=s3_bucket, Key="big/1")["Body"].read() == body


def _timed_get(endpoint: str, bucket: str) -> float:
    client = _client(endpoint)
    started = time.monotonic()
    assert len(client.get_object(Bucket=bucket, Key="obj")["Body"].read()) == 2 * MIB
    return time.monotonic() - started


def test_bandwidth_latency_and_node_cap_are_lower_bounds(
    make_proxy, s3_client, s3_bucket: str
) -> None:  # type: ignore[no-untyped-def]
    s3_client.put_object(Bucket=s3_bucket, Key="obj", Body=b"z" * (2 * MIB))
    per_connection = make_proxy(OPEN.scaled(connection_bytes_per_s=4 * MIB, first_byte_s=0.2))
    assert _timed_get(per_connection.endpoint, s3_bucket) >= 0.2 + 0.5 - 0.05
    node = make_proxy(OPEN.scaled(node_bytes_per_s=4 * MIB))
    with ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        list(pool.map(lambda _: _timed_get(node.endpoint, s3_bucket), range(4)))
        assert time.monotonic() - started >= 4 * 2 / 4 - 0.1  # 8 MiB through a 4 MiB/s node
