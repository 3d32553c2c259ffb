"""Moving bytes between ranks over the job's process group, in rounds that every rank derives
from one list.

Work is a list of `Job`\\ s that every rank holds in the same order: a job's `inputs` are
pieces of objects held by some ranks, its `target` rank gathers them (reading its own from
disk, receiving the others) and hands them to its completion (copy, parity, rebuild), which
writes the object `action.key`. `schedule` groups the list into rounds in which each rank
gathers for at most one job and sends for at most `SENDS_PER_ROUND`, keeping every rank's
order as a target (so every pair's messages keep their order), never sending a piece of an
object before the job that writes it there completed, and never writing an object before an
earlier job's read of it. In a round each rank first posts its sends (non-blocking), then
receives and completes its own job, then waits for its sends: no rank blocks before its sends
are posted, so the walk cannot deadlock, and the nodes' links all carry bytes at once (a walk of
one job at a time moved one piece at a time job-wide: a replicated save on n nodes took n times
its link-bound time). Memory holds at most one job's inputs and `SENDS_PER_ROUND` jobs'
outgoing pieces.

A rank's own trouble never stops the walk, since its peers would wait for it until the group's
timeout: a piece it cannot read whole is sent marked as failed (every piece travels with a
status byte after its bytes), a job whose completion fails (a full disk) leaves the rest of its
jobs received but not completed, and a peer whose connection breaks (it died) is left out of the
rest of the walk. `run_jobs` reports all of it in an `Outcome`, which the ranks then share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from spotckpt.errors import CheckpointError

PIECE_BYTES = 16 << 20
"""The largest piece one job moves (a stripe of an erasure-coded group, a part of a copy)."""
SENDS_PER_ROUND = 4
"""The most jobs a rank sends pieces for in one round: a rank whose data goes to several peers
(erasure coding's parity holders, replicas) feeds them at once, and its memory holds at most
this many jobs' outgoing pieces."""
_SENT, _NOT_SENT = 0, 1
"""The status byte after a piece's bytes: whole, or its holder could not read it."""


@dataclass(frozen=True)
class Piece:
    """`length` bytes at `offset` of the tier object `key`, held by rank `holder`."""

    holder: int
    key: str
    offset: int
    length: int


class Action(Protocol):
    """What a job's target does with its inputs: at least, which object it writes."""

    @property
    def key(self) -> str: ...


@dataclass(frozen=True)
class Job:
    """Bring `inputs` to `target`; `action` names what the target does with them there (it
    writes the object `action.key` on the target)."""

    target: int
    inputs: tuple[Piece, ...]
    action: Action


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


def schedule(jobs: list[Job]) -> list[list[Job]]:
    """`jobs` in rounds (see the module docstring): each job in the earliest round after this
    target's previous job, after every earlier job that wrote one of its pieces' objects where
    that piece is read, not before an earlier job's read of the object it writes, and where
    each of its senders has fewer than `SENDS_PER_ROUND` sends."""
    rounds: list[list[Job]] = []
    gathers: dict[int, int] = {}  # rank: the first round it is free to gather in
    sends: dict[int, list[int]] = {}  # rank: its sends in each round
    written: dict[tuple[int, str], int] = {}  # (rank, key): the last round that wrote it there
    read: dict[tuple[int, str], int] = {}  # (rank, key): the last round that read it there
    for job in jobs:
        pieces = [p for p in job.inputs if p.length]
        senders = {p.holder for p in pieces if p.holder != job.target}
        number = max(
            [gathers.get(job.target, 0), read.get((job.target, job.action.key), 0)]
            + [written.get((p.holder, p.key), -1) + 1 for p in pieces]
        )
        while any(_sends_in(sends, holder, number) >= SENDS_PER_ROUND for holder in senders):
            number += 1
        while len(rounds) <= number:
            rounds.append([])
        rounds[number].append(job)
        gathers[job.target] = number + 1
        for holder in senders:
            counts = sends.setdefault(holder, [])
            counts.extend([0] * (number + 1 - len(counts)))
            counts[number] += 1
        for piece in pieces:
            read[(piece.holder, piece.key)] = max(read.get((piece.holder, piece.key), 0), number)
        written[(job.target, job.action.key)] = number
    return rounds


def _sends_in(sends: dict[int, list[int]], rank: int, number: int) -> int:
    counts = sends.get(rank, [])
    return counts[number] if number < len(counts) else 0


def run_jobs(jobs: list[Job], rank: int, group: Any, read: Read, complete: Complete) -> Outcome:
    """Take part in every job naming this rank, round by round; see the module docstring."""
    outcome = Outcome()
    for round_jobs in schedule(jobs):
        posted = [
            _post(_read(piece, read, outcome), piece, job.target, group, outcome)
            for job in round_jobs
            if job.target != rank and job.target not in outcome.lost
            for piece in job.inputs
            if piece.holder == rank and piece.length
        ]
        for job in round_jobs:
            if job.target == rank:
                _gather(job, rank, group, read, complete, outcome)
        for sent in posted:
            sent.finish(outcome)
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


@dataclass
class _Sending:
    """A piece on its way to `target`: its buffer stays alive until the send is done."""

    buffer: bytearray
    target: int
    work: Any

    def finish(self, outcome: Outcome) -> None:
        """Wait for the send; a broken connection leaves `target` out of the rest of the walk
        (a target already left out is not waited for: its connection is gone)."""
        if self.work is None or self.target in outcome.lost:
            return
        try:
            self.work.wait()
        except RuntimeError:  # gloo: the connection to `target` broke (it died or timed out)
            outcome.lost.add(self.target)


def _post(data: bytes | None, piece: Piece, target: int, group: Any, outcome: Outcome) -> _Sending:
    """Start sending a piece and its status byte; a piece that could not be read goes as
    zeros, marked."""
    buffer = bytearray(piece.length + 1)
    if data is None:
        buffer[-1] = _NOT_SENT
    else:
        buffer[: piece.length] = data
    try:
        work = dist.isend(torch.frombuffer(buffer, dtype=torch.uint8), dst=target, group=group)
    except RuntimeError:  # gloo: the connection to `target` broke (it died or timed out)
        outcome.lost.add(target)
        work = None
    return _Sending(buffer, target, work)


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
