"""The bytes a fast-tier operation moves into a node's folder: the jobs that make parity pieces
(`parity_jobs`), what a job's target does with its pieces (`complete_into`: a copy, or a parity or
rebuilt block, `code_block`), and the `Sink` that writes them at their offsets, keeping the
CRC32C of what it wrote front to back for the tier record (`parity_records`).
"""

from __future__ import annotations

import errno
import os
from typing import Any

from spotckpt.checksum import crc32c
from spotckpt.errors import CorruptCheckpointError, DiskFullError, StorageError
from spotckpt.format.manifest import Manifest
from spotckpt.layout import step_key
from spotckpt.storage.local import LocalStore
from spotckpt.tiers.erasure import data_block, parity_block
from spotckpt.tiers.exchange import PIECE_BYTES, Job, Piece
from spotckpt.tiers.folder import WRITE_FLAGS
from spotckpt.tiers.record import GroupRecord, ParityRecord
from spotckpt.tiers.recovery import Code, Copy


class Sink:
    """Objects this rank's jobs write into its tier: pieces land at their offsets in files
    sized to the object (sparse where nothing was written), so that a restore brings only the
    ranges it reads. The CRC32C of an object written front to back (a copy or parity made at a
    save) is kept for its record."""

    def __init__(self, store: LocalStore, step: int) -> None:
        self.store = store
        self.step = step
        self.files: dict[str, int] = {}
        self.crcs: dict[str, tuple[int, int]] = {}  # key -> (bytes written in order, CRC32C)

    def write(self, key: str, size: int, offset: int, data: bytes) -> None:
        try:
            fd = self.files.get(key)
            if fd is None:
                fd = self._open(key, size)
            view, at = memoryview(data), offset
            while view:  # a regular file takes it all at once; a short write is continued
                written = os.pwrite(fd, view, at)
                view, at = view[written:], at + written
        except OSError as error:
            raise write_failure(self.store, step_key(self.step, key), error) from None
        done, crc = self.crcs.get(key, (0, 0))
        if done == offset:
            self.crcs[key] = (done + len(data), crc32c(data, crc))

    def _open(self, key: str, size: int) -> int:
        path = step_key(self.step, key)
        folder = self.store.folder_for_write(path)
        try:
            fd = os.open(path.rsplit("/", 1)[-1], WRITE_FLAGS, 0o644, dir_fd=folder)
        finally:
            os.close(folder)
        os.ftruncate(fd, size)
        self.files[key] = fd
        return fd

    def crc(self, key: str, size: int) -> int | None:
        """The CRC32C of `key` if all its `size` bytes were written front to back."""
        done, crc = self.crcs.get(key, (0, 0))
        return crc if done == size else None

    def close(self) -> None:
        """Close every file (on failure too: what was written is checked before any use)."""
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()


def write_failure(store: LocalStore, key: str, error: OSError) -> StorageError:
    """A failed write into the tier, as an error that says what to do."""
    where = f"{store.uri}/{key}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            f"disk full while writing {where}: free space under local_dir, or keep fewer steps "
            "there (local_keep_last)"
        )
    return StorageError(f"writing {where} failed: {error.strerror or error}")


def complete_into(sink: Sink) -> Any:
    """What a job's target does with the pieces it gathered."""

    def complete(job: Job, pieces: list[bytes]) -> None:
        action = job.action
        if isinstance(action, Copy):
            sink.write(action.key, action.size, job.inputs[0].offset, pieces[0])
        elif isinstance(action, Code):
            sink.write(action.key, action.size, action.offset, code_block(action, pieces))
        else:
            raise CorruptCheckpointError(f"unknown fast-tier job {action!r}")

    return complete


def code_block(action: Code, pieces: list[bytes]) -> bytes:
    """The output block of a parity or rebuild job, from its inputs and known-zero blocks."""
    blocks = {n: p.ljust(action.length, b"\0") for n, p in zip(action.numbers, pieces, strict=True)}
    blocks.update({n: bytes(action.length) for n in action.zeros})
    if action.parity:
        data = [blocks[n] for n in range(action.data)]
        return parity_block(data, action.parity_count, action.index)[: action.keep]
    return data_block(blocks, action.data, action.parity_count, action.index)[: action.keep]


def parity_jobs(
    manifest: Manifest, index: int, group: GroupRecord, holders: tuple[int, ...]
) -> list[Job]:
    """For each parity holder of group `index`, one job per stripe bringing it the data."""
    ranks = {record.key: record.rank for record in manifest.objects.values()}
    sizes = {record.key: record.size for record in manifest.objects.values()}
    jobs = []
    for j, holder in enumerate(holders):
        for offset in range(0, max(group.block_size, 1), PIECE_BYTES):
            length = max(0, min(PIECE_BYTES, group.block_size - offset))
            inputs, numbers, zeros = [], [], []
            for n, key in enumerate(group.data):
                if key and sizes[key] > offset:
                    inputs.append(Piece(ranks[key], key, offset, min(length, sizes[key] - offset)))
                    numbers.append(n)
                else:
                    zeros.append(n)
            code = Code(
                group.parity[j].key,
                group.block_size,
                offset,
                j,
                len(group.data),
                len(holders),
                tuple(numbers),
                tuple(zeros),
                length,
                length,
                parity=True,
            )
            jobs.append(Job(holder, tuple(inputs), code))
    return jobs


def parity_records(
    sink: Sink, manifest: Manifest, jobs: list[Job], rank: int
) -> list[ParityRecord]:
    """The parity objects this rank wrote, with their sizes and CRC32Cs (None if unfinished)."""
    records = []
    for job in jobs:
        action = job.action
        if job.target == rank and isinstance(action, Code) and action.offset == 0:
            crc = sink.crc(action.key, action.size)
            if crc is not None:
                records.append(ParityRecord(action.key, action.size, crc))
    return records
