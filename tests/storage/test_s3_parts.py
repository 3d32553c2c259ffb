"""Multipart part sizes grow so that one object can reach S3's 5 TiB limit, with bounded memory."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest

from spotckpt.storage import open_store
from spotckpt.storage import s3 as s3_module
from spotckpt.storage.s3 import (
    MAX_OBJECT_SIZE,
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    PARTS_PER_DOUBLING,
    part_size_for,
)

MIB = 1 << 20


@pytest.mark.parametrize("base", [MIN_PART_SIZE, 16 * MIB, 64 * MIB])
def test_ten_thousand_parts_hold_five_tebibytes(base: int) -> None:
    sizes = [part_size_for(n, base) for n in range(1, MAX_PARTS + 1)]
    assert sum(sizes) >= MAX_OBJECT_SIZE
    assert sizes[:PARTS_PER_DOUBLING] == [base] * PARTS_PER_DOUBLING  # small objects: no growth
    assert all(a <= b for a, b in itertools.pairwise(sizes))
    assert max(sizes) <= MAX_PART_SIZE and min(sizes) >= MIN_PART_SIZE


def test_a_fixed_part_size_would_stop_at_156_gib() -> None:
    """The ceiling this schedule removes (16 MiB x 10,000 parts)."""
    assert 16 * MIB * MAX_PARTS < 157 << 30 < MAX_OBJECT_SIZE


class PartRecorder:
    """Wraps a store's upload_part: part sizes in order, and the most bytes in flight at once."""

    def __init__(self, store: Any) -> None:
        self.inner = store.upload_part
        self.sizes: dict[int, int] = {}
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()
        store.upload_part = self

    def __call__(self, key: str, upload_id: str, number: int, body: bytearray) -> Any:
        with self.lock:
            self.sizes[number] = len(body)
            self.in_flight += len(body)
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return self.inner(key, upload_id, number, body)
        finally:
            with self.lock:
                self.in_flight -= len(body)


def test_writer_grows_parts_on_schedule(s3_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_module, "PARTS_PER_DOUBLING", 2)
    store = open_store(s3_uri, part_size=MIN_PART_SIZE, max_concurrency=2)
    recorder = PartRecorder(store)
    data = bytes(range(256)) * (47 * MIB // 256)
    with store.open_writer("big.bin") as writer:
        for start in range(0, len(data), 3 * MIB + 17):  # odd write sizes
            writer.write(data[start : start + 3 * MIB + 17])
    sizes = [recorder.sizes[n] for n in sorted(recorder.sizes)]
    assert sizes == [5 * MIB, 5 * MIB, 10 * MIB, 10 * MIB, 17 * MIB]
    assert store.get("big.bin") == data
    assert recorder.most_in_flight <= max(2 * MIN_PART_SIZE, max(sizes))
    store.close()
