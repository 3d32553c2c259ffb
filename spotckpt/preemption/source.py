"""What every polled preemption notice source shares, so that a new cloud is one class.

A `NoticeSource` is one place a notice can come from, looked at again and again: `poll_once`
returns the `Notice`, or the seconds to wait before the next look, and raises when the look
failed. The watcher polls each source in its own daemon thread through a `Poller`, which takes
every failure the same way, whatever the source: finding nobody at the address before the
service ever answered (connection refused, unknown host, no route) means "this is not that
cloud", and the source is switched off with one INFO line; anything else (an HTTP error status,
a malformed answer, a timeout, a reset connection, including after start-up) is retried after a
`Backoff` for as long as the watcher runs, and logged at WARNING once per kind of failure (further
ones at DEBUG): a notice is never missed because one answer was bad. A source raises
`MetadataAnswerError` for an answer it cannot use: the service is there, so it is an outage.

`fetch` is one request to a metadata service: never through a proxy, and at most
`MAX_ANSWER_BYTES` of its answer read.
"""

from __future__ import annotations

import errno
import logging
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from typing import NamedTuple, Protocol

from spotckpt.errors import MetadataAnswerError

log = logging.getLogger("spotckpt.preemption")
"""The logger of the whole package, its sources included: one name for users to configure."""

MAX_ANSWER_BYTES = 64 * 1024
"""Most bytes read of one metadata answer: a broken or hostile service cannot fill memory."""

_UNREACHABLE = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL})
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Notice:
    """A preemption notice, as one value so that the first one is recorded whole (a signal
    handler records it without a lock).

    `deadline` is the `time.monotonic()` by which the emergency save must be done, or None when
    the source cannot tell.
    """

    reason: str
    deadline: float | None


@dataclass(frozen=True)
class Backoff:
    """The pause after failed looks: it doubles from `initial_s` up to `max_s`, and the looks go
    on for as long as the watcher runs, since a notice missed is a checkpoint lost."""

    initial_s: float
    max_s: float

    def after(self, failures: int) -> float:
        """The pause after `failures` (at least one) failed looks in a row."""
        return min(self.max_s, self.initial_s * 2 ** min(failures - 1, 30))


class NoticeSource(Protocol):
    """One place a preemption notice can come from, polled in its own thread (module docstring)."""

    @property
    def name(self) -> str:
        """What the logs call it (``AWS``); lower-cased, it names the thread (``spotckpt-aws``)."""

    @property
    def where(self) -> str:
        """The address it looks at, for the logs."""

    def poll_once(self) -> Notice | float:
        """Look once: the notice, or the seconds to wait before the next look.

        Raises when the look failed; `Poller` says how each failure is taken.
        """


class Answer(NamedTuple):
    """A metadata service's answer; an HTTP error status is an answer too."""

    status: int
    body: bytes
    etag: str | None


def fetch(url: str, *, method: str = "GET", headers: dict[str, str], timeout_s: float) -> Answer:
    """One request to a metadata service, which is always local: never through a proxy."""
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with _NO_PROXY.open(request, timeout=timeout_s) as response:
            body = response.read(MAX_ANSWER_BYTES)
            return Answer(int(response.status), body, response.headers.get("ETag"))
    except urllib.error.HTTPError as error:
        return Answer(int(error.code), error.read(MAX_ANSWER_BYTES) or b"", None)


def snippet(body: bytes) -> str:
    """The start of an unusable answer, for its error: enough to recognise it, never a flood."""
    return repr(body[:80])


class Poller:
    """One source's looks and their failures: back-off, logging once per kind, start-up state.

    A source that has never answered and finds nobody at its address is switched off; once it
    has answered, the same error is an outage and is retried (module docstring).
    """

    def __init__(self, source: NoticeSource, backoff: Backoff) -> None:
        self.source = source
        self.backoff = backoff
        self._answered = False
        self._failures = 0
        self._kinds: set[str] = set()

    def poll(self) -> Notice | float | None:
        """One look: the notice, the pause before the next look (a back-off after a failure), or
        None when nobody is there: the source is off and is polled no more."""
        try:
            outcome = self.source.poll_once()
        except Exception as error:  # a poller must outlive any one bad answer
            if not self._answered and _nobody_there(error):
                log.info(
                    "no %s metadata service at %s (%s); %s notices are off",
                    self.source.name,
                    self.source.where,
                    _one_line(_reason(error)),
                    self.source.name,
                )
                return None
            return self._failed(error)
        self._succeeded()
        return outcome

    def _failed(self, error: Exception) -> float:
        """Log a failed look (WARNING the first time of its kind) and return the back-off."""
        if isinstance(error, MetadataAnswerError):
            self._answered = True
        kind = (
            error.kind if isinstance(error, MetadataAnswerError) else type(_reason(error)).__name__
        )
        first = kind not in self._kinds
        self._kinds.add(kind)
        expected = isinstance(_reason(error), (OSError, HTTPException, MetadataAnswerError))
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "%s metadata service at %s: %s; retrying with back-off (at most %.3g s) while the "
            "watcher runs",
            self.source.name,
            self.source.where,
            _one_line(_reason(error)),
            self.backoff.max_s,
            exc_info=first and not expected,
        )
        self._failures += 1
        return self.backoff.after(self._failures)

    def _succeeded(self) -> None:
        """Note an answer; after failures, say that the service is back."""
        if self._failures:
            log.info(
                "%s metadata service at %s answers again after %d failed tries",
                self.source.name,
                self.source.where,
                self._failures,
            )
        self._answered = True
        self._failures = 0


def _reason(error: BaseException) -> BaseException:
    """The error under urllib's URLError wrapper."""
    if isinstance(error, urllib.error.URLError) and isinstance(error.reason, BaseException):
        return error.reason
    return error


def _nobody_there(error: BaseException) -> bool:
    """Whether an error says that no service listens at the address (not a slow or bad one)."""
    reason = _reason(error)
    if isinstance(reason, (ConnectionRefusedError, socket.gaierror)):
        return True
    return isinstance(reason, OSError) and reason.errno in _UNREACHABLE


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())[:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
