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
from typing import Any

from spotckpt.catalog import Catalog
from spotckpt.errors import (
    AlreadyExistsError,
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MirrorConflictError,
)
from spotckpt.layout import manifest_key, step_folder
from spotckpt.storage.copying import DEFAULT_PIECE_BYTES, Expected, copy_object

log = logging.getLogger("spotckpt")

DEFAULT_COPIES = 4
"""Objects copied at once."""


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

    def take(self, count: int) -> None:
        """Wait until `count` bytes may go (more than a second's worth waits for a second's)."""
        wanted = min(float(count), self.bytes_per_s)
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


class Pause:
    """Holds every mirror copy between two pieces while a preemption notice's emergency save
    runs: the save gets the bandwidth, the mirror catches up after the restart."""

    def __init__(self) -> None:
        self._running = threading.Event()
        self._running.set()

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

    def wait_running(self) -> None:
        """Return once copies may go on."""
        self._running.wait()


@dataclass(frozen=True)
class StepCopy:
    """What copying one step did: objects and bytes copied, objects found already there."""

    step: int
    copied_objects: int = 0
    copied_bytes: int = 0
    present_objects: int = 0
    seconds: float = 0.0
    already: bool = False
    """The mirror held the step already (the same manifest bytes): nothing was copied."""


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
        identity = self.source.job()
        if identity is not None:  # an older root without one has nothing to carry
            self.target.adopt_job(identity)
        self.target.check_signed(data, step)  # the mirror's keys must accept what it commits
        copied, present = self._copy_objects(needed)
        folder = f"{step_folder(step)}/"
        attempt = self.source.committed_attempt(step) or ""
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

    def _copy_objects(self, needed: dict[str, Expected]) -> tuple[list[str], list[str]]:
        """Copy what the mirror lacks of `needed`: the keys copied, and those already there."""
        present, missing = [], []
        for key, expected in sorted(needed.items()):
            info = self.target.store.head(key)
            if info is None:
                missing.append(key)
            elif info.size == expected.size:
                present.append(key)
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
        return missing, present

    def _copy_one(self, key: str, expected: Expected) -> None:
        try:
            copy_object(
                self.source.store,
                key,
                self.target.store,
                key,
                create_only=True,
                expected=expected,
                piece_bytes=self.piece_bytes,
                on_piece=self._before_piece,
            )
        except AlreadyExistsError:  # another copy of this step won the race: it checked its own
            info = self.target.store.head(key)
            if info is None or info.size != expected.size:
                raise

    def _before_piece(self, count: int) -> None:
        if self.pause is not None:
            self.pause.wait_running()
        if self.limit is not None:
            self.limit.take(count)
        with self._lock:
            self._done += count
        self._report()

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self._done, self._total)

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
        wanted = sorted(set(steps)) if steps is not None else self._missing(keep_last)
        for step in wanted:
            try:
                report.copied.append(self.copy_step(step))
            except MirrorConflictError:
                raise
            except CheckpointError as error:
                log.warning("step %d was not mirrored to %s: %s", step, self.target.uri, error)
                report.failed[step] = f"{type(error).__name__}: {error}"
        if keep_last is not None:
            report.retired = self.target.retire(keep_last)
        report.steps_behind, report.seconds_behind = self.lag()
        return report

    def _missing(self, keep_last: int | None) -> list[int]:
        """The source's committed steps the mirror lacks (of its newest `keep_last`, the only
        ones the mirror's retention keeps), so that a step that failed before a newer one was
        copied is tried again."""
        ours = self.source.steps()
        window = ours[-keep_last:] if keep_last is not None and keep_last > 0 else ours
        theirs = set(self.target.steps())
        return [step for step in window if step not in theirs]

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
