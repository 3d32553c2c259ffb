"""Adapting to a server that throttles: AIMD on the requests in flight, patient retries.

An object store that is asked too fast answers ``503 SlowDown`` (S3) or ``429`` (GCS). Retrying
each request on its own with back-off is not enough when many writers share a prefix: they all
keep their full concurrency and keep the prefix over its rate. `Throttle` is one store's gate:

- every request holds a slot while it runs; at most ``limit`` run at once;
- a throttled answer halves the limit (at most once per `DECREASE_INTERVAL_S`, so that one burst
  of refusals counts once), never below 1; each success raises it by ``1 / limit`` (about one
  per round of ``limit`` requests), never above the store's ``max_concurrency``;
- a throttled request is tried again after a jittered exponential wait, as often as its
  operation's deadline allows: throttling says "later", not "never", so it does not spend the
  retry policy's attempts, which are for failures.

The time requests spent waiting for a slot below the full limit or backing off from a throttled
answer is counted (`ThrottleStats`): the time lost to throttling.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from spotckpt.storage.retry import Deadline

T = TypeVar("T")
DECREASE_INTERVAL_S = 0.1


@dataclass(frozen=True)
class ThrottleStats:
    """What throttling cost a store so far."""

    throttled: int
    """Answers that said the store was asked too fast."""
    waited_s: float
    """Seconds requests spent backing off or waiting for a slot below the full limit (summed
    over requests: concurrent waits add up)."""
    limit: float
    """The concurrency limit now."""


class Throttle:
    """One store's concurrency gate; see the module docstring."""

    def __init__(
        self, max_concurrency: int, initial_backoff_s: float = 0.05, max_backoff_s: float = 2.0
    ) -> None:
        self.ceiling = float(max_concurrency)
        self.limit = float(max_concurrency)
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.in_flight = 0
        self.throttled = 0
        self.waited_s = 0.0
        self.decreased_at = 0.0
        self.condition = threading.Condition()
        self.random = random.Random()

    def stats(self) -> ThrottleStats:
        """The counts so far."""
        with self.condition:
            return ThrottleStats(self.throttled, self.waited_s, self.limit)

    def run(
        self, fn: Callable[[], T], is_throttle: Callable[[BaseException], bool], deadline: Deadline
    ) -> T:
        """`fn` under the gate, tried again after each throttled answer until `deadline` would
        pass during the wait (then the last answer is raised)."""
        tries = 0
        while True:
            self._acquire()
            try:
                result = fn()
            except BaseException as error:
                throttled = is_throttle(error)
                self._release(throttled)
                if not throttled:
                    raise
                wait = self.random.uniform(
                    0, min(self.max_backoff_s, self.initial_backoff_s * 2**tries)
                )
                if wait >= deadline.remaining():
                    raise
                tries += 1
                time.sleep(wait)
                with self.condition:
                    self.waited_s += wait
                continue
            self._release(False)
            return result

    def _acquire(self) -> None:
        with self.condition:
            if self.in_flight < int(self.limit):
                self.in_flight += 1
                return
            started = time.monotonic()
            self.condition.wait_for(lambda: self.in_flight < int(self.limit))
            self.in_flight += 1
            if self.limit < self.ceiling:
                self.waited_s += time.monotonic() - started

    def _release(self, throttled: bool) -> None:
        with self.condition:
            self.in_flight -= 1
            if throttled:
                self.throttled += 1
                now = time.monotonic()
                if now - self.decreased_at >= DECREASE_INTERVAL_S:
                    self.decreased_at = now
                    self.limit = max(1.0, self.limit / 2)
            else:
                self.limit = min(self.ceiling, self.limit + 1 / self.limit)
            self.condition.notify_all()
