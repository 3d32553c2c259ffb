"""`Cancellation`: a save's upload stopped from outside, between two of its writes.

At a preemption notice the plan (`spotckpt.deadline.in_flight_allowance`) may leave an upload in
flight no more time: the training thread then sets its writer's `Cancellation`, and the upload
raises `SaveCancelledError` at its next write (`CancellableWriter`), which aborts the object and
fails the save on every rank (DCP gathers each rank's failure) before its commit point; nothing of
it becomes visible. An upload that already wrote all its bytes still commits: its commit is one
small write, cheaper than what cancelling it would save.

An upload process (``async_mode="process"``) gets a copy that is never set: it cannot be reached
from the training process, so its upload runs to its end.
"""

from __future__ import annotations

import threading

from spotckpt.errors import SaveCancelledError
from spotckpt.storage import ObjectInfo
from spotckpt.storage.base import ObjectWriter, WriterBase


class Cancellation:
    """Set once, by whoever decides the save has no time left; checked by the upload."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._why = ""

    def cancel(self, why: str) -> None:
        """Stop the upload at its next write; `why` goes into its error."""
        self._why = why
        self._set.set()

    @property
    def cancelled(self) -> bool:
        """Whether `cancel` was called."""
        return self._set.is_set()

    def check(self, step: int) -> None:
        """Raise `SaveCancelledError` once cancelled."""
        if self._set.is_set():
            raise SaveCancelledError(
                f"upload of step {step} cancelled: {self._why}; nothing of it was committed"
            )

    def __reduce__(self) -> tuple[type[Cancellation], tuple[()]]:
        return (Cancellation, ())  # an upload process's copy: never set (see the module)


class CancellableWriter(WriterBase):
    """An `ObjectWriter` that checks `cancellation` before each write of a step's object."""

    def __init__(self, inner: ObjectWriter, cancellation: Cancellation, step: int) -> None:
        self.inner = inner
        self.cancellation = cancellation
        self.step = step

    @property
    def bytes_written(self) -> int:
        """What the store's writer took so far."""
        return self.inner.bytes_written

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write on, unless the save was cancelled."""
        self.cancellation.check(self.step)
        self.inner.write(data)

    def commit(self) -> ObjectInfo:
        """Make the object visible (all its bytes were written: not cancelled any more)."""
        return self.inner.commit()

    def abort(self) -> None:
        """Drop what was written (the store's multipart upload is aborted)."""
        self.inner.abort()
