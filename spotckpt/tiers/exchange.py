"""Moving bytes between ranks over the job's process group, in one global order.

Work is a list of `Job`\\ s that every rank holds in the same order: a job's `inputs` are
pieces of objects held by some ranks, its `target` rank gathers them (reading its own from
disk, receiving the others) and hands them to its completion (copy, parity, rebuild). Each rank
walks the list and takes part only in the jobs that name it; sends and receives are blocking,
and since the first unfinished job in the list always has all its ranks at it, the walk cannot
deadlock. Memory holds one job's inputs at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

PIECE_BYTES = 16 << 20
"""The largest piece one job moves (a stripe of an erasure-coded group, a part of a copy)."""


@dataclass(frozen=True)
class Piece:
    """`length` bytes at `offset` of the tier object `key`, held by rank `holder`."""

    holder: int
    key: str
    offset: int
    length: int


@dataclass(frozen=True)
class Job:
    """Bring `inputs` to `target`; `action` names what the target does with them there."""

    target: int
    inputs: tuple[Piece, ...]
    action: Any


Read = Callable[[Piece], bytes]
Complete = Callable[[Job, list[bytes]], None]


def run_jobs(jobs: list[Job], rank: int, group: Any, read: Read, complete: Complete) -> int:
    """Take part in every job naming this rank; returns the bytes received from other ranks."""
    received = 0
    for job in jobs:
        if job.target == rank:
            pieces = []
            for piece in job.inputs:
                if piece.holder == rank:
                    pieces.append(read(piece))
                else:
                    pieces.append(_receive(piece, group))
                    received += piece.length
            complete(job, pieces)
            continue
        for piece in job.inputs:
            if piece.holder == rank:
                _send(read(piece), job.target, group)
    return received


def _send(data: bytes, target: int, group: Any) -> None:
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=target, group=group)


def _receive(piece: Piece, group: Any) -> bytes:
    if not piece.length:
        return b""
    buffer = torch.empty(piece.length, dtype=torch.uint8)
    dist.recv(buffer, src=piece.holder, group=group)
    return buffer.numpy().tobytes()


def pieces_of(holder: int, key: str, size: int, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """`key` (of `size` bytes, held by `holder`) cut into pieces of at most `piece_bytes`."""
    return [
        Piece(holder, key, offset, min(piece_bytes, size - offset))
        for offset in range(0, size, piece_bytes)
    ]
