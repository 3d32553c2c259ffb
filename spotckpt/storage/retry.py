"""Retry policies as values: jittered exponential back-off with an attempt cap and a total deadline.

A store holds one `RetryPolicy` and a predicate that says which of its errors are transient
(throttling, 5xx, timeouts, connection resets). Everything else fails at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

T = TypeVar("T")
log = logging.getLogger("spotckpt.storage")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how long to retry one storage call.

    `max_attempts` counts the first try; `deadline_s` bounds the whole call including waits;
    waits are drawn uniformly from [0, min(max_backoff_s, initial_backoff_s * 2**n)] (full jitter,
    which spreads a fleet of ranks that all hit throttling at once).
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    deadline_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be at least 1")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("RetryPolicy needs 0 <= initial_backoff_s <= max_backoff_s")
        if self.deadline_s <= 0:
            raise ValueError("RetryPolicy.deadline_s must be positive")

    def call(
        self,
        fn: Callable[[], T],
        is_transient: Callable[[BaseException], bool],
        what: str,
    ) -> T:
        """Run `fn`, retrying transient failures; re-raise the last error when giving up."""
        retrying = Retrying(
            stop=stop_after_attempt(self.max_attempts) | stop_after_delay(self.deadline_s),
            wait=wait_random_exponential(multiplier=self.initial_backoff_s, max=self.max_backoff_s),
            retry=retry_if_exception(is_transient),
            before_sleep=_log_retry(what),
            reraise=True,
        )
        return retrying(fn)


NO_RETRY = RetryPolicy(max_attempts=1)


def _log_retry(what: str) -> Callable[[RetryCallState], None]:
    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        log.warning(
            "%s failed (attempt %d): %s: %.200s; retrying",
            what,
            state.attempt_number,
            type(error).__name__,
            error,
        )

    return before_sleep
