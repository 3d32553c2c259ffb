"""`PreemptionWatcher`: notices that this machine is about to go away.

The watcher records the first notice and knows nothing of where notices come from:
- signals (`SignalHandlers`: SIGTERM from Kubernetes, torchrun and GCE's ACPI soft-off; SIGUSR1
  from SLURM), installed from the main thread: a handler only records the notice;
- polled sources (`NoticeSource`): the built-in clouds' (`clouds.cloud_sources`: AWS's spot
  instance-action notice, GCE's ``instance/preempted``) and any passed in, each polled in its own
  daemon thread by a `Poller`, which retries failures with back-off and switches a source off
  when nobody is at its address (see `spotckpt.preemption.source`).
The training loop acts on the notice at its next `CheckpointManager.maybe_save`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from spotckpt.errors import InvalidArgumentError
from spotckpt.preemption.clouds import cloud_sources
from spotckpt.preemption.signals import DEFAULT_SIGNALS, SignalHandlers
from spotckpt.preemption.source import Backoff, Notice, NoticeSource, Poller

SIGNAL_WINDOW = "save_budget_s"
"""The name of the window a signal's notice gives (the `save_budget_s` setting)."""


@dataclass(frozen=True)
class NoticeWindow:
    """The time from a notice to the end: `source` is ``save_budget_s`` (a signal) or the
    name of a polled notice source (``AWS``, ``GCE``, ``Azure``)."""

    seconds: float
    source: str

    def named(self) -> str:
        """``save_budget_s (25 s)`` or ``the GCE notice (30 s)``, for messages."""
        if self.source == SIGNAL_WINDOW:
            return f"{SIGNAL_WINDOW} ({self.seconds:g} s)"
        return f"the {self.source} notice ({self.seconds:g} s)"


class PreemptionWatcher:
    """Records the first preemption notice from signals, cloud metadata services or `sources`.

    `signal_budget_s` is the time assumed available after a signal (torchrun and Kubernetes give
    30 s by default); the cloud notices carry their own deadline. `aws`/`gce`/`azure` default
    to automatic detection (see `clouds.cloud_sources`). `poll_interval_s` is the pause between
    AWS and Azure polls and the length of one GCE long poll; failed tries are retried after a
    back-off that doubles from `backoff_initial_s` up to `backoff_max_s`. `sources` are polled
    beside the built-in clouds: a cloud of one's own is one `NoticeSource` class, the watcher
    unchanged. A source may say the shortest notice it gives as ``window_s`` (`window`) and an
    early warning without a deadline as ``hint`` (`hint`).
    """

    def __init__(
        self,
        *,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        aws: bool | None = None,
        gce: bool | None = None,
        azure: bool | None = None,
        poll_interval_s: float = 5.0,
        signal_budget_s: float = 25.0,
        request_timeout_s: float = 1.0,
        aws_rebalance: bool = False,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 4.0,
        sources: Iterable[NoticeSource] = (),
    ) -> None:
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise InvalidArgumentError(
                "PreemptionWatcher needs 0 < backoff_initial_s <= backoff_max_s"
            )
        self.request_timeout_s = request_timeout_s
        self.backoff = Backoff(backoff_initial_s, backoff_max_s)
        self.sources: tuple[NoticeSource, ...] = (
            *cloud_sources(
                aws=aws,
                gce=gce,
                azure=azure,
                aws_rebalance=aws_rebalance,
                poll_interval_s=poll_interval_s,
                request_timeout_s=request_timeout_s,
            ),
            *sources,
        )
        self._signals = SignalHandlers(signals, signal_budget_s, self._record)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._notice: Notice | None = None
        self._off: set[str] = set()  # names of sources found absent: no notice will come from them

    # Public state ---------------------------------------------------------------------------

    @property
    def preempted(self) -> bool:
        """Whether a notice arrived."""
        return self._notice is not None

    @property
    def deadline(self) -> float | None:
        """`time.monotonic()` by which the emergency save must be done, or None if unknown."""
        notice = self._notice
        return notice.deadline if notice is not None else None

    @property
    def reason(self) -> str | None:
        """What raised the notice: ``SIGTERM``, ``aws:terminate``, ``gce``, ``manual``, ..."""
        notice = self._notice
        return notice.reason if notice is not None else None

    def window(self) -> NoticeWindow:
        """The shortest notice this machine can get: `signal_budget_s` after a signal (always
        watched), or a polled source's own window (AWS 120 s, GCE and Azure 30 s) while that
        source has not been found absent."""
        windows = [NoticeWindow(self._signals.budget_s, SIGNAL_WINDOW)]
        for source in self.sources:
            seconds = getattr(source, "window_s", None)
            if isinstance(seconds, (int, float)) and source.name not in self._off:
                windows.append(NoticeWindow(float(seconds), source.name))
        return min(windows, key=lambda window: window.seconds)

    @property
    def hint(self) -> str | None:
        """An early warning without a deadline (``aws:rebalance``), once a source gave one."""
        for source in self.sources:
            hint = getattr(source, "hint", None)
            if isinstance(hint, str):
                return hint
        return None

    def trigger(self, reason: str = "manual", deadline: float | None = None) -> None:
        """Record a notice (for tests and custom schedulers); the first notice wins."""
        self._notify(Notice(reason, deadline))

    def _notify(self, notice: Notice) -> None:
        """Record a notice from any thread; the first notice wins."""
        with self._lock:
            self._record(notice)

    def _record(self, notice: Notice) -> None:
        """Record a notice without a lock, as a signal handler must; the first notice wins."""
        if self._notice is None:
            self._notice = notice

    # Lifecycle ------------------------------------------------------------------------------

    def start(self) -> PreemptionWatcher:
        """Install signal handlers (from the main thread only) and start polling the sources."""
        self._signals.install()
        for source in self.sources:
            thread = threading.Thread(
                target=self._poll,
                args=(source,),
                name=f"spotckpt-{source.name.lower()}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Restore the previous signal handlers and stop polling."""
        self._stopping.set()
        self._signals.uninstall()
        for thread in self._threads:
            thread.join(timeout=self.request_timeout_s + 1)
        self._threads.clear()

    def _poll(self, source: NoticeSource) -> None:
        """A source's thread: poll until a notice arrives, the watcher stops or the source is
        off; it never dies of an error (`Poller`)."""
        poller = Poller(source, self.backoff)
        while not self._stopping.is_set() and not self.preempted:
            outcome = poller.poll()
            if outcome is None:
                self._off.add(source.name)
                return
            if isinstance(outcome, Notice):
                self._notify(outcome)
            else:
                self._stopping.wait(outcome)
