"""Mirroring committed steps to a second checkpoint root (another region, another cloud).

A mirror is a checkpoint root of its own, with the same layout and the same rules, so that a job
restarted with the mirror as its root resumes from it exactly, and retention, gc and verify work
there unchanged. `Mirror.copy_step` copies one committed step:

1. the source's manifest is read and checked as a restore checks it (size bound, signature under
   the source's keys, every index part of an indexed root), which gives every object the step
   needs with its size, CRC32C and, in signed steps, BLAKE3 (`Catalog.stored_objects`);
2. the job identity goes first (create-only; a mirror that belongs to another job is refused:
   `MirrorConflictError`), so that signatures and references check at the mirror as at the source;
3. every object the step needs, of its own attempt and those of earlier steps it references, is
   copied create-only (`spotckpt.storage.copying.copy_object`), streamed and checked against the
   manifest's CRC32C (and BLAKE3) before it is committed at the mirror; an object already at the
   mirror with the manifest's size is kept (only such checked copies put one there, and keys
   carry a random attempt id);
4. last, the manifest's bytes, unchanged (so a signature still verifies), are committed
   create-only by the mirror's own commit rule (`Catalog.commit_bytes`: every object checked
   before and after the put).

So the manifest is the mirror's commit point too: a copy that fails or dies at any call leaves
the mirror without the step (objects without a manifest, which the next copy reuses and gc
collects otherwise), never with a step whose bytes are not the source's. A step the mirror
already holds with the same manifest bytes is done; with other bytes, it is a conflict.

`Mirror.catch_up` copies the committed steps the mirror lacks (of the source's newest `keep_last`,
when the mirror keeps that many), oldest first (a step that fails is reported and the next is
tried), then applies the mirror's retention.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from spotckpt.catalog import Catalog
from spotckpt.config import Settings
from spotckpt.errors import (
    AlreadyExistsError,
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MirrorConflictError,
)
from spotckpt.format.signing import Keyring
from spotckpt.layout import attempt_folder, manifest_key, parse_step_folder, step_folder
from spotckpt.mirror_spec import parse_mirrors
from spotckpt.redact import redact
from spotckpt.storage import ObjectStore, open_store
from spotckpt.storage.base import ObjectInfo
from spotckpt.storage.copying import DEFAULT_PIECE_BYTES, Expected, check_object, copy_object

log = logging.getLogger("spotckpt")

DEFAULT_COPIES = 4
"""Objects copied at once."""
HEADS = 16
"""Objects looked up at the mirror at once (what is there already)."""
RESAVE_CHECK_STEPS = 8
"""Of the steps both roots hold, the newest this many are checked at each catch-up for a save
made again at the source (``dcp_writer(overwrite=True)``) after they were mirrored."""
STOP_CHECK_S = 0.5
"""How often held copies look whether they are to stop for good."""
CLOSE_JOIN_S = 60.0
"""How long `MirrorFollower.close` waits for a stopped copy to end (one piece and its abort)."""


class BandwidthLimit:
    """At most `bytes_per_s` bytes copied per second, over every copy that shares it: a token
    bucket holding one second's worth, so a burst never exceeds it."""

    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise InvalidArgumentError(f"a bandwidth limit must be positive, got {bytes_per_s}")
        self.bytes_per_s = float(bytes_per_s)
        self._available = self.bytes_per_s
        self._updated = time.monotonic()
        self._lock = threading.Lock()

    def take(self, count: int, between: Callable[[], None] | None = None) -> None:
        """Wait until `count` bytes may go (more than a second's worth, a second's at a time,
        calling `between` before each: a stop raises there)."""
        left = float(count)
        while left > 0:
            if between is not None:
                between()
            wanted = min(left, self.bytes_per_s)
            self._take(wanted)
            left -= wanted

    def _take(self, wanted: float) -> None:
        with self._lock:  # one waiter at a time: the bucket is served in order
            now = time.monotonic()
            self._available = min(
                self.bytes_per_s, self._available + (now - self._updated) * self.bytes_per_s
            )
            self._updated = now
            short = wanted - self._available
            if short > 0:
                time.sleep(short / self.bytes_per_s)
                self._available = wanted
                self._updated = time.monotonic()
            self._available -= wanted


class MirrorStoppedError(CheckpointError):
    """Mirror copies were stopped (a preemption notice): the step in flight stays uncommitted
    at the mirror, and the next run copies it."""


class Pause:
    """Holds every mirror copy between two pieces (`hold`), or stops it there for good once
    `stop_when` says so (a preemption notice: the emergency save gets the bandwidth, and the
    mirror catches up after the restart)."""

    def __init__(self, stop_when: Callable[[], bool] | None = None) -> None:
        self._running = threading.Event()
        self._running.set()
        self._stopped = False
        self.stop_when = stop_when

    def hold(self) -> None:
        """Stop copies at their next piece."""
        self._running.clear()

    def release(self) -> None:
        """Let them go on."""
        self._running.set()

    @property
    def held(self) -> bool:
        """Whether copies are held."""
        return not self._running.is_set()

    def stop(self) -> None:
        """Stop copies for good at their next piece."""
        self._stopped = True
        self._running.set()

    @property
    def stopped(self) -> bool:
        """Whether copies are to stop for good."""
        return self._stopped or (self.stop_when is not None and self.stop_when())

    def wait_running(self) -> None:
        """Return once copies may go on; MirrorStoppedError once they are to stop."""
        while not self._running.wait(STOP_CHECK_S):  # held: look now and then for a stop
            self._raise_if_stopped()
        self._raise_if_stopped()

    def _raise_if_stopped(self) -> None:
        if self.stopped:
            raise MirrorStoppedError("mirror copies stopped (a preemption notice, a signal)")


@dataclass(frozen=True)
class StepCopy:
    """What copying one step did: objects and bytes copied, objects found already there."""

    step: int
    copied_objects: int = 0
    copied_bytes: int = 0
    present_objects: int = 0
    server_side_objects: int = 0
    """Of those copied, the objects the provider copied itself (then read back and checked)."""
    seconds: float = 0.0
    already: bool = False
    """The mirror held the step already (the same manifest bytes): nothing was copied."""


@dataclass(frozen=True)
class MirrorPlan:
    """What a catch-up would copy (`Mirror.plan`): its steps, and the objects and bytes the
    mirror lacks."""

    steps: list[int]
    objects: int
    bytes: int


@dataclass
class MirrorReport:
    """What `Mirror.catch_up` did, and how far the mirror is behind afterwards."""

    source: str
    target: str
    copied: list[StepCopy] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    retired: list[int] = field(default_factory=list)
    steps_behind: int = 0
    """Committed steps of the source newer than the mirror's newest."""
    seconds_behind: float | None = None
    """How much older the mirror's newest commit is than the source's (None: unknown)."""

    @property
    def copied_bytes(self) -> int:
        """Bytes copied over every step."""
        return sum(step.copied_bytes for step in self.copied)

    def to_event(self) -> dict[str, Any]:
        """The ``mirror`` event of the job's event log (`spotckpt.goodput`): the mirror (its URI
        without credentials), the newest step copied, what the copies moved (the source's
        egress), the lag after them and how many steps failed."""
        moved = [step for step in self.copied if not step.already]
        return {
            "kind": "mirror",
            "mirror": redact(self.target),
            "step": max((step.step for step in moved), default=None),
            "bytes": self.copied_bytes,
            "objects": sum(step.copied_objects for step in moved),
            "mirror_s": round(sum(step.seconds for step in moved), 6),
            "steps_behind": self.steps_behind,
            "seconds_behind": self.seconds_behind,
            "failed_steps": len(self.failed),
        }

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``spotckpt mirror --json``)."""
        return {
            "source": self.source,
            "target": self.target,
            "copied": [asdict(step) for step in self.copied],
            "failed": {str(step): why for step, why in self.failed.items()},
            "retired": self.retired,
            "copied_bytes": self.copied_bytes,
            "steps_behind": self.steps_behind,
            "seconds_behind": self.seconds_behind,
        }


class Mirror:
    """Copies committed steps of `source` to `target` (see the module docstring).

    `copies` objects go at once, each streamed in pieces of `piece_bytes`; a `limit` shared by
    every copy caps the bytes per second, and while `pause` holds (a preemption notice: the
    emergency save comes first) no piece is read. `progress` sees ``(bytes done, bytes to copy)``
    of the step being copied.
    """

    def __init__(
        self,
        source: Catalog,
        target: Catalog,
        *,
        copies: int = DEFAULT_COPIES,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        limit: BandwidthLimit | None = None,
        pause: Pause | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        if copies < 1:
            raise InvalidArgumentError(f"a mirror copies at least 1 object at once, got {copies}")
        self.source = source
        self.target = target
        self.copies = copies
        self.piece_bytes = piece_bytes
        self.limit = limit
        self.pause = pause
        self.progress = progress
        self._done = 0
        self._total = 0
        self._lock = threading.Lock()
        self._ours = False  # the mirror was found to carry the source's job identity
        self._same_save: dict[int, tuple[int, datetime | None]] = {}
        """Steps found to be one save at both roots, by the source manifest's size and time
        then: read again only when those change (an overwrite at the source)."""

    # One step ---------------------------------------------------------------------------------

    def copy_step(self, step: int) -> StepCopy:
        """Copy committed `step` to the mirror and commit it there; a step the mirror holds
        already (the same manifest bytes) is left as it is. Raises what reading the source's
        step raises (NoCheckpointError, ManifestError, SignatureError), CorruptCheckpointError
        when an object's bytes are not the manifest's, MirrorConflictError when the mirror
        holds another commit of the step or belongs to another job, StorageError."""
        started = time.monotonic()
        data = self.source.manifest_bytes(step)
        if self.target.is_committed(step):
            return self._already(step, data)
        needed = self.source.stored_objects(step, data)
        self._same_job()
        self.target.check_signed(data, step)  # the mirror's keys must accept what it commits
        copied, present, server_side = self._copy_objects(needed)
        if self.pause is not None and self.pause.stopped:  # the last call may still commit
            raise MirrorStoppedError(f"mirror copy of step {step} stopped before its commit")
        folder = f"{step_folder(step)}/"
        attempt = self.source.committed_attempt(step, data) or ""
        self.target.commit_bytes(
            step,
            attempt,
            data,
            {_relative(key, folder): expected.size for key, expected in needed.items()},
        )
        return StepCopy(
            step,
            copied_objects=len(copied),
            copied_bytes=sum(needed[key].size for key in copied),
            present_objects=len(present),
            server_side_objects=server_side,
            seconds=time.monotonic() - started,
        )

    def _already(self, step: int, data: bytes) -> StepCopy:
        if self.target.manifest_bytes(step) != data:
            raise MirrorConflictError(
                f"step {step} is committed at {self.target.uri} with another manifest than at "
                f"{self.source.uri}: a committed step is never overwritten (two jobs, or a job "
                "that went on at the mirror; mirror into a fresh root)"
            )
        return StepCopy(step, already=True)

    def _copy_objects(self, needed: dict[str, Expected]) -> tuple[list[str], list[str], int]:
        """Copy what the mirror lacks of `needed`: the keys copied, those already there, and how
        many the provider copied server-side."""
        present, missing = [], []
        found = self._found(needed)
        trusted = self._trusted([key for key, info in found.items() if info is not None])
        for key, info in found.items():
            expected = needed[key]
            if info is None:
                missing.append(key)
            elif info.size == expected.size and (key in trusted or self._sound(key, expected)):
                present.append(key)
            elif info.size == expected.size:  # an unchecked copy that differs: not this step's
                self.target.store.delete_many([key])
                missing.append(key)
            else:
                raise CorruptCheckpointError(
                    f"{self.target.uri}/{key} has {info.size} bytes, the manifest at "
                    f"{self.source.uri} says {expected.size}; it was not written by a mirror "
                    "copy: delete it, or mirror into a fresh root"
                )
        with self._lock:
            self._done, self._total = 0, sum(needed[key].size for key in missing)
        self._report()
        if missing:
            with ThreadPoolExecutor(min(self.copies, len(missing))) as pool:
                futures = [pool.submit(self._copy_one, key, needed[key]) for key in missing]
                done, pending = wait(futures, return_when=FIRST_EXCEPTION)
                for future in pending:
                    future.cancel()
                for future in done:
                    future.result()  # the first failure, raised here with its own traceback
                server_side = sum(1 for future in futures if future.result())
        return missing, present, server_side if missing else 0

    def _trusted(self, keys: list[str]) -> set[str]:
        """Of `keys` found at the mirror, those in the attempt folder of a step committed there:
        checked before that commit. Others (left by a copy that died between a server-side
        copy and its check, or written by something else) are checked before they are kept."""
        committed: dict[int, str | None] = {}
        trusted = set()
        for key in keys:
            folder, _slash, rest = key.partition("/")
            step = parse_step_folder(folder)
            if step is None:
                continue
            if step not in committed:
                attempt = self.target.committed_attempt(step)
                committed[step] = attempt_folder(attempt) if attempt else None
            if committed[step] is not None and rest.partition("/")[0] == committed[step]:
                trusted.add(key)
        return trusted

    def _sound(self, key: str, expected: Expected) -> bool:
        """Whether the object at `key` of the mirror holds the bytes `expected` says."""
        try:
            check_object(self.target.store, key, expected, self.piece_bytes, self._before_piece)
        except CorruptCheckpointError as error:
            log.warning("%s: %s; copied again", self.target.uri, error)
            return False
        return True

    def _found(self, needed: dict[str, Expected]) -> dict[str, ObjectInfo | None]:
        """What the mirror holds at each key of `needed` (HEADs, `HEADS` at a time)."""
        keys = sorted(needed)
        with ThreadPoolExecutor(max(1, min(HEADS, len(keys)))) as pool:
            return dict(zip(keys, pool.map(self.target.store.head, keys), strict=True))

    def _copy_one(self, key: str, expected: Expected) -> bool:
        """Copy one object; whether the provider copied it server-side."""
        try:
            copied = copy_object(
                self.source.store,
                key,
                self.target.store,
                key,
                create_only=True,
                expected=expected,
                piece_bytes=self.piece_bytes,
                on_piece=self._before_piece,
            )
        except AlreadyExistsError:  # another copy won the race, or a retry found its own copy
            info = self.target.store.head(key)
            if info is None or info.size != expected.size or not self._sound(key, expected):
                raise
            return False
        return copied.server_side

    def _before_piece(self, count: int) -> None:
        if self.pause is not None:
            self.pause.wait_running()
        if self.limit is not None:
            self.limit.take(count, self.pause.wait_running if self.pause is not None else None)
        with self._lock:
            self._done += count
        self._report()

    def _report(self) -> None:
        if self.progress is not None:
            with self._lock:
                done, total = self._done, self._total
            self.progress(done, total)

    # Many steps -------------------------------------------------------------------------------

    def catch_up(
        self, steps: Iterable[int] | None = None, *, keep_last: int | None = None
    ) -> MirrorReport:
        """Copy `steps` (by default the source's committed steps that the mirror lacks; with
        `keep_last`, of the source's newest that many), oldest first; a step that fails
        is reported in `MirrorReport.failed` and the next one is tried. Then, with `keep_last`,
        the mirror keeps its newest `keep_last` readable steps (the retention rule: objects a
        kept step references stay). MirrorConflictError for a mirror of another job."""
        report = MirrorReport(self.source.uri, self.target.uri)
        ours = self._same_job()  # before anything is copied or retired there
        if steps is None:
            window, theirs = self._window(keep_last)
            wanted = [step for step in window if step not in theirs]
            for step, why in self._saved_again([s for s in window if s in theirs]).items():
                log.warning("step %d at %s: %s", step, self.target.uri, why)
                report.failed[step] = f"MirrorConflictError: {why}"
        else:
            wanted = sorted(set(steps))
        for step in wanted:
            try:
                report.copied.append(self.copy_step(step))
            except (MirrorConflictError, MirrorStoppedError):
                raise
            except CheckpointError as error:
                log.warning("step %d was not mirrored to %s: %s", step, self.target.uri, error)
                report.failed[step] = f"{type(error).__name__}: {error}"
        if keep_last is not None and ours:
            report.retired = self.target.retire(keep_last)
        report.steps_behind, report.seconds_behind = self.lag()
        return report

    def plan(
        self, steps: Iterable[int] | None = None, *, keep_last: int | None = None
    ) -> MirrorPlan:
        """What `catch_up` with the same arguments would copy, without copying: the steps, and
        the objects and bytes the mirror lacks (each counted once, though several steps
        reference it); a step whose manifest does not read is left out (`catch_up` reports
        it). The bytes are what the copy moves out of the source's region: its egress."""
        if steps is None:
            window, theirs = self._window(keep_last)
            wanted = [step for step in window if step not in theirs]
        else:
            wanted = sorted(set(steps))
        needed: dict[str, Expected] = {}
        planned = []
        for step in wanted:
            try:
                needed.update(self.source.stored_objects(step, self.source.manifest_bytes(step)))
            except CheckpointError as error:
                log.warning("step %d cannot be mirrored from %s: %s", step, self.source.uri, error)
                continue
            planned.append(step)
        missing = [key for key, info in self._found(needed).items() if info is None]
        return MirrorPlan(planned, len(missing), sum(needed[key].size for key in missing))

    def _same_job(self) -> bool:
        """Give the mirror the source's job identity (create-only; MirrorConflictError when it
        belongs to another job); whether the mirror is known to be this job's, so that its
        retention may run: never on a root whose job is not the source's."""
        if self._ours:  # job.json is create-only: once the same, it stays the same
            return True
        identity = self.source.job()
        if identity is None:  # an older root: only a mirror without an identity either
            return self.target.job() is None
        self.target.adopt_job(identity)
        self._ours = True
        return True

    def _window(self, keep_last: int | None) -> tuple[list[int], set[int]]:
        """The source's committed steps of its newest `keep_last` (the only ones the mirror's
        retention keeps; all without), and the mirror's: one listing of each root. Those of
        the window the mirror lacks are copied, so that a step that failed before a newer one
        was copied is tried again."""
        ours = self.source.steps()
        window = ours[-keep_last:] if keep_last is not None and keep_last > 0 else ours
        return window, set(self.target.steps())

    def _saved_again(self, both: list[int]) -> dict[int, str]:
        """Of the newest `RESAVE_CHECK_STEPS` of `both` (steps both roots hold), those the
        source committed again (another attempt: ``dcp_writer(overwrite=True)``) after they
        were mirrored, and why that is a conflict. A mirror never overwrites a committed step;
        a restore reads the source's save while the source can be read (`spotckpt.restore`)."""
        conflicts = {}
        for step in both[-RESAVE_CHECK_STEPS:]:
            info = self.source.store.head(manifest_key(step))
            if info is None:
                continue
            mark = (info.size, info.last_modified)
            if self._same_save.get(step) == mark:
                continue
            saved, held = self.source.committed_attempt(step), self.target.committed_attempt(step)
            if saved is None or held is None:
                continue  # a manifest that does not parse here: restores and verify tell
            if saved == held:
                self._same_save[step] = mark
                continue
            conflicts[step] = (
                f"step {step} was saved again at {self.source.uri} after it was mirrored (a "
                "save with overwrite): the mirror keeps the save it holds, which a restore reads "
                "only while the source cannot be read; mirror into a fresh root to copy the "
                "new one"
            )
        return conflicts

    def lag(self) -> tuple[int, float | None]:
        """Steps of the source newer than the mirror's newest, and how much older (seconds, by
        the stores' commit times; None when unknown) the mirror's newest commit is."""
        ours = self.source.steps()
        newest = self.target.latest()
        behind = [s for s in ours if newest is None or s > newest]
        if not behind:
            return 0, 0.0
        if newest is None:
            return len(behind), None
        source_time = self.source.store.head(manifest_key(ours[-1]))
        target_time = self.target.store.head(manifest_key(newest))
        if source_time is None or target_time is None:
            return len(behind), None
        if source_time.last_modified is None or target_time.last_modified is None:
            return len(behind), None
        seconds = (source_time.last_modified - target_time.last_modified).total_seconds()
        return len(behind), max(0.0, seconds)


def _relative(key: str, folder: str) -> str:
    """A key relative to the root as the step folder `folder` (``step-N/``) names it: its own
    objects without the folder, earlier steps' (references) as they are."""
    return key[len(folder) :] if key.startswith(folder) else key


class MirrorFollower:
    """Copies what a job commits to each of its mirrors, in one background thread: at start
    (what an earlier run left uncopied, after a notice stopped it) and after each commit
    (`committed`) every mirror catches up (`Mirror.catch_up`: of the newest steps its own
    `keep_last` keeps, those it lacks, then its retention), so steps committed faster than they
    copy are skipped, never queued without bound. A mirror that fails (unreachable, refused) is
    a warning, and is tried again after the next commit; `errors` holds the last failure of
    each mirror.

    `wait` blocks until every commit seen so far is mirrored (or `timeout` passes); `close`
    stops the thread after the copies in flight, at most `wait_s` later (unless stopped by its
    `Pause`, which ends them at once). What is left is copied by the next run.
    """

    def __init__(
        self,
        mirrors: list[Mirror],
        *,
        keep_last: list[int | None],
        wait_s: float,
        pause: Pause,
        on_report: Callable[[MirrorReport], None] | None = None,
    ) -> None:
        self.mirrors = mirrors
        self.on_report = on_report
        """Sees each catch-up that copied or failed something (in the mirror thread)."""
        self.keep_last = keep_last
        self.wait_s = wait_s
        self.pause = pause
        self.errors: dict[str, str] = {}
        self.reports: dict[str, MirrorReport] = {}
        self._lock = threading.Condition()
        self._asked = 1  # commits seen, and the catch-up at start (what an earlier run left)
        self._done = 0  # commits whose catch-up has finished
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="spotckpt-mirrors", daemon=True)
        self._thread.start()

    def committed(self, step: int) -> None:
        """The job committed `step`: bring every mirror up to date."""
        with self._lock:
            self._asked += 1
            self._lock.notify_all()
        log.debug("step %d committed: mirroring to %d mirrors", step, len(self.mirrors))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every commit seen so far is mirrored; False if `timeout` passed first
        or the copies were stopped (they end at their next piece: nothing to wait for)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            asked = self._asked
            while self._done < asked and self._thread.is_alive():
                if self.pause.stopped:
                    return False
                left = STOP_CHECK_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, STOP_CHECK_S))
            return self._done >= asked and not self.pause.stopped

    def close(self) -> None:
        """Stop after the copies in flight (at most `wait_s`; at once when stopped)."""
        if not self.wait(self.wait_s) and not self.pause.stopped:
            log.warning(
                "mirror copies still running after %.0f s at close: left for the next run "
                "(a mirror never shows a step whose copy did not finish)",
                self.wait_s,
            )
        self.pause.stop()  # what still runs ends at its next piece, uncommitted
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join(CLOSE_JOIN_S)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closing or self._asked > self._done)
                if self._closing:
                    return
                asked = self._asked
            try:
                for mirror, keep_last in zip(self.mirrors, self.keep_last, strict=True):
                    self._catch_up(mirror, keep_last)
            except MirrorStoppedError:
                log.info("mirror copies stopped; the next run resumes them")
                with self._lock:
                    self._done = self._asked
                    self._lock.notify_all()
                return
            with self._lock:
                self._done = asked
                self._lock.notify_all()

    def _catch_up(self, mirror: Mirror, keep_last: int | None) -> None:
        uri = mirror.target.uri
        try:
            report = mirror.catch_up(keep_last=keep_last)
        except MirrorStoppedError:
            raise
        except CheckpointError as error:  # the job goes on; the next commit tries again
            self.errors[uri] = f"{type(error).__name__}: {error}"
            log.warning("mirroring to %s failed: %s", uri, error)
            return
        except Exception as error:  # a bug or an unexpected failure: loud, and tried again
            self.errors[uri] = f"{type(error).__name__}: {error}"
            log.exception("mirroring to %s failed unexpectedly", uri)
            return
        self.reports[uri] = report
        if self.on_report is not None and (report.copied_bytes or report.failed):
            self.on_report(report)
        if report.failed:
            self.errors[uri] = "; ".join(report.failed.values())
        else:
            self.errors.pop(uri, None)
        for copied in report.copied:
            if not copied.already:
                log.info(
                    "step %d mirrored to %s: %d objects, %d bytes in %.2f s",
                    copied.step,
                    uri,
                    copied.copied_objects,
                    copied.copied_bytes,
                    copied.seconds,
                )


def open_mirrors(settings: Settings, store: ObjectStore, keyring: Keyring | None) -> list[Catalog]:
    """The catalogs of the `mirrors` of `settings`, each opened with its own storage options and
    read under `keyring` (every rank opens them: a restore may read a step from a mirror);
    ConfigError when one is the job's own root `store`."""
    opened = [open_store(t.uri, **dict(t.storage_options)) for t in parse_mirrors(settings.mirrors)]
    if any(mirror.uri.rstrip("/") == store.uri.rstrip("/") for mirror in opened):
        for mirror in opened:
            mirror.close()
        raise ConfigError("mirrors: names the job's own root; a mirror is another root")
    return [Catalog(mirror, keyring) for mirror in opened]


def nearest_copy(settings: Settings, store: ObjectStore, mirrors: list[Catalog]) -> int | None:
    """The index among the job's root (0) and its `mirrors` (1 on) of the copy the
    `nearest_copy` setting names; None without one. ConfigError when it names none of them."""
    if settings.nearest_copy is None:
        return None
    named = open_store(settings.nearest_copy)  # only to spell its URI as the stores do
    try:
        wanted = named.uri.rstrip("/")
    finally:
        named.close()
    uris = [store.uri.rstrip("/")] + [mirror.uri.rstrip("/") for mirror in mirrors]
    if wanted not in uris:
        raise ConfigError(
            f"nearest_copy: {redact(settings.nearest_copy)} is neither the job's root nor one of "
            "its mirrors"
        )
    return uris.index(wanted)


def follow_mirrors(
    settings: Settings,
    store: ObjectStore,
    mirrors: list[Catalog],
    keyring: Keyring | None,
    stop_when: Callable[[], bool],
    on_report: Callable[[MirrorReport], None] | None = None,
) -> MirrorFollower:
    """The coordinator's `MirrorFollower` from the job's root `store` to `mirrors` (each read
    and written through a catalog of the follower's own, which its thread alone uses), one
    `mirror_bandwidth` cap shared by all, and copies stopped for good once `stop_when` (a
    preemption notice) says so."""
    limit = BandwidthLimit(settings.mirror_bandwidth) if settings.mirror_bandwidth else None
    pause = Pause(stop_when)
    copies = [
        Mirror(Catalog(store, keyring), Catalog(mirror.store, keyring), limit=limit, pause=pause)
        for mirror in mirrors
    ]
    targets = parse_mirrors(settings.mirrors)  # the same order as `open_mirrors`
    return MirrorFollower(
        copies,
        keep_last=[target.retention(settings.keep_last) for target in targets],
        wait_s=settings.mirror_wait_s,
        pause=pause,
        on_report=on_report,
    )
