"""Moving bytes between ranks over the job's process group, in one global order.

Work is a list of `Job`\\ s that every rank holds in the same order: a job's `inputs` are
pieces of objects held by some ranks, its `target` rank gathers them (reading its own from
disk, receiving the others) and hands them to its completion (copy, parity, rebuild). Each rank
walks the list and takes part only in the jobs that name it; sends and receives are blocking,
and since the first unfinished job in the list always has all its ranks at it, the walk cannot
deadlock. Memory holds one job's inputs at a time.

A rank's own trouble never stops the walk, since its peers would wait for it until the group's
timeout: a piece it cannot read whole is sent marked as failed (every piece travels with a
status byte after its bytes), a job whose completion fails (a full disk) leaves the rest of its
jobs received but not completed, and a peer whose connection breaks (it died) is left out of the
rest of the walk. `run_jobs` reports all of it in an `Outcome`, which the ranks then share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from spotckpt.errors import CheckpointError

PIECE_BYTES = 16 << 20
"""The largest piece one job moves (a stripe of an erasure-coded group, a part of a copy)."""
_SENT, _NOT_SENT = 0, 1
"""The status byte after a piece's bytes: whole, or its holder could not read it."""


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


@dataclass
class Outcome:
    """What one rank's walk did: bytes received from peers, its first own failure (a read, a
    write: None if none), how many jobs it had to leave incomplete, and the peers it lost."""

    received: int = 0
    failure: str | None = None
    incomplete: int = 0
    lost: set[int] = field(default_factory=set)

    def fail(self, error: BaseException) -> None:
        """Record a failure of this rank (the first one is the one reported)."""
        if self.failure is None:
            self.failure = f"{type(error).__name__}: {error}"


Read = Callable[[Piece], bytes]
Complete = Callable[[Job, list[bytes]], None]


def run_jobs(jobs: list[Job], rank: int, group: Any, read: Read, complete: Complete) -> Outcome:
    """Take part in every job naming this rank; see the module docstring."""
    outcome = Outcome()
    for job in jobs:
        if job.target == rank:
            _gather(job, rank, group, read, complete, outcome)
            continue
        for piece in job.inputs:
            if piece.holder == rank and piece.length and job.target not in outcome.lost:
                _send(_read(piece, read, outcome), piece, job.target, group, outcome)
    return outcome


def _gather(
    job: Job, rank: int, group: Any, read: Read, complete: Complete, outcome: Outcome
) -> None:
    """The target's part of a job: its inputs, then the completion if every one came whole."""
    pieces: list[bytes | None] = []
    for piece in job.inputs:
        if piece.holder == rank:
            pieces.append(_read(piece, read, outcome))
        elif not piece.length:
            pieces.append(b"")
        elif piece.holder in outcome.lost:
            pieces.append(None)
        else:
            pieces.append(_receive(piece, group, outcome))
    whole = [p for p in pieces if p is not None]
    if len(whole) < len(pieces) or outcome.failure is not None:
        outcome.incomplete += 1
        return
    try:
        complete(job, whole)
    except (CheckpointError, OSError) as error:
        outcome.fail(error)
        outcome.incomplete += 1


def _read(piece: Piece, read: Read, outcome: Outcome) -> bytes | None:
    """This rank's own piece, or None (its failure recorded) if it cannot be read whole."""
    if outcome.failure is not None:
        return None  # the walk goes on only to keep peers moving: no more reading
    try:
        data = read(piece)
    except (CheckpointError, OSError) as error:
        outcome.fail(error)
        return None
    if len(data) != piece.length:
        outcome.fail(
            CheckpointError(
                f"{piece.key} gave {len(data)} bytes at offset {piece.offset}, not {piece.length}"
            )
        )
        return None
    return data


def _send(data: bytes | None, piece: Piece, target: int, group: Any, outcome: Outcome) -> None:
    """Send a piece and its status byte; a piece that could not be read goes as zeros, marked."""
    buffer = bytearray(piece.length + 1)
    if data is None:
        buffer[-1] = _NOT_SENT
    else:
        buffer[: piece.length] = data
    try:
        dist.send(torch.frombuffer(buffer, dtype=torch.uint8), dst=target, group=group)
    except RuntimeError:  # gloo: the connection to `target` broke (it died or timed out)
        outcome.lost.add(target)


def _receive(piece: Piece, group: Any, outcome: Outcome) -> bytes | None:
    """A piece from its holder; None if it came marked as failed or its holder was lost."""
    buffer = torch.empty(piece.length + 1, dtype=torch.uint8)
    try:
        dist.recv(buffer, src=piece.holder, group=group)
    except RuntimeError:  # gloo: the connection to the holder broke (it died or timed out)
        outcome.lost.add(piece.holder)
        return None
    if int(buffer[-1]) != _SENT:
        return None
    outcome.received += piece.length
    return buffer[:-1].numpy().tobytes()


def pieces_of(holder: int, key: str, size: int, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """`key` (of `size` bytes, held by `holder`) cut into pieces of at most `piece_bytes`."""
    return [
        Piece(holder, key, offset, min(piece_bytes, size - offset))
        for offset in range(0, size, piece_bytes)
    ]
