"""Listing that scales: finding the committed steps, the latest and what retention retires costs
requests in proportion to the steps (one delimited listing), never to the objects they hold; and
retention deletes the retired step folders and nothing else.

Request counts are real where a server answers (moto over HTTP, counted with botocore's events;
directory reads of the local store) and as S3 would bill them for the memory store
(`CountingStore`: one request per 1,000 entries handed out).
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import pytest

from spotckpt.catalog import Catalog
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key, step_folder
from spotckpt.step_removal import RETIRE_FOLDER_LISTINGS
from spotckpt.storage import ObjectInfo, ObjectStore, open_store
from spotckpt.storage.base import DelimiterNotHonouredError, ListingPages

from fault_proxy import FaultProxy
from gcs_emulator import create_bucket
from tests_support import PAGE, CountingStore

Put = Callable[..., None]
"""put(key) writes a placeholder object; put(key, data) writes `data`."""


def _layout(put: Put, steps: range | list[int], attempts: int = 2, ranks: int = 2) -> None:
    """Committed steps, each with `attempts` attempt folders of `ranks` objects (the last one
    spread over a 3-hex sub-folder) and a valid manifest naming the last attempt (retention
    reads manifests: an unreadable one would be left alone); listings never read them."""
    for step in steps:
        folder = step_folder(step)
        for attempt in range(attempts):
            for rank in range(ranks):
                spread = f"{rank % 7:03x}/" if attempt == attempts - 1 else ""
                put(f"{folder}/a-{attempt:04d}/{spread}r{rank:05d}-000.safetensors")
        put(manifest_key(step), _manifest(step, f"{attempts - 1:04d}"))


def _manifest(step: int, attempt: str) -> bytes:
    return Manifest(
        step=step,
        attempt=attempt,
        world_size=1,
        block_size=1 << 20,
        objects={},
        tensors={},
        values={},
    ).to_json()


def _keys(store: ObjectStore) -> set[str]:
    return {info.key for info in store.list()}


def _under(keys: set[str], steps: list[int]) -> set[str]:
    """The keys inside the folders of `steps` (``<folder>/...``)."""
    folders = {step_folder(step) for step in steps}
    return {key for key in keys if "/" in key and key.partition("/")[0] in folders}


# The memory store, counted as S3 would bill it ----------------------------------------------


def _counted(uri: str, steps: range, attempts: int, ranks: int) -> CountingStore:
    store = open_store(uri)
    _layout(lambda key, data=b"x": store.put(key, data), steps, attempts, ranks)
    return CountingStore(store)


@pytest.mark.parametrize("count", [10, 1_000, 10_000])
def test_latest_costs_one_request_per_500_steps(memory_uri: str, count: int) -> None:
    store = _counted(memory_uri, range(1, count + 1), attempts=3, ranks=4)
    assert Catalog(store).latest() == count
    # one manifest and one rolled-up attempt prefix per step; the 12 objects per step are unseen
    assert store.list_requests == math.ceil(2 * count / PAGE)


def test_cost_does_not_grow_with_objects_per_step(memory_uri: str) -> None:
    small = _counted(f"{memory_uri}-small", range(1, 2_001), attempts=1, ranks=1)
    large = _counted(f"{memory_uri}-large", range(1, 2_001), attempts=4, ranks=16)
    assert Catalog(small).steps() == Catalog(large).steps() == list(range(1, 2_001))
    assert small.list_requests == large.list_requests == 4


def test_retention_pass_over_10000_steps(memory_uri: str) -> None:
    store = _counted(memory_uri, range(1, 10_001), attempts=1, ranks=4)
    before = _keys(store.inner)

    assert Catalog(store).retire(keep_last=9_999) == [1]  # a pass after each save: one retires
    assert store.list_requests == 20 + 1  # the steps, then the retired folder
    assert set(store.deleted) == _under(before, [1]) and manifest_key(1) in store.deleted
    assert _keys(store.inner) == before - _under(before, [1])

    store.list_requests = 0
    retired = Catalog(store).retire(keep_last=3)  # keep_last lowered: 9,996 retire at once
    assert retired == list(range(2, 9_998))
    objects = 4 * len(retired)  # the manifests are gone first
    # the steps, then one listing up to the first key past the last retired folder
    assert store.list_requests == math.ceil(2 * 9_999 / PAGE) + math.ceil((objects + 1) / PAGE)
    assert store.list_requests < 100
    assert _keys(store.inner) == before - _under(before, list(range(1, 9_998)))


# S3 on a moto server, every request counted ---------------------------------------------------


class RequestCounter:
    """Counts the ListObjectsV2 requests a store's boto3 client sends (each try on its own)."""

    def __init__(self, store: ObjectStore) -> None:
        self.lists = 0
        store.client.meta.events.register(  # type: ignore[attr-defined]
            "before-send.s3.ListObjectsV2", self._count
        )

    def _count(self, **_: Any) -> None:
        self.lists += 1


def _s3_put(s3_client: Any, bucket: str, root: str) -> Put:
    return lambda key, data=b"x": s3_client.put_object(
        Bucket=bucket, Key=f"{root}/{key}", Body=data
    )


S3_PAGE = 10
S3_STEPS = 30


@pytest.mark.parametrize("ranks", [1, 4])
def test_s3_latest_lists_two_entries_per_step(
    s3_client: Any, s3_bucket: str, moto_endpoint: str, ranks: int
) -> None:
    _layout(_s3_put(s3_client, s3_bucket, "runs/x"), range(1, S3_STEPS + 1), 2, ranks)
    store = open_store(f"s3://{s3_bucket}/runs/x", endpoint_url=moto_endpoint, list_page_size=10)
    counter = RequestCounter(store)
    try:
        assert Catalog(store).latest() == S3_STEPS
    finally:
        store.close()
    assert counter.lists == math.ceil(2 * S3_STEPS / S3_PAGE)  # 6, with 1 or 4 objects a rank


def test_s3_retention_lists_the_steps_then_only_what_it_retires(
    s3_client: Any, s3_bucket: str, moto_endpoint: str
) -> None:
    _layout(_s3_put(s3_client, s3_bucket, "runs/x"), range(1, S3_STEPS + 1), 2, 2)
    store = open_store(f"s3://{s3_bucket}/runs/x", endpoint_url=moto_endpoint, list_page_size=10)
    counter = RequestCounter(store)
    try:
        before = _keys(store)
        counter.lists = 0
        assert Catalog(store).retire(keep_last=S3_STEPS - 1) == [1]
        assert counter.lists == math.ceil(2 * S3_STEPS / S3_PAGE) + 1
        assert _keys(store) == before - _under(before, [1])

        counter.lists = 0
        retired = Catalog(store).retire(keep_last=2)
        assert retired == list(range(2, S3_STEPS - 1)) and len(retired) > RETIRE_FOLDER_LISTINGS
        objects = 4 * len(retired)  # the manifests are gone first
        steps_pages = math.ceil(2 * (S3_STEPS - 1) / S3_PAGE)
        assert counter.lists == steps_pages + math.ceil((objects + 1) / S3_PAGE)
        assert _keys(store) == before - _under(before, list(range(1, S3_STEPS - 1)))
    finally:
        store.close()


# The local store: only the folders the delimiter leaves apart are read -----------------------


def _count_scandir(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = os.scandir

    def counting(path: Any = ".") -> Any:
        calls[0] += 1
        return real(path)

    monkeypatch.setattr(os, "scandir", counting)
    return calls


@pytest.mark.parametrize("attempts, ranks", [(1, 1), (3, 8)])
def test_local_reads_each_step_folder_and_one_attempt_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attempts: int, ranks: int
) -> None:
    store = open_store(str(tmp_path / "ck"), fsync=False)
    _layout(lambda key, data=b"x": store.put(key, data), range(1, 41), attempts, ranks)
    calls = _count_scandir(monkeypatch)
    assert Catalog(store).latest() == 40
    spread = 1  # the first attempt folder read may be the spread one, one level deeper
    assert calls[0] <= 1 + 40 * (2 + spread)  # root, step folders, one attempt folder each


def test_local_prefixes_stand_for_objects_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    store = open_store(str(root), fsync=False)
    store.put(manifest_key(7), b"{}")
    (root / step_folder(7) / "a-crashed").mkdir()
    (root / step_folder(7) / "a-crashed" / ".spotckpt-tmp-r00000-000.safetensors.1").write_bytes(
        b"partial"
    )
    (root / step_folder(7) / "a-empty" / "000").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "r0").write_bytes(b"not ours")
    (root / step_folder(8)).mkdir()
    (root / step_folder(8) / "a-linked").symlink_to(outside, target_is_directory=True)
    store.put(f"{step_folder(9)}/a-x/deep/er/r0", b"x")
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        listing = store.list_delimited("step-", "/a-")
    assert [o.key for o in listing.objects] == [manifest_key(7)]
    assert listing.prefixes == [f"{step_folder(9)}/a-"]
    assert "a-linked is a symbolic link" in caplog.text


# Look-alike folders are reported and left alone, as before -----------------------------------


@pytest.fixture(params=["memory", "local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "memory":
        opened = open_store(request.getfixturevalue("memory_uri"))
    elif request.param == "local":
        opened = open_store(str(tmp_path / "ck"), fsync=False)
    else:
        opened = open_store(request.getfixturevalue("s3_uri"), list_page_size=7)
    yield opened
    opened.close()


LOOK_ALIKES = [
    "step-0000000012/manifest.json",  # one zero too many
    "step-00000001\uff12/a-0000/r00000-000.safetensors",  # fullwidth two, attempt objects only
    "step-000000001.old/a-0000/r00000-000.safetensors",
    "step-00000001x/manifest.json",
]
OTHERS = ["events/summary.json", "latest.json", "step-000000002/a-dead/r00000-000.safetensors"]


@pytest.mark.process
def test_look_alikes_are_reported_never_listed(
    store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    _layout(lambda key, data=b"x": store.put(key, data), range(1, 2))
    for key in LOOK_ALIKES:
        store.put(key, b"{}")
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        assert Catalog(store).steps() == [1]
    for key in LOOK_ALIKES:
        assert repr(key.partition("/")[0]) in caplog.text


@pytest.mark.process
@pytest.mark.parametrize("keep_last", [17, 2], ids=["few-retire", "many-retire"])
def test_retention_deletes_only_the_retired_folders(store: ObjectStore, keep_last: int) -> None:
    committed = [1, *range(3, 22)]  # step 2 is a folder without a manifest
    _layout(lambda key, data=b"x": store.put(key, data), committed)
    store.put(f"{step_folder(1)}/quarantined-20260101T000000.000000Z/reason.json", b"{}")
    store.put(f"{step_folder(3)}/a-failed/r00000-000.safetensors", b"x")
    for key in LOOK_ALIKES + OTHERS:
        store.put(key, b"{}")
    before = _keys(store)

    retired = Catalog(store).retire(keep_last=keep_last)

    assert retired == committed[:-keep_last]
    assert (len(retired) > RETIRE_FOLDER_LISTINGS) == (keep_last == 2)
    assert _keys(store) == before - _under(before, retired)
    assert set(LOOK_ALIKES + OTHERS) <= _keys(store)
    assert Catalog(store).steps() == committed[-keep_last:]


def test_retention_past_a_billion_keeps_lexically_earlier_folders(memory_uri: str) -> None:
    store = CountingStore(open_store(memory_uri))
    committed = [*range(1, 21), 999_999_999, 1_000_000_000, 1_000_000_001]
    _layout(lambda key, data=b"x": store.put(key, data), committed)
    before = _keys(store)
    # "step-1000000000" sorts before "step-999999999": the range listing passes over them
    assert Catalog(store).retire(keep_last=2) == committed[:-2]
    assert _keys(store) == before - _under(before, committed[:-2])
    assert set(store.deleted) == _under(before, committed[:-2])


# Servers that do not honour the delimiter -----------------------------------------------------

REFUSED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidArgument</Code>'
    b"<Message>Only / is supported as a delimiter</Message></Error>"
)


def _query(path: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(path).query, keep_blank_values=True))


def _with_delimiter(path: str, delimiter: str | None) -> str:
    parts = urlsplit(path)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "delimiter"]
    if delimiter is not None:
        query.append(("delimiter", delimiter))
    return f"{parts.path}?{urlencode(query)}"


@pytest.fixture
def behind_proxy(
    s3_client: Any, s3_bucket: str, moto_endpoint: str
) -> Iterator[Callable[..., tuple[ObjectStore, list[str]]]]:
    """A store reaching moto through a `FaultProxy` built with the given hooks; it records the
    delimiter of every listing it sees."""
    root = f"runs/{uuid.uuid4().hex[:8]}"
    _layout(_s3_put(s3_client, s3_bucket, root), range(1, 16))
    made: list[tuple[FaultProxy, ObjectStore]] = []

    def make(**hooks: Any) -> tuple[ObjectStore, list[str]]:
        seen: list[str] = []
        answer = hooks.pop("answer", None)

        def record(method: str, path: str) -> tuple[int, bytes] | None:
            if "list-type" in _query(path):
                seen.append(_query(path).get("delimiter", ""))
            return answer(method, path) if answer else None

        proxy = FaultProxy(moto_endpoint, rate=0.0, answer=record, **hooks)
        opened = open_store(f"s3://{s3_bucket}/{root}", endpoint_url=proxy.endpoint)
        made.append((proxy, opened))
        return opened, seen

    yield make
    for proxy, opened in made:
        opened.close()
        proxy.close()


def test_a_refused_delimiter_falls_back_to_a_full_listing_once(
    behind_proxy: Callable[..., tuple[ObjectStore, list[str]]], caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(method: str, path: str) -> tuple[int, bytes] | None:
        return (400, REFUSED) if _query(path).get("delimiter") else None

    store, seen = behind_proxy(answer=refuse)
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        assert Catalog(store).steps() == list(range(1, 16))
        assert Catalog(store).latest() == 15
    assert seen == ["/a-", "", ""]  # asked once; full listings from then on
    assert caplog.text.count("does not list by the delimiter '/a-'") == 1


def test_a_server_that_ignores_the_delimiter_is_rolled_up_here(
    behind_proxy: Callable[..., tuple[ObjectStore, list[str]]], caplog: pytest.LogCaptureFixture
) -> None:
    store, _seen = behind_proxy(rewrite=lambda method, path: _with_delimiter(path, None))
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        listing = store.list_delimited("step-", "/a-")
    assert listing.prefixes == [f"{step_folder(s)}/a-" for s in range(1, 16)]
    assert [o.key for o in listing.objects] == [manifest_key(s) for s in range(1, 16)]
    assert "does not list by the delimiter" not in caplog.text


def test_a_server_that_only_knows_slash_is_detected(
    behind_proxy: Callable[..., tuple[ObjectStore, list[str]]], caplog: pytest.LogCaptureFixture
) -> None:
    def slash_only(method: str, path: str) -> str:
        return _with_delimiter(path, "/") if _query(path).get("delimiter") else path

    store, _seen = behind_proxy(rewrite=slash_only)
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        assert Catalog(store).steps() == list(range(1, 16))  # not "no checkpoint at all"
    assert "answered with the common prefix 'step-000000001/'" in caplog.text


@pytest.mark.process
@pytest.mark.parametrize("server", ["gcs_endpoint", "fake_gcs_endpoint"])
def test_gcs_servers_list_steps_right(
    request: pytest.FixtureRequest, server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """fake-gcs-server 1.54.0 groups by "/" whatever the delimiter: that is caught, not read as
    "no checkpoint"; gcp-storage-emulator rolls up as GCS does."""
    endpoint = request.getfixturevalue(server)
    store = open_store(
        f"gs://{create_bucket(endpoint)}/run",
        endpoint_url=endpoint,
        anonymous=True,
        list_page_size=7,
    )
    try:
        _layout(lambda key, data=b"x": store.put(key, data), range(1, 9))
        with caplog.at_level(logging.WARNING, logger="spotckpt"):
            assert Catalog(store).steps() == list(range(1, 9))
            assert Catalog(store).retire(keep_last=7) == [1]
            assert Catalog(store).steps() == list(range(2, 9))
    finally:
        store.close()
    refused = caplog.text.count("does not list by the delimiter")
    assert refused == (1 if server == "fake_gcs_endpoint" else 0)


def _info(key: str) -> ObjectInfo:
    return ObjectInfo(key, 1)


def test_pages_against_the_rules_are_refused() -> None:
    pages = ListingPages("step-", "/a-")
    pages.add([_info("step-1/manifest.json")], ["step-1/a-"], "t1")
    with pytest.raises(DelimiterNotHonouredError, match="same continuation token"):
        pages.add([_info("step-2/manifest.json")], [], "t1")  # a server paging in a circle
    again = ListingPages("step-", "/a-")
    again.add([_info("step-2/manifest.json")], [], "t1")
    with pytest.raises(DelimiterNotHonouredError, match="went back"):
        again.add([_info("step-1/manifest.json")], [], "t2")
    with pytest.raises(DelimiterNotHonouredError, match="common prefix"):
        ListingPages("step-", "/a-").add([], ["step-1/a-x/"], None)
    ignored = ListingPages("step-", "/a-")
    ignored.add([_info("step-1/a-x/r0"), _info("step-1/manifest.json")], [], None)
    assert ignored.listing().prefixes == ["step-1/a-"]
    assert [o.key for o in ignored.listing().objects] == ["step-1/manifest.json"]
