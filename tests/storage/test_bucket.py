"""What S3 and GCS share through `spotckpt.storage.bucket`: URIs, option coercion, keys, pickling.

Each case runs for both stores, opened against a closed loopback port: none of them sends a
request. The stores' behaviour against servers is in test_storage_contract.py and friends.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from spotckpt.errors import InvalidArgumentError
from spotckpt.storage import open_store
from spotckpt.storage.bucket import BucketOptions, BucketStore
from spotckpt.storage.gcs import GCSOptions, GCSStore
from spotckpt.storage.s3 import S3Options, S3Store

NOWHERE = "http://127.0.0.1:9"
OPTIONS: dict[str, dict[str, Any]] = {"s3": {}, "gs": {"anonymous": True}}
"""Credentials: S3's come from the environment (conftest.py), GCS needs none."""


@pytest.fixture(params=["s3", "gs"])
def scheme(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _open(uri: str, **options: Any) -> BucketStore[Any]:
    defaults = {"endpoint_url": NOWHERE, **OPTIONS[uri.partition(":")[0]]}
    store = open_store(uri, **(defaults | options))
    assert isinstance(store, BucketStore)
    return store


@pytest.fixture
def store(scheme: str) -> Iterator[BucketStore[Any]]:
    opened = _open(f"{scheme}://spotckpt-bucket/runs/exp1/")
    yield opened
    opened.close()


@pytest.mark.parametrize("tail", ["?versionId=3", "?", "#frag", "?x-amz-signature=s3cr3t#f"])
def test_a_query_or_fragment_is_refused_without_echoing_it(scheme: str, tail: str) -> None:
    with pytest.raises(InvalidArgumentError, match="must not have a query or fragment") as error:
        _open(f"{scheme}://spotckpt-bucket/runs{tail}")
    assert f"{scheme}://spotckpt-bucket/runs " in str(error.value)
    assert "s3cr3t" not in str(error.value)


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("://", "has no bucket"),
        (":///runs", "has no bucket"),
        ("://user:s3cr3t@spotckpt-bucket/runs", "must not carry credentials"),
        ("://@spotckpt-bucket/runs", "must not carry credentials"),
        (":///runs?token=s3cr3t", "must not have a query"),
        ("://user:s3cr3t@spotckpt-bucket/runs?x=1", "must not carry credentials"),
    ],
)
def test_uris_name_a_bucket_and_nothing_else(scheme: str, uri: str, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as error:
        _open(scheme + uri)
    assert "s3cr3t" not in str(error.value)


def test_keys_map_to_names_under_the_prefix(store: BucketStore[Any], scheme: str) -> None:
    assert store.uri == f"{scheme}://spotckpt-bucket/runs/exp1"
    assert store.full_name("step-1/a") == "runs/exp1/step-1/a"
    assert store.full_prefix("") == "runs/exp1/" and store.full_prefix("step-") == "runs/exp1/step-"
    assert store.relative("runs/exp1/step-1/a") == "step-1/a"
    assert store.where("k") == f"{scheme}://spotckpt-bucket/runs/exp1/k"


def test_pickles_as_uri_and_options(store: BucketStore[Any]) -> None:
    copy = pickle.loads(pickle.dumps(store))
    try:
        assert type(copy) is type(store) and copy is not store
        assert copy.uri == store.uri and copy.options == store.portable_options()
    finally:
        copy.close()


@dataclass(kw_only=True)
class TunedS3Options(S3Options):
    """S3's options with optional fields of each type that strings convert to."""

    probes: int | None = None
    probe_wait_s: float | None = None
    probe_first: bool | None = None


@dataclass(kw_only=True)
class TunedGCSOptions(GCSOptions):
    """GCS's options with optional fields of each type that strings convert to."""

    probes: int | None = None
    probe_wait_s: float | None = None
    probe_first: bool | None = None


@pytest.mark.parametrize("options", [TunedS3Options, TunedGCSOptions])
def test_optional_fields_convert_from_strings_like_plain_ones(
    options: type[TunedS3Options | TunedGCSOptions],
) -> None:
    """``X | None`` fields convert as ``X`` (S3's own conversion used to leave them strings)."""
    built = options.from_options({"probes": "3", "probe_wait_s": "0.5", "probe_first": "yes"})
    assert (built.probes, built.probe_wait_s, built.probe_first) == (3, 0.5, True)
    assert options.from_options({"probe_first": "off"}).probe_first is False
    assert options.from_options({"max_concurrency": "4"}).max_concurrency == 4


def test_gcs_anonymous_converts_from_a_command_line_string() -> None:
    """``--storage-option anonymous=false`` reaches the store as a string."""
    assert GCSOptions.from_options({"anonymous": "false"}).anonymous is False
    store = _open("gs://spotckpt-bucket/p", anonymous="true")
    try:
        assert isinstance(store, GCSStore) and store.anonymous is True
    finally:
        store.close()


def test_s3_optional_strings_stay_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings that are text (the region, the endpoint from the environment) pass unchanged."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", NOWHERE)
    store = open_store("s3://spotckpt-bucket/p", region_name="eu-west-1")
    try:
        assert isinstance(store, S3Store)
        assert (store.options.endpoint_url, store.options.region_name) == (NOWHERE, "eu-west-1")
    finally:
        store.close()


@pytest.mark.parametrize("options", [S3Options, GCSOptions])
def test_unknown_options_name_the_service(options: type[BucketOptions]) -> None:
    with pytest.raises(InvalidArgumentError, match=f"unknown {options.KIND} storage options"):
        options.from_options({"no_such_option": "1"})
