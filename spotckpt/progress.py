"""Progress of a long save or restore, logged at INFO from a timer thread.

The transfer itself only adds to its byte counters; a `ProgressLog` thread reads them every
`interval_s` seconds and logs one line (``saving step 12: 96.0 MiB of 256.0 MiB (37%),
31.9 MiB/s, 5 s left``), so a transfer shorter than the interval logs nothing and no chunk
pays for formatting. The rate is the average since the start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from spotckpt.units import human_duration, human_rate, human_size

log = logging.getLogger("spotckpt")

Sample = Callable[[], tuple[int, int]]
"""Bytes done and bytes in all so far (0 while the total is not known yet)."""


class ProgressLog:
    """A context around one transfer: logs its progress every `interval_s` (None: never)
    until the block ends or the transfer reaches its total (an upload handed to the
    background may be collected much later)."""

    def __init__(self, what: str, sample: Sample, interval_s: float | None) -> None:
        self.what = what
        self.sample = sample
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def start(self) -> ProgressLog:
        """Start the timer thread (a daemon: it never keeps a process alive)."""
        if self.interval_s is not None and self._thread is None:
            self._started = time.monotonic()
            self._thread = threading.Thread(
                target=self._run, args=(self.interval_s,), name="spotckpt-progress", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop logging; returns once the thread is gone."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> ProgressLog:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def line(self, done: int, total: int) -> str:
        """The progress line for `done` of `total` (> 0) bytes at this moment."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = done / elapsed
        left = f"{human_duration((total - done) / rate)} left" if rate > 0 else "starting"
        return (
            f"{self.what}: {human_size(done)} of {human_size(total)} "
            f"({100 * done // total}%), {human_rate(rate)}, {left}"
        )

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            done, total = self.sample()
            if total <= 0:
                continue
            if done >= total:
                return
            log.info("%s", self.line(done, total))
