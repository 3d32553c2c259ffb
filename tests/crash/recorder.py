"""The crash explorer's recorder: a store wrapper that records every call of the store protocol,
and applies a fault at one named call when asked to.

A call is named ``rank:op:key#n``: the rank, the operation (``put``, ``open``, ``write``,
``commit``, ``abort``, ``part`` (a back end handing off one multipart part), ``get``, ``get_range``,
``get_range_into``, ``get_range_into_views``, ``head``, ``exists``, ``list``,
``list_delimited``, ``delete_many``, ``list_uploads``, ``abort_upload``), the key (the prefix for
listings, the first key for a deletion; tier calls start with ``tier/``) and how many times this
rank made that same call before. Concurrent uploads that reorder between runs still give every
call the same name, so a name found in one run picks the same point in a replay.

Every mutating call that completes leaves an `Effect` (the object's bytes, or the deleted keys),
numbered in the order the calls started: the bucket a crash at a call would leave is the effects
of the calls before it, with or without the call itself (`Trace.objects_at`).

A fault (`Fault`) is applied by the wrapper when the named call comes: a crash (the process is
gone: this call and every later one, in any thread and on any of the run's stores, raise
`SimulatedCrash` and change nothing), an error on that one call, or something another actor does
right then (gc, a damaged object, a forged manifest).
"""

from __future__ import annotations

import builtins
import os
import re
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotckpt.storage import (
    Listing,
    ObjectInfo,
    ObjectStore,
    ObjectWriter,
    PermissionDeniedError,
    StorageError,
    UploadInfo,
)
from spotckpt.storage.base import get_range_into_views

MUTATING = frozenset({"put", "commit", "delete_many"})
TIER = "tier/"
"""Key prefix of the calls a fast tier makes on its node folder."""


_RANDOM = (
    re.compile(r"a-[0-9a-f]{16}"),  # a save attempt's id
    re.compile(r"[0-9]{8}T[0-9]{6}\.[0-9]{6}Z"),  # an event's time stamp
    re.compile(r"(?<=-)[0-9a-f]{8}(?=-)"),  # an event writer's id
    re.compile(r"clock-[0-9a-f]+"),  # gc's clock probe
)


class SimulatedCrash(BaseException):
    """The process died at a recorded call: nothing after it happens (not an Exception, so that
    nothing in spotckpt mistakes it for an error it could handle)."""


@dataclass(frozen=True)
class Call:
    """One recorded call of the store protocol."""

    seq: int
    """Order in which the run's calls started, over every rank and thread of this process."""
    rank: int
    op: str
    key: str
    nth: int
    """How many calls of this rank made the same `op` on the same (aliased) key before it: a
    rank's own order of calls on one key is stable where concurrent uploads reorder between
    keys, so a name picks the same call on a replay."""

    @property
    def name(self) -> str:
        """``rank:op:key#nth``, the point's name in reports and reproducers."""
        return f"{self.rank}:{self.op}:{self.key}#{self.nth}"


@dataclass(frozen=True)
class Effect:
    """What a completed mutating call changed: ``data`` written, or None for a deletion."""

    seq: int
    key: str
    data: bytes | None


@dataclass(frozen=True)
class Mark:
    """Something the scenario learned between calls (a step it was told is committed)."""

    seq: int
    what: str
    step: int


@dataclass
class Fault:
    """A fault applied at the call named `point`, of one of the kinds below (or the fast
    tier's ``replay-crash`` and ``host``, or ``kill``)."""

    point: str
    kind: str
    act: Callable[[], None] | None = None
    """For "gc", "damaged" and "forged": what the other actor does, right before the call."""
    fired: bool = False


CRASH_KINDS = ("crash", "lost")
"""Rebuilt from the trace: the call not applied, or applied with its answer lost."""
ERROR_KINDS = ("transient", "denied")
"""Replayed: one call fails with what a store raises after its retries, or with a refusal."""
ACTOR_KINDS = ("gc", "damaged", "forged")
"""Replayed: right before the call, gc runs, a committed object is damaged, or a manifest of a
higher step is forged."""


class Trace:
    """Every call, effect and mark of one run, and the one fault it applies (if any)."""

    def __init__(self, fault: Fault | None = None) -> None:
        self.calls: list[Call] = []
        self.effects: list[Effect] = []
        self.marks: list[Mark] = []
        self.fault = fault
        self.dead = False
        self.explore_from = 0
        """Calls before this `seq` belong to the scenario's set-up: not points."""
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, str, str], int] = {}
        self._aliases: dict[str, dict[str, str]] = {}

    # Recording ---------------------------------------------------------------------------------

    def begin(self, rank: int, op: str, key: str) -> Call:
        """Record the start of a call; apply the fault when it is the named one."""
        with self._lock:
            if self.dead:
                raise SimulatedCrash(f"{op} {key} after the crash")
            key = self._alias(key)
            nth = self._seen.get((rank, op, key), 0)
            self._seen[(rank, op, key)] = nth + 1
            call = Call(len(self.calls), rank, op, key, nth)
            self.calls.append(call)
            fault = self.fault
            if fault is None or fault.fired or fault.point != call.name:
                return call
            fault.fired = True
            if fault.kind in ("crash", "replay-crash", "host"):
                self.dead = True
        self._apply(fault, call)
        return call

    def _alias(self, key: str) -> str:
        """`key` with its random parts (attempt ids, event stamps and writers) named by their
        order of first appearance in the run, so that a replay names the same call the same."""
        for pattern in _RANDOM:
            key = pattern.sub(lambda m, p=pattern: self._name_of(p, m.group(0)), key)
        return key

    def _name_of(self, pattern: re.Pattern[str], token: str) -> str:
        names = self._aliases.setdefault(pattern.pattern, {})
        if token not in names:
            names[token] = f"{token[:2] if token.startswith('a-') else ''}~{len(names)}"
        return names[token]

    def _apply(self, fault: Fault, call: Call) -> None:
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.dead:
            raise SimulatedCrash(f"crashed at {call.name}")
        if fault.kind == "transient":
            raise StorageError(f"{call.op} {call.key}: connection reset (injected, retries spent)")
        if fault.kind == "denied":
            raise PermissionDeniedError(f"{call.op} {call.key}: access denied (injected)")
        if fault.act is not None:
            fault.act()

    def end(self, call: Call, key: str, data: bytes | None) -> None:
        """Record a completed mutating call's effect on `key` (`data` None: deleted)."""
        with self._lock:
            self.effects.append(Effect(call.seq, key, data))
            if (
                self.fault is not None
                and self.fault.kind == "lost"
                and self.fault.point == call.name
            ):
                self.dead = True
        if self.dead:
            raise SimulatedCrash(f"the answer to {call.name} was lost")

    def mark(self, what: str, step: int) -> None:
        """Record what the scenario was told (e.g. ``committed``) at this moment."""
        with self._lock:
            self.marks.append(Mark(len(self.calls), what, step))

    def start_exploring(self) -> None:
        """Calls from here on are points; the ones before are the set-up."""
        with self._lock:
            self.explore_from = len(self.calls)

    # Reading -----------------------------------------------------------------------------------

    def points(self) -> list[Call]:
        """The calls a fault may be put on."""
        return self.calls[self.explore_from :]

    def marked(self, what: str, before_seq: int) -> list[int]:
        """Steps marked `what` before the call numbered `before_seq` started."""
        return [mark.step for mark in self.marks if mark.what == what and mark.seq <= before_seq]

    def objects_at(self, seq: int, applied: bool) -> dict[str, bytes]:
        """The bucket's objects (tier calls left out) after the calls before `seq`, and that
        call too when `applied`."""
        objects: dict[str, bytes] = {}
        for effect in sorted(self.effects, key=lambda e: e.seq):
            if effect.seq > seq or (effect.seq == seq and not applied):
                continue
            if effect.key.startswith(TIER):
                continue
            if effect.data is None:
                objects.pop(effect.key, None)
            else:
                objects[effect.key] = effect.data
        return objects


class RecordingWriter:
    """A streamed object: ``open``, each ``write`` and the ``commit`` or ``abort`` are calls."""

    def __init__(self, store: RecordingStore, key: str, create_only: bool) -> None:
        self.store = store
        self.key = key
        store.trace.begin(store.rank, "open", store.named(key))
        self.inner = store.inner.open_writer(key, create_only=create_only)
        self.data = bytearray()
        chunk_full = getattr(self.inner, "_chunk_full", None)
        if chunk_full is not None:  # a back end's multipart part (a GCS chunk, an Azure block)

            def part() -> None:
                store.trace.begin(store.rank, "part", store.named(key))
                chunk_full()

            self.inner._chunk_full = part  # type: ignore[attr-defined]

    @property
    def bytes_written(self) -> int:
        return self.inner.bytes_written

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.store.trace.begin(self.store.rank, "write", self.store.named(self.key))
        self.inner.write(data)
        self.data += memoryview(data).cast("B")

    def commit(self) -> ObjectInfo:
        call = self.store.trace.begin(self.store.rank, "commit", self.store.named(self.key))
        info = self.inner.commit()
        self.store.trace.end(call, self.store.named(self.key), bytes(self.data))
        return info

    def abort(self) -> None:
        self.store.trace.begin(self.store.rank, "abort", self.store.named(self.key))
        self.inner.abort()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class RecordingStore:
    """A real store whose every call is recorded in `trace` (and may meet its fault)."""

    def __init__(
        self,
        inner: ObjectStore,
        trace: Trace,
        rank: int = 0,
        tier: str = "",
        child_log: Path | None = None,
        child_fault: Fault | None = None,
    ) -> None:
        self.inner = inner
        self.trace = trace
        self.rank = rank
        self.tier = tier
        """Non-empty for a fast tier's node folder: its calls are named ``tier/<tier>/<key>``."""
        self.child_log = child_log
        """Where this store's copy in DCP's upload process records its calls
        (`upload_process`); None: the store refuses to leave this process."""
        self.child_fault = child_fault
        """The fault its copy in the upload process applies (its point's rank reads ``0u``)."""

    def named(self, key: str) -> str:
        return f"{TIER}{self.tier}/{key}" if self.tier else key

    def _call(self, op: str, key: str) -> Call:
        return self.trace.begin(self.rank, op, self.named(key))

    @property
    def uri(self) -> str:
        return self.inner.uri

    def open_writer(self, key: str, *, create_only: bool = False) -> ObjectWriter:
        return RecordingWriter(self, key, create_only)  # type: ignore[return-value]

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        call = self._call("put", key)
        info = self.inner.put(key, data, create_only=create_only)
        self.trace.end(call, self.named(key), bytes(data))
        return info

    def get(self, key: str) -> bytes:
        self._call("get", key)
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self._call("get_range", key)
        return self.inner.get_range(key, start, length)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        self._call("get_range_into", key)
        return self.inner.get_range_into(key, start, buffer)

    def get_range_into_views(self, key: str, start: int, views: Sequence[memoryview]) -> int:
        self._call("get_range_into_views", key)
        return get_range_into_views(self.inner, key, start, views)

    def head(self, key: str) -> ObjectInfo | None:
        self._call("head", key)
        return self.inner.head(key)

    def exists(self, key: str) -> bool:
        self._call("exists", key)
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._call("list", prefix)
        return iter(builtins.list(self.inner.list(prefix)))

    def list_delimited(self, prefix: str, delimiter: str) -> Listing:
        self._call("list_delimited", prefix)
        return self.inner.list_delimited(prefix, delimiter)

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = builtins.list(keys)
        call = self._call("delete_many", keys[0] if keys else "")
        self.inner.delete_many(keys)
        for key in keys:
            self.trace.end(call, self.named(key), None)

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        self._call("list_uploads", prefix)
        return self.inner.list_uploads(prefix)

    def abort_upload(self, upload: UploadInfo) -> None:
        self._call("abort_upload", upload.key)  # nothing visible changes
        self.inner.abort_upload(upload)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # a back end's own extras (a folder's fds)
        return getattr(self.inner, name)

    def __reduce__(self) -> Any:
        """With a `child_log`, pickle (ForkingPickler: the inner store must pickle) as the
        recorder of DCP's upload process; without one, refuse."""
        if self.child_log is None:
            raise TypeError("a recording store stays in the process that records")
        from upload_process import upload_recorder

        fault = self.child_fault
        travelled = None if fault is None else (fault.point, fault.kind)
        return upload_recorder, (self.inner, self.rank, str(self.child_log), travelled)


@dataclass
class TierRecorder:
    """Routes a fast tier's node-folder stores through the run's trace (see `install`)."""

    trace: Trace
    rank: int = 0

    def install(self, monkeypatch: Any) -> None:
        """Make `spotckpt.tiers.fast_tier` open its node folders through recording stores."""
        import spotckpt.tiers.fast_tier as fast_tier
        from spotckpt.storage.local import LocalStore

        def recording_local_store(root: Any, fsync: bool = True) -> RecordingStore:
            name = f"{os.path.basename(os.fspath(root))}-{'synced' if fsync else 'unsynced'}"
            return RecordingStore(LocalStore(root, fsync=fsync), self.trace, self.rank, name)

        monkeypatch.setattr(fast_tier, "LocalStore", recording_local_store)
