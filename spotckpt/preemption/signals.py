"""Signals as preemption notices: SIGTERM (Kubernetes, torchrun, GCE's ACPI soft-off) and
SIGUSR1 (SLURM).

Unlike a `NoticeSource`, signals are installed, not polled: Python runs a handler in the main
thread between two bytecodes of whatever it was doing, so the handler only records the notice
(no lock, no log: the code it interrupted may hold them) and chains the Python handler that was
there before. Only the main thread can install or restore handlers.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from spotckpt.preemption.source import Notice, log

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

SignalHandler = Callable[[int, FrameType | None], Any] | int | None
"""What `signal.signal` hands back: a Python handler, SIG_DFL or SIG_IGN, or None."""


class SignalHandlers:
    """Handlers that turn `signals` into notices for `record`, which must take no lock; the
    deadline is `budget_s` from the signal (torchrun and Kubernetes give 30 s by default)."""

    def __init__(
        self, signals: Iterable[int], budget_s: float, record: Callable[[Notice], None]
    ) -> None:
        self.signals = tuple(signals)
        self.budget_s = budget_s
        self._record = record
        self._previous: dict[int, SignalHandler] = {}

    def install(self) -> None:
        """Handle the signals from now on; off the main thread, which cannot, only warn."""
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        elif self.signals:
            log.warning("PreemptionWatcher started off the main thread: signals are not watched")

    def uninstall(self) -> None:
        """Put the previous handlers back (from the main thread only)."""
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A signal handler must not take locks or log: it may interrupt code holding them.
        self._record(Notice(signal.Signals(signum).name, time.monotonic() + self.budget_s))
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
