"""Retry policies as values: jittered exponential back-off with an attempt cap and a total deadline.

A store holds one `RetryPolicy` and a predicate that says which of its errors are transient
(throttling, 5xx, timeouts, connection resets). Everything else fails at once.

The deadline bounds the whole operation, not only the waits between attempts: a store makes a
`Deadline` for the operation, hands it to `RetryPolicy.call` and reads response bodies with
`read_body`, which gives up when the deadline passes even if bytes still trickle in. Running out
of time raises `DeadlineExceededError`, which names the operation and the deadline.

Logging, per failing operation: one WARNING at the first retry (what failed, how many tries and
how much time are left), DEBUG for further retries, and one WARNING when it gives up (attempts,
elapsed seconds, last error). Each is a single line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_any,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from spotckpt.errors import DeadlineExceededError, InvalidArgumentError

T = TypeVar("T")
log = logging.getLogger("spotckpt.storage")

READ_SIZE = 1 << 20
"""Most bytes one `read_body` step asks for; it returns as soon as any have arrived."""


@dataclass(frozen=True)
class Deadline:
    """The `time.monotonic()` instant by which one storage operation must be done."""

    what: str
    budget_s: float
    at: float
    started: float

    @classmethod
    def after(cls, what: str, budget_s: float) -> Deadline:
        """A deadline `budget_s` seconds from now for the operation `what`."""
        now = time.monotonic()
        return cls(what, budget_s, now + budget_s, now)

    def remaining(self) -> float:
        """Seconds left; zero or less once the deadline has passed."""
        return self.at - time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the operation started."""
        return time.monotonic() - self.started

    def check(self, doing: str = "") -> float:
        """Seconds left; raises `DeadlineExceededError` when there are none."""
        left = self.remaining()
        if left <= 0:
            raise self.exceeded(doing)
        return left

    def exceeded(self, doing: str = "") -> DeadlineExceededError:
        """The error for this deadline; `doing` says what was under way."""
        during = f" while {doing}" if doing else ""
        return DeadlineExceededError(
            f"{self.what}: not done within its deadline of {self.budget_s:g} s "
            f"(RetryPolicy.deadline_s){during}; gave up after {self.elapsed():.1f} s"
        )


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how long to retry one storage call.

    `max_attempts` counts the first try; `deadline_s` bounds the whole call including waits and
    slow answers; waits are drawn uniformly from [0, min(max_backoff_s, initial_backoff_s * 2**n)]
    (full jitter, which spreads a fleet of ranks that all hit throttling at once) and never run
    past the deadline.
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    deadline_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidArgumentError("RetryPolicy.max_attempts must be at least 1")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise InvalidArgumentError("RetryPolicy needs 0 <= initial_backoff_s <= max_backoff_s")
        if self.deadline_s <= 0:
            raise InvalidArgumentError("RetryPolicy.deadline_s must be positive")

    def deadline(self, what: str) -> Deadline:
        """A new deadline for the operation `what`, `deadline_s` from now."""
        return Deadline.after(what, self.deadline_s)

    def call(
        self,
        fn: Callable[[], T],
        is_transient: Callable[[BaseException], bool],
        what: str,
        deadline: Deadline | None = None,
    ) -> T:
        """Run `fn`, retrying transient failures; re-raise the last error when giving up.

        Running out of `deadline` (a new one of `deadline_s` by default) raises
        `DeadlineExceededError` chained to the last error.
        """
        deadline = deadline or self.deadline(what)

        def give_up(state: RetryCallState) -> NoReturn:
            error = _exception(state)
            if state.attempt_number < self.max_attempts:
                raise deadline.exceeded(f"retrying {_describe(error)}") from error
            raise error

        def before_sleep(state: RetryCallState) -> None:
            self._log_retry(
                what, state.attempt_number, deadline, _exception(state), state.upcoming_sleep
            )

        retrying = Retrying(
            stop=stop_any(stop_after_attempt(self.max_attempts), _StopAtDeadline(deadline)),
            wait=wait_random_exponential(multiplier=self.initial_backoff_s, max=self.max_backoff_s),
            retry=retry_if_exception(
                lambda e: not isinstance(e, DeadlineExceededError) and is_transient(e)
            ),
            before_sleep=before_sleep,
            retry_error_callback=give_up,
        )
        try:
            return retrying(fn)
        except Exception as error:
            attempts = int(retrying.statistics.get("attempt_number", 1))
            if attempts > 1 or isinstance(error, DeadlineExceededError):
                _log_give_up(what, attempts, deadline, error)
            raise

    def _log_retry(
        self, what: str, attempt: int, deadline: Deadline, error: BaseException, wait: float
    ) -> None:
        if attempt == 1:
            log.warning(
                "%s failed: %s; retrying up to %d more times within %.0f s",
                what,
                _describe(error),
                self.max_attempts - 1,
                max(0.0, deadline.remaining()),
            )
        else:
            log.debug(
                "%s failed again (attempt %d of %d): %s; next try in %.2f s",
                what,
                attempt,
                self.max_attempts,
                _describe(error),
                wait,
            )


def _log_give_up(what: str, attempts: int, deadline: Deadline, error: BaseException) -> None:
    log.warning(
        "%s: giving up after %d attempt%s in %.1f s: %s",
        what,
        attempts,
        "" if attempts == 1 else "s",
        deadline.elapsed(),
        _describe(error),
    )


class _StopAtDeadline(stop_base):
    """Stop when the next wait would end past the deadline (tenacity computes the wait first)."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return retry_state.upcoming_sleep >= self.deadline.remaining()


def _exception(state: RetryCallState) -> BaseException:
    error = state.outcome.exception() if state.outcome is not None else None
    return error if error is not None else RuntimeError("no outcome")


def _describe(error: BaseException) -> str:
    """The error on one line, at most 200 characters of its text."""
    text = " ".join(str(error).split())[:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def read_body(raw: Any, deadline: Deadline, read_timeout_s: float, expected: int = -1) -> bytes:
    """All of a urllib3 response body, failing with `DeadlineExceededError` at the deadline.

    Reads whatever has arrived (``read1``), so a body that trickles in byte by byte cannot keep
    it past the deadline; before each read the socket's timeout is cut to the time left.
    `expected` (the Content-Length, if known) only improves the error message.
    """
    out = bytearray()
    body = _Body(raw, deadline, read_timeout_s)
    while True:
        chunk = body.read1(READ_SIZE, len(out), expected)
        if not chunk:
            return bytes(out)
        out += chunk


def read_body_into(
    raw: Any,
    deadline: Deadline,
    read_timeout_s: float,
    views: Sequence[memoryview],
    skip: int = 0,
) -> int:
    """Like `read_body`, but into `views`, filled in turn (a scatter read: the body holds their
    bytes back to back), after discarding the first `skip` bytes (for a server that ignored a
    range); stops when the last view is full or the body ends; returns the bytes placed. Each
    step is one ``read1``: a trickling body cannot pass the deadline."""
    wanted = sum(view.nbytes for view in views)
    placed = 0
    body = _Body(raw, deadline, read_timeout_s)
    for view in views:
        filled = 0
        while filled < view.nbytes:
            chunk = body.read1(min(READ_SIZE, skip or view.nbytes - filled), placed, wanted)
            if not chunk:
                return placed
            if skip:
                skip -= len(chunk)
                continue
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
            placed += len(chunk)
    return placed


class _Body:
    """One response body read step by step under a deadline: before each ``read1`` the
    socket's timeout is cut to the time left. It is set only when it changes (a system call
    each, which cost a reading thread as much as checking the CRCs of what it read), and looked
    up on every step: the read that delivers a body's last bytes hands its connection back to
    the pool, where another request may be using it by the next step."""

    def __init__(self, raw: Any, deadline: Deadline, read_timeout_s: float) -> None:
        self.raw = raw
        self.deadline = deadline
        self.read_timeout_s = read_timeout_s
        self.sock: Any = None
        self.timeout = -1.0

    def read1(self, size: int, done: int, expected: int) -> bytes:
        """What has arrived, at most `size` bytes (empty at the end); `done` of `expected`
        (negative: unknown) name how far the read got when the deadline passes."""
        left = self.deadline.remaining()
        if left <= 0:
            raise self.deadline.exceeded(self._doing(done, expected))
        timeout = max(min(self.read_timeout_s, left), 0.001)
        sock = getattr(getattr(self.raw, "connection", None), "sock", None)
        if sock is not None and (sock is not self.sock or timeout != self.timeout):
            sock.settimeout(timeout)
            self.sock, self.timeout = sock, timeout
        try:
            chunk: bytes = self.raw.read1(size)
        except Exception as error:
            if self.deadline.remaining() <= 0:
                raise self.deadline.exceeded(self._doing(done, expected)) from error
            raise
        return chunk

    @staticmethod
    def _doing(done: int, expected: int) -> str:
        return f"reading the answer ({done} of {expected if expected >= 0 else '?'} bytes)"
