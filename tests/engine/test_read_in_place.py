"""Restores read large tensors straight into the destination's memory, and stay correct.

A tensor piece of half a read (``max_read_bytes / IN_PLACE_SHARE``) or more whose destination
can take the stored bytes as they are is fetched by parallel ranged reads of at most
``max_read_bytes`` into the tensor's own memory and verified there; everything else is
coalesced, read into a buffer and copied. These tests run against a moto server over HTTP and a
local folder, count the reads the store was asked for, and damage real bytes.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import spotckpt.restore
from spotckpt import CheckpointManager, CorruptCheckpointError
from spotckpt.engine.reader import IN_PLACE_SHARE
from spotckpt.format.manifest import Manifest
from spotckpt.layout import step_folder
from spotckpt.storage import ObjectStore, open_store

MIB = 1 << 20
PIECE = 4 * MIB  # max_read_bytes of the readers under test
BIG = 10 * MIB // 4  # float32 elements: a 10 MiB tensor, read as 4 + 4 + 2 MiB


def _state(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {
        "model": {
            "big": torch.randn(BIG, generator=generator),
            "matrix": torch.randn(512, 1024, generator=generator),  # 2 MiB, 2-D
            "small": torch.randn(100, generator=generator),
        },
        "meta": {"epoch": step},
    }


class ReadsInto:
    """A real store that records every `get_range_into` (key, start, length) and buffer."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.reads: list[tuple[str, int, int]] = []
        self.buffers: list[int] = []  # the address of each buffer read into
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        address = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr() if buffer.nbytes else 0
        with self.lock:
            self.reads.append((key, start, buffer.nbytes))
            self.buffers.append(address)
        return self.inner.get_range_into(key, start, buffer)


def _manager(uri: str, store: ObjectStore | None = None) -> CheckpointManager:
    return CheckpointManager(uri, preemption=False, store=store)


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager's readers fetch pieces of at most `PIECE` bytes (16 MiB by default)."""
    monkeypatch.setattr(
        spotckpt.restore,
        "ObjectStoreReader",
        functools.partial(spotckpt.restore.ObjectStoreReader, max_read_bytes=PIECE),
    )


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and (
        a["meta"] == b["meta"]
    )


@pytest.fixture(params=["s3", "local"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "s3":
        return str(request.getfixturevalue("s3_uri"))
    return str(tmp_path / "ck")


@pytest.mark.process
def test_large_tensors_land_in_their_own_memory_in_parallel_pieces(uri: str) -> None:
    assert 2 * MIB >= PIECE // IN_PLACE_SHARE > 400  # the matrix and pieces qualify, small not
    with _manager(uri) as mgr:
        mgr.save(1, _state(1))
    store = ReadsInto(open_store(uri))
    target = {"model": {k: torch.zeros_like(v) for k, v in _state(1)["model"].items()}}
    target["meta"] = {"epoch": -1}
    big, matrix = target["model"]["big"], target["model"]["matrix"]
    with _manager(uri, store) as mgr:
        assert mgr.restore(target) == 1
    assert _same(target, _state(1))
    assert target["model"]["big"] is big  # restored in place, the same tensors
    lengths = sorted(length for _key, _start, length in store.reads)
    # big: three pieces (4 + 4 + 2 MiB) into its memory; matrix: one; small and meta: a read
    # of their own bytes each (they are not neighbours in the object).
    assert lengths[-4:] == [2 * MIB, 2 * MIB, PIECE, PIECE]
    small, meta = lengths[:-4]
    assert small == 400 and meta < 64 << 10
    inside = [
        address
        for address in store.buffers
        if big.data_ptr() <= address < big.data_ptr() + big.nbytes
    ]
    assert sorted(a - big.data_ptr() for a in inside) == [0, PIECE, 2 * PIECE]
    assert matrix.data_ptr() in store.buffers


@pytest.mark.process
def test_a_destination_that_cannot_take_the_bytes_is_filled_by_a_copy(uri: str) -> None:
    with _manager(uri) as mgr:
        mgr.save(1, _state(1))
    transposed = torch.zeros(1024, 512).t()  # the right shape, not contiguous
    target = {
        "model": {
            "big": torch.zeros(BIG, dtype=torch.float32),
            "matrix": transposed,
            "small": torch.zeros(100),
        },
        "meta": {"epoch": -1},
    }
    store = ReadsInto(open_store(uri))
    with _manager(uri, store) as mgr:
        assert mgr.restore(target) == 1
    assert _same(target, _state(1))
    assert not target["model"]["matrix"].is_contiguous()
    assert transposed.data_ptr() not in store.buffers


def _big_location(root: Path, step: int) -> tuple[Path, int]:
    manifest = Manifest.from_json((root / step_folder(step) / "manifest.json").read_bytes())
    location = manifest.tensors["model.big"].chunks[0].location
    return root / step_folder(step) / location.key, location.offset


def test_a_flipped_byte_in_a_later_piece_is_caught_and_an_older_step_restored(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ck"
    with _manager(str(root)) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    path, offset = _big_location(root, 2)
    data = bytearray(path.read_bytes())
    data[offset + PIECE + 5 * MIB // 2] ^= 0x01  # inside the second piece of model.big
    path.write_bytes(bytes(data))
    target = {"model": {k: torch.zeros_like(v) for k, v in _state(1)["model"].items()}}
    target["meta"] = {"epoch": -1}
    with (
        _manager(str(root)) as mgr,
        pytest.raises(CorruptCheckpointError, match=r"CRC32C mismatch .*block \d+ of .model\.big."),
    ):
        mgr.restore(target, step=2)
    with _manager(str(root)) as mgr:
        assert mgr.restore(target) == 1  # the damaged step is skipped; step 1 overwrites all
    assert _same(target, _state(1))
