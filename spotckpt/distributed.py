"""torch.distributed plumbing of the manager: one gloo group, flag agreement, broadcast, markers
and a notice board in the group's key-value store.

Everything here is a no-op for a single process (no initialised process group), so the manager
calls it unconditionally. Collectives run on a gloo group of their own with the manager's
timeout, so a dead rank fails them in bounded time even when training uses NCCL.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

log = logging.getLogger("spotckpt")
T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


class RankZeroOnly(logging.Filter):
    """Keeps a record of the manager's logger on rank 0 only, unless it is about this rank.

    Every rank runs the same saves and restores, so their lines would repeat world-size times;
    a line about this rank alone is logged with ``extra={"this_rank": True}``.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, "this_rank", False))


_RANK_ZERO_ONLY = RankZeroOnly()
THIS_RANK = {"this_rank": True}
"""``extra=`` for a log line that only this rank can tell (shown on every rank)."""


class Collective:
    """This process's place in the job and the collectives the manager needs."""

    def __init__(self, timeout_s: float) -> None:
        distributed = is_distributed()
        self.rank = dist.get_rank() if distributed else 0
        if self.rank != 0 and _RANK_ZERO_ONLY not in log.filters:
            log.addFilter(_RANK_ZERO_ONLY)
        self.world_size = dist.get_world_size() if distributed else 1
        timeout = timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        # Saves run their collectives on a group of their own: an async save's upload thread
        # must never share a group with the collectives the training thread runs meanwhile
        # (preemption agreement), or their messages cross and both hang.
        self.save_group = dist.new_group(backend="gloo", timeout=timeout) if distributed else None

    @property
    def single(self) -> bool:
        """True without a process group: every collective is the identity."""
        return self.group is None

    def any(self, local: bool) -> bool:
        """True on every rank if `local` is true on any rank."""
        return self._reduce(local, dist.ReduceOp.MAX)

    def all(self, local: bool) -> bool:
        """True on every rank only if `local` is true on every rank."""
        return self._reduce(local, dist.ReduceOp.MIN)

    def _reduce(self, local: bool, op: Any) -> bool:
        if self.group is None:
            return local
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=op, group=self.group)
        return bool(flag.item())

    def sum(self, values: list[int]) -> list[int]:
        """Element-wise sums of `values` over all ranks."""
        if self.group is None:
            return list(values)
        totals = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.group)
        return [int(v) for v in totals.tolist()]

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """Rank `src`'s `value` on every rank (pickled by torch between our own processes only)."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if self.group is None:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def for_saves(self) -> Collective:
        """The same collectives on the saves' own group (see `save_group`)."""
        view = copy.copy(self)
        view.group = self.save_group
        return view

    def run_on_coordinator(self, fn: Callable[[], T]) -> T:
        """`fn()` run on rank 0 only; every rank returns its result or raises its error.

        A coordinator-only failure would otherwise leave the other ranks waiting forever.
        """
        if self.group is None:
            return fn()
        outcome: tuple[bool, Any] = (True, None)
        if self.rank == 0:
            try:
                outcome = (True, fn())
            except Exception as error:  # every rank raises it below
                outcome = (False, error)
        ok, value = self.broadcast(outcome)
        if not ok:
            raise value
        return cast(T, value)


class RankProgress:
    """Per-save markers in the process group's key-value store, to name a dead or hung rank.

    Each rank marks ``written`` when its objects are stored, or ``failed`` when it sees the save
    fail. After a collective error the survivors wait for every rank to leave a marker; the ranks
    that leave none within `grace_s` died or hung. Each survivor then marks ``reported``, and
    rank 0, which hosts the store in a torchrun job, waits for the other survivors' reports
    before it returns, so that its exit cannot take the store away from a slower survivor.
    """

    def __init__(self, prefix: str, world_size: int, grace_s: float = 30.0) -> None:
        self.prefix = prefix
        self.world_size = world_size
        self.grace_s = grace_s

    def _key(self, rank: int, what: str) -> str:
        return f"{self.prefix}/{rank}/{what}"

    def mark_written(self) -> None:
        """Record that this rank's objects are written."""
        kv = _kv_store()
        if kv is not None:
            kv.set(self._key(dist.get_rank(), "written"), "1")

    def clear(self) -> None:
        """Remove this rank's ``written`` marker once it is no longer needed (the store keeps
        every key until the job ends)."""
        kv = _kv_store()
        if kv is not None:
            try:
                kv.delete_key(self._key(dist.get_rank(), "written"))
            except (RuntimeError, NotImplementedError) as error:
                log.debug("rank marker not removed: %s", error)

    def silent_ranks(self) -> list[int] | None:
        """Mark this rank as failed; return the ranks that left no marker in time.

        None when the store itself could not be reached (then nobody can tell which rank).
        """
        kv = _kv_store()
        if kv is None:
            return None
        rank = dist.get_rank()
        try:
            kv.set(self._key(rank, "failed"), "1")
            silent = self._wait(kv, ("written", "failed"), range(self.world_size))
            kv.set(self._key(rank, "reported"), "1")
            if rank == 0:
                others = [r for r in range(1, self.world_size) if r not in silent]
                self._wait(kv, ("reported",), others)
            return silent
        except (RuntimeError, TimeoutError) as error:  # DistStoreError derives from RuntimeError
            log.debug("rank markers unavailable: %s", error)
            return None

    def _wait(self, kv: Any, marks: tuple[str, ...], ranks: Any) -> list[int]:
        """The ranks among `ranks` that have none of `marks` once all have, or after grace_s."""
        deadline = time.monotonic() + self.grace_s
        while True:
            missing = [r for r in ranks if not any(kv.check([self._key(r, m)]) for m in marks)]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)


class NoticeBoard:
    """A preemption notice and finished uploads, posted in the process group's key-value store,
    which every rank reads without a collective.

    While the ranks wait for an upload in flight before a due save, a collective would hold
    each of them (and its signal handlers) until every upload is done, so one rank's notice
    would reach the others only after it: a notice ~a save's time late. On the board a rank's
    notice is seen by the others at their next look. `prefix` is drawn once per job process
    (one board per incarnation: a restarted job never reads its predecessor's notice). A store
    that cannot answer raises RuntimeError; the caller looks again later.
    """

    def __init__(self, prefix: str, world_size: int) -> None:
        self.prefix = prefix
        self.world_size = world_size

    def post_notice(self) -> bool:
        """Tell every rank that this one got a preemption notice; True once posted."""
        _required_store().set(f"{self.prefix}/notice", "1")
        return True

    def noticed(self) -> bool:
        """Whether any rank posted a notice."""
        return bool(_required_store().check([f"{self.prefix}/notice"]))

    def post_done(self, wait: int) -> bool:
        """Count this rank's upload as done (for the `wait`-th wait); True once counted."""
        _required_store().add(f"{self.prefix}/done-{wait}", 1)
        return True

    def all_done(self, wait: int) -> bool:
        """Whether every rank counted its upload done for the `wait`-th wait (one counter: a
        look costs the store one request, whatever the world size)."""
        return int(_required_store().add(f"{self.prefix}/done-{wait}", 0)) >= self.world_size

    def clear_done(self, wait: int) -> None:
        """Remove the `wait`-th wait's counter once every rank has left it (the store keeps
        every key until the job ends); one rank does it."""
        kv = _kv_store()
        if kv is not None:
            try:
                kv.delete_key(f"{self.prefix}/done-{wait}")
            except (RuntimeError, NotImplementedError) as error:
                log.debug("upload counter not removed: %s", error)


def _required_store() -> Any:
    kv = _kv_store()
    if kv is None:
        raise RuntimeError("the process group's key-value store cannot be reached")
    return kv


def _kv_store() -> Any:
    if not is_distributed():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None
