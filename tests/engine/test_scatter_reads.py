"""Tensors read in place that lie back to back in an object share one ranged read (issue 48).

A restore reads each large tensor straight into its destination. On an object store a request
per tensor costs more than its bytes, so neighbours are read by one ranged GET whose body fills
each destination in turn (`spotckpt.storage.base.ScatterReads`). These tests count the GETs a
moto server behind a proxy answers, lose answers and serve damaged bytes mid-read, and restore
every kind of step (incremental, signed, compressed) that way.
"""

from __future__ import annotations

import functools
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import spotckpt.restore
from spotckpt import CheckpointManager, CorruptCheckpointError
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store
from spotckpt.storage.base import get_range_into_views
from spotckpt.storage.local import IOV_MAX, LocalStore

from dist_worker import launch_ranks, replicated_state
from fault_proxy import FaultProxy
from tests_support import write_signing_key

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]

MIB = 1 << 20
PIECE = 4 * MIB  # max_read_bytes of the readers under test: tensors of 2 MiB are read in place
TENSORS = 8  # of 2 MiB each, back to back in one object
READERS = 2  # threads: each read spans 16 MiB / 2 = 8 MiB, four tensors


def _state(step: int, moving: bool = True) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    state = {f"w{i}": torch.randn(MIB // 2, generator=generator) for i in range(TENSORS)}
    if moving:
        state["w5"] = state["w5"] + step  # the one tensor an incremental save uploads again
    return state


@pytest.fixture(autouse=True)
def readers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        spotckpt.restore,
        "ObjectStoreReader",
        functools.partial(
            spotckpt.restore.ObjectStoreReader, max_read_bytes=PIECE, max_parallel_reads=READERS
        ),
    )


class DataGets:
    """Counts the GETs of tensor data a proxy forwarded."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()

    def __call__(self, method: str, path: str) -> None:
        if method == "GET" and ".safetensors" in path:
            with self.lock:
                self.count += 1


@pytest.fixture
def proxied(moto_endpoint: str) -> Iterator[tuple[FaultProxy, DataGets]]:
    gets = DataGets()
    proxy = FaultProxy(moto_endpoint, rate=0.0, answer=gets)
    yield proxy, gets
    proxy.server.shutdown()


def _manager(uri: str, proxy: FaultProxy, **settings: Any) -> CheckpointManager:
    options = {"endpoint_url": proxy.endpoint}
    return CheckpointManager(uri, preemption=False, storage_options=options, **settings)


def _zeros() -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(tensor) for name, tensor in _state(0).items()}


FEATURES = list(itertools.product([False, True], repeat=3))


@pytest.mark.parametrize(
    ("incremental", "signed", "compressed"),
    FEATURES,
    ids=[f"inc{int(i)}-sig{int(s)}-zip{int(c)}" for i, s, c in FEATURES],
)
def test_neighbours_read_in_place_share_a_ranged_read_for_every_kind_of_step(
    s3_uri: str,
    proxied: tuple[FaultProxy, DataGets],
    tmp_path: Path,
    incremental: bool,
    signed: bool,
    compressed: bool,
) -> None:
    proxy, gets = proxied
    settings: dict[str, Any] = {"incremental": incremental}
    if signed:
        settings["signing_key"] = str(write_signing_key(tmp_path / "signing.pem"))
    if compressed:
        settings["compression"] = "on"
    with _manager(s3_uri, proxy, **settings) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    target = _zeros()
    memory = {name: tensor.data_ptr() for name, tensor in target.items()}
    gets.count = 0
    with _manager(s3_uri, proxy, **settings) as manager:
        assert manager.restore(target) == 2
    assert all(torch.equal(target[name], tensor) for name, tensor in _state(2).items())
    assert {name: tensor.data_ptr() for name, tensor in target.items()} == memory
    if not compressed:  # encoded chunks are read by their stored blocks instead
        # Step 2 alone: two reads of four tensors. Incremental: step 1's object holds all but
        # w5 (w0-w4 and w6-w7: two runs of neighbours) and step 2's holds w5.
        assert gets.count == (4 if incremental else 2)


def test_a_lost_answer_mid_read_is_retried_into_every_destination(
    s3_uri: str, moto_endpoint: str
) -> None:
    lost: list[str] = []

    def lose_first_data_answer(method: str, path: str) -> bool:
        if method == "GET" and ".safetensors" in path and not lost:
            lost.append(path)
            return True
        return False

    proxy = FaultProxy(moto_endpoint, rate=0.0, lose_answer=lose_first_data_answer)
    try:
        with _manager(s3_uri, proxy) as manager:
            manager.save(1, _state(1))
        target = _zeros()
        with _manager(s3_uri, proxy) as manager:
            assert manager.restore(target) == 1
        assert lost, "no answer was lost"
        assert all(torch.equal(target[name], tensor) for name, tensor in _state(1).items())
    finally:
        proxy.server.shutdown()


def test_a_damaged_byte_in_a_later_destination_of_a_shared_read_is_named(
    s3_uri: str, s3_client: Any, proxied: tuple[FaultProxy, DataGets]
) -> None:
    proxy, _gets = proxied
    with _manager(s3_uri, proxy) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    bucket, prefix = s3_uri.removeprefix("s3://").split("/", 1)
    manifest = Manifest.from_json(
        s3_client.get_object(Bucket=bucket, Key=f"{prefix}/{manifest_key(2)}")["Body"].read()
    )
    location = manifest.tensors["w2"].chunks[0].location  # the third of a read's four
    key = f"{prefix}/step-000000002/{location.key}"
    data = bytearray(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[location.offset + MIB] ^= 0x40
    s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    target = _zeros()
    with (
        _manager(s3_uri, proxy) as manager,
        pytest.raises(CorruptCheckpointError, match=r"CRC32C mismatch .*'w2'"),
    ):
        manager.restore(target, step=2)
    with _manager(s3_uri, proxy) as manager:
        assert manager.restore(target) == 1  # the damaged step is passed over
    assert all(torch.equal(target[name], tensor) for name, tensor in _state(1).items())


@pytest.mark.parametrize("cut", [0, 5, 12, 20], ids=lambda cut: f"object-ends-at-{cut}")
def test_a_scatter_read_past_the_end_fills_what_exists_and_says_how_much(
    s3_uri: str, s3_client: Any, tmp_path: Path, cut: int
) -> None:
    """The same answer from a bucket store (one request) and a folder (a read per view)."""
    data = bytes(range(20))
    bucket, prefix = s3_uri.removeprefix("s3://").split("/", 1)
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/obj", Body=data[:cut])
    (tmp_path / "obj").write_bytes(data[:cut])
    for store in (open_store(s3_uri), LocalStore(tmp_path)):
        views = [memoryview(bytearray(size)) for size in (4, 0, 7, 9)]
        placed = get_range_into_views(store, "obj", 0, views)
        assert placed == cut, type(store).__name__
        assert b"".join(bytes(view) for view in views)[:cut] == data[:cut]


@pytest.mark.parametrize("where", ["s3", "local"])
@pytest.mark.parametrize("tied", ["packed", "in-place"])
def test_destinations_that_share_memory_restore_what_was_stored(
    request: pytest.FixtureRequest, tmp_path: Path, where: str, tied: str
) -> None:
    """Tied weights restored from a checkpoint saved untied: each piece is checked on its own
    bytes before the other lands on them, so the step restores (one of the two values wins)
    instead of failing its CRC32C and being passed over as corrupt."""
    uri = request.getfixturevalue("s3_uri") if where == "s3" else str(tmp_path / "ck")
    if tied == "packed":  # 20 small tensors: one run
        generator = torch.Generator().manual_seed(3)
        saved = {f"t{i:02d}": torch.randn(64, generator=generator) for i in range(20)}
        a, b = "t03", "t07"
    else:  # tensors of 2 MiB, read in place
        saved, a, b = _state(1), "w2", "w3"
    with CheckpointManager(uri, preemption=False) as manager:
        manager.save(1, saved)
        target = {name: torch.zeros_like(tensor) for name, tensor in saved.items()}
        target[b] = target[a]  # one tensor under two names
        assert manager.restore(target) == 1
    assert target[a] is target[b]
    assert torch.equal(target[a], saved[a]) or torch.equal(target[a], saved[b])
    assert all(torch.equal(target[k], v) for k, v in saved.items() if k not in (a, b))


@pytest.mark.parametrize("where", ["s3", "gcs", "azure", "local", "memory"])
@pytest.mark.parametrize("copied", ["buffered-tensor", "run-member"])
def test_a_copy_into_memory_a_read_lands_in_waits_for_that_read(
    request: pytest.FixtureRequest, tmp_path: Path, where: str, copied: str
) -> None:
    """A destination that is a view into another one read in place (saved untied): its copy,
    a tensor's (too small to read in place) or a run member's (which the planner copies out of
    the run), comes once every read has landed, never while that read is being checked."""
    uri = {
        "s3": lambda: request.getfixturevalue("s3_uri"),
        "gcs": lambda: request.getfixturevalue("gcs_uri"),
        "azure": lambda: request.getfixturevalue("az_uri"),
        "local": lambda: str(tmp_path / "ck"),
        "memory": lambda: request.getfixturevalue("memory_uri"),
    }[where]()
    generator = torch.Generator().manual_seed(9)
    saved = {"big": torch.randn(MIB, generator=generator)}  # 4 MiB: read in place
    if copied == "buffered-tensor":
        saved["view"] = torch.randn(3 * MIB // 8, generator=generator)  # 1.5 MiB: buffered
        small = saved["view"].numel()
    else:
        saved |= {f"s{i:02d}": torch.randn(256, generator=generator) for i in range(20)}
        saved["view"], small = saved.pop("s05"), 256  # one member of their run
    with CheckpointManager(uri, preemption=False) as manager:
        manager.save(1, saved)
        for _ in range(5):  # the copy and the read race: give them several chances
            target = {name: torch.zeros_like(tensor) for name, tensor in saved.items()}
            target["view"] = target["big"][:small]
            assert manager.restore(target) == 1
            head = target["big"][:small]
            assert torch.equal(head, saved["view"]) or torch.equal(head, saved["big"][:small])
            assert torch.equal(target["big"][small:], saved["big"][small:])
            for name in set(saved) - {"big", "view"}:
                assert torch.equal(target[name], saved[name]), name


def test_a_folder_fills_more_views_than_one_system_call_takes(tmp_path: Path) -> None:
    """``preadv`` takes at most ``IOV_MAX`` views a call: thousands of members of a run (some
    empty) land in turn across several calls, and the object's end cuts the last ones short."""
    sizes = [(i * 7) % 13 for i in range(3 * IOV_MAX)]
    data = bytes(i % 251 for i in range(sum(sizes) - 5))
    (tmp_path / "obj").write_bytes(data)
    views = [memoryview(bytearray(size)) for size in sizes]
    assert get_range_into_views(LocalStore(tmp_path), "obj", 0, views) == len(data)
    assert b"".join(bytes(view) for view in views)[: len(data)] == data


def test_a_store_wrapper_sees_each_read_through_its_own_get_range_into(
    s3_uri: str, s3_client: Any
) -> None:
    """A wrapper that forwards what it does not define is asked once per view, so the scatter
    form of the bucket store it wraps cannot bypass it."""
    bucket, prefix = s3_uri.removeprefix("s3://").split("/", 1)
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/obj", Body=bytes(range(30)))

    class Counting:
        def __init__(self, store: Any) -> None:
            self.store = store
            self.reads: list[tuple[int, int]] = []

        def __getattr__(self, name: str) -> Any:
            return getattr(self.store, name)

        def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
            self.reads.append((start, buffer.nbytes))
            return int(self.store.get_range_into(key, start, buffer))

    wrapper = Counting(open_store(s3_uri))
    assert hasattr(wrapper, "get_range_into_views")  # forwarded, yet not used
    views = [memoryview(bytearray(10)) for _ in range(3)]
    assert get_range_into_views(wrapper, "obj", 0, views) == 30  # type: ignore[arg-type]
    assert wrapper.reads == [(0, 10), (10, 10), (20, 10)]
    assert bytes(views[2]) == bytes(range(20, 30))


# Replicas: a run read once and broadcast -----------------------------------------------------


def test_a_run_of_replicated_tensors_read_by_one_rank_reaches_the_other_exactly(
    tmp_path: Path,
) -> None:
    """The replicas' run is read by one of them and broadcast from its run buffer, so that
    rank must fill the buffer, not only its own members (`SharedReads`); the ranks run
    `dist_worker.replicated_run`."""
    args = {"uri": str(tmp_path / "ck"), "out": str(tmp_path)}
    for rank, result in enumerate(launch_ranks(2, "replicated_run", args)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["exact"] for r in ranks] == [True, True]
    stored = sum(t.nbytes for k, t in replicated_state(0).items() if k.startswith("model."))
    own = 2 * 4 * MIB  # the ranks' own tensors
    assert ranks[0]["read"] == ranks[1]["read"]  # the job's total, on every rank
    assert ranks[0]["read"] - own < 2 * stored, ranks  # the run was read once
