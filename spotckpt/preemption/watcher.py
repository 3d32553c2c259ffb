"""`PreemptionWatcher`: notices that this machine is about to go away.

Sources:
- signals (SIGTERM from Kubernetes, torchrun and GCE's ACPI soft-off; SIGUSR1 from SLURM): the
  handler only records the notice (and chains a previous Python handler); the training loop acts
  on it at its next `CheckpointManager.maybe_save`;
- the AWS spot instance-action notice through IMDSv2 (token PUT, then GET; 404 means no notice,
  401 means the token expired), polled every few seconds; its ``time`` becomes the deadline;
- the GCE ``instance/preempted`` metadata value, long-polled with ``wait_for_change``; GCE gives
  30 s from the notice.

Endpoints come from ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` and ``GCE_METADATA_HOST``. Off a cloud
(no endpoint variable and the machine's DMI data names neither EC2 nor GCE) a poller does not
start at all. A poller that finds nobody at the address before the service ever answered
(connection refused, unknown host, no route) concludes "this is not that cloud", switches itself
off and logs that once at INFO. Anything else (5xx, a malformed answer or notice, a timeout, a
reset connection, including after start-up) is retried with back-off for as long as the
watcher runs, and logged at WARNING once per kind of failure (further ones at DEBUG): a notice is
never missed because one answer was bad. A 200 instance-action answer that is not a valid notice
is retried too; when it keeps coming (`AWS_MALFORMED_TRUSTED` in a row) it counts as a notice.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from http.client import HTTPException
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import quote

from spotckpt.errors import InvalidArgumentError, MetadataAnswerError

log = logging.getLogger("spotckpt.preemption")

AWS_DEFAULT_ENDPOINT = "http://169.254.169.254"
GCE_DEFAULT_HOST = "metadata.google.internal"
AWS_TOKEN_TTL_S = 21600
AWS_NOTICE_S = 120.0
"""AWS's spot notice period: the deadline of a notice whose time is unreadable."""
AWS_MALFORMED_TRUSTED = 3
"""Malformed instance-action answers in a row (no 404 between) taken as a notice."""
GCE_NOTICE_S = 30.0
MAX_ANSWER_BYTES = 64 * 1024
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_DMI = Path("/sys/class/dmi/id")

_UNREACHABLE = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL})

SignalHandler = Callable[[int, FrameType | None], Any] | int | None


def _dmi_says(*needles: str) -> bool:
    for name in ("sys_vendor", "product_name", "bios_vendor"):
        try:
            text = (_DMI / name).read_text()
        except OSError:
            continue
        if any(n in text for n in needles):
            return True
    return False


def aws_metadata_endpoint() -> str | None:
    """The IMDS base URL to poll, or None when this is evidently not an EC2 machine."""
    explicit = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT")
    if explicit:
        return explicit.rstrip("/")
    return AWS_DEFAULT_ENDPOINT if _dmi_says("Amazon EC2", "Amazon") else None


def gce_metadata_url() -> str | None:
    """The GCE metadata base URL to poll, or None when this is evidently not a GCE machine."""
    host = os.environ.get("GCE_METADATA_HOST")
    if host:
        return host.rstrip("/") if "://" in host else f"http://{host.rstrip('/')}"
    return f"http://{GCE_DEFAULT_HOST}" if _dmi_says("Google") else None


class PreemptionWatcher:
    """Records the first preemption notice from signals or cloud metadata services.

    `signal_budget_s` is the time assumed available after a signal (torchrun and Kubernetes give
    30 s by default); the cloud notices carry their own deadline. `aws`/`gce` default to
    automatic detection (see the module docstring). `poll_interval_s` is the pause between AWS
    polls and the length of one GCE long poll; failed tries are retried after a back-off that
    doubles from `backoff_initial_s` up to `backoff_max_s`.
    """

    def __init__(
        self,
        *,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        aws: bool | None = None,
        gce: bool | None = None,
        poll_interval_s: float = 5.0,
        signal_budget_s: float = 25.0,
        request_timeout_s: float = 1.0,
        aws_rebalance: bool = False,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 4.0,
    ) -> None:
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise InvalidArgumentError(
                "PreemptionWatcher needs 0 < backoff_initial_s <= backoff_max_s"
            )
        self.signals = tuple(signals)
        self.poll_interval_s = poll_interval_s
        self.signal_budget_s = signal_budget_s
        self.request_timeout_s = request_timeout_s
        self.aws_rebalance = aws_rebalance
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._aws_endpoint = aws_metadata_endpoint() if aws is not False else None
        if aws and self._aws_endpoint is None:
            self._aws_endpoint = AWS_DEFAULT_ENDPOINT
        self._gce_url = gce_metadata_url() if gce is not False else None
        if gce and self._gce_url is None:
            self._gce_url = f"http://{GCE_DEFAULT_HOST}"
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._previous: dict[int, SignalHandler] = {}
        self._preempted = False
        self._deadline: float | None = None
        self._reason: str | None = None
        self._noticed_at: float | None = None
        self.rebalance_recommended = False
        self._aws_token: str | None = None
        self._aws_malformed: tuple[float, int] | None = None  # (first seen, count)
        self._gce_etag = "0"

    # Public state ---------------------------------------------------------------------------

    @property
    def preempted(self) -> bool:
        """Whether a notice arrived."""
        return self._preempted

    @property
    def deadline(self) -> float | None:
        """`time.monotonic()` by which the emergency save must be done, or None if unknown."""
        return self._deadline

    @property
    def reason(self) -> str | None:
        """What raised the notice: ``SIGTERM``, ``aws:terminate``, ``gce``, ``manual``, ..."""
        return self._reason

    def trigger(self, reason: str = "manual", deadline: float | None = None) -> None:
        """Record a notice (for tests and custom schedulers); the first notice wins."""
        with self._lock:
            self._record(reason, deadline)

    def _record(self, reason: str, deadline: float | None) -> None:
        if self._preempted:
            return
        self._reason = reason
        self._deadline = deadline
        self._noticed_at = time.monotonic()
        self._preempted = True

    # Lifecycle ------------------------------------------------------------------------------

    def start(self) -> PreemptionWatcher:
        """Install signal handlers (from the main thread only) and start the pollers."""
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        elif self.signals:
            log.warning("PreemptionWatcher started off the main thread: signals are not watched")
        for name, target, enabled in (
            ("aws", self._poll_aws, self._aws_endpoint),
            ("gce", self._poll_gce, self._gce_url),
        ):
            if enabled:
                thread = threading.Thread(target=target, name=f"spotckpt-{name}", daemon=True)
                thread.start()
                self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Restore the previous signal handlers and stop the pollers."""
        self._stopping.set()
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        for thread in self._threads:
            thread.join(timeout=self.request_timeout_s + 1)
        self._threads.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A signal handler must not take locks or log: it may interrupt code holding them.
        if not self._preempted:
            self._reason = signal.Signals(signum).name
            self._deadline = time.monotonic() + self.signal_budget_s
            self._noticed_at = time.monotonic()
            self._preempted = True
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    # Pollers --------------------------------------------------------------------------------

    def _run_poller(self, poller: _Poller, once: Callable[[], float]) -> None:
        """Call `once` until a notice arrives or the watcher stops; it never dies of an error.

        `once` returns how long to wait before the next call. A failure is logged (at WARNING
        the first time of its kind) and retried with back-off; only finding nobody at the
        address before the service ever answered ("this is not that cloud") ends the poller.
        """
        while not self._stopping.is_set() and not self._preempted:
            try:
                pause = once()
            except Exception as error:  # a poller must outlive any one bad answer
                if not poller.answered and _nobody_there(error):
                    log.info(
                        "no %s metadata service at %s (%s); %s notices are off",
                        poller.source,
                        poller.where,
                        _one_line(_reason(error)),
                        poller.source,
                    )
                    return
                pause = poller.failed(error)
            else:
                poller.succeeded()
            self._stopping.wait(pause)

    # AWS ------------------------------------------------------------------------------------

    def _poll_aws(self) -> None:
        where = f"{self._aws_endpoint}/latest/meta-data/spot/instance-action"
        self._run_poller(self._poller("AWS", where), self._aws_once)

    def _aws_once(self) -> float:
        """One look at the instance-action notice; returns the pause before the next one."""
        fresh = self._aws_token is None
        token = self._aws_token = self._aws_token or self._aws_fetch_token()
        status, body, _ = self._http(
            f"{self._aws_endpoint}/latest/meta-data/spot/instance-action",
            headers={"X-aws-ec2-metadata-token": token},
        )
        if status == 401:
            self._aws_token = None
            if fresh:
                raise MetadataAnswerError("HTTP 401 with a fresh token")
            return 0.0  # the token expired: fetch a new one at once
        if status == 404:
            self._aws_malformed = None
            if self.aws_rebalance:
                self._aws_rebalance_check(token)
            return self.poll_interval_s
        if status != 200:
            raise MetadataAnswerError(f"HTTP {status}", _snippet(body))
        self._aws_notice(body)
        return 0.0

    def _aws_fetch_token(self) -> str:
        status, body, _ = self._http(
            f"{self._aws_endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
        )
        token = body.decode("ascii", errors="replace").strip()
        if status != 200 or not token.isprintable() or " " in token or not token:
            raise MetadataAnswerError(
                f"IMDSv2 token request answered HTTP {status}", _snippet(body)
            )
        return token

    def _aws_notice(self, body: bytes) -> None:
        """Record a notice; a malformed one counts as a notice only when it keeps coming."""
        notice = _parse_aws_notice(body)
        if notice is None:
            now = time.monotonic()
            first, count = self._aws_malformed or (now, 0)
            self._aws_malformed = (first, count + 1)
            if count + 1 < AWS_MALFORMED_TRUSTED:
                raise MetadataAnswerError("malformed instance-action notice", _snippet(body))
            log.warning(
                "AWS answered %d malformed instance-action notices in a row; taking them "
                "as a termination notice",
                count + 1,
            )
            self.trigger("aws:terminate", first + AWS_NOTICE_S)
            return
        action, seconds_left = notice
        self.trigger(f"aws:{action}", time.monotonic() + seconds_left)

    def _aws_rebalance_check(self, token: str) -> None:
        status, _, _ = self._http(
            f"{self._aws_endpoint}/latest/meta-data/events/recommendations/rebalance",
            headers={"X-aws-ec2-metadata-token": token},
        )
        if status == 200 and not self.rebalance_recommended:
            self.rebalance_recommended = True
            log.warning("AWS rebalance recommendation: this spot instance is at elevated risk")

    # GCE ------------------------------------------------------------------------------------

    def _poll_gce(self) -> None:
        where = f"{self._gce_url}/computeMetadata/v1/instance/preempted"
        self._run_poller(self._poller("GCE", where), self._gce_once)

    def _gce_once(self) -> float:
        """One long poll of ``instance/preempted``; returns the pause before the next one."""
        wait_s = max(1, round(self.poll_interval_s))
        sent, started = self._gce_etag, time.monotonic()
        status, body, etag = self._http(
            f"{self._gce_url}/computeMetadata/v1/instance/preempted"
            f"?wait_for_change=true&last_etag={quote(sent)}&timeout_sec={wait_s}",
            headers={"Metadata-Flavor": "Google"},
            timeout=self.request_timeout_s + wait_s,
        )
        if status != 200:
            raise MetadataAnswerError(f"HTTP {status}", _snippet(body))
        value = body.decode("ascii", errors="replace").strip().upper()
        if value == "TRUE":
            self.trigger("gce:preempted", time.monotonic() + GCE_NOTICE_S)
            return 0.0
        if value != "FALSE":
            raise MetadataAnswerError("unexpected instance/preempted value", _snippet(body))
        self._gce_etag = etag or sent
        if etag and etag != sent:
            return 0.0
        # Unchanged: a server that did not hold the request must not be asked in a tight loop.
        return max(0.0, wait_s - (time.monotonic() - started))

    # HTTP -----------------------------------------------------------------------------------

    def _poller(self, source: str, where: str) -> _Poller:
        return _Poller(source, where, self.backoff_initial_s, self.backoff_max_s)

    def _http(
        self,
        url: str,
        *,
        method: str = "GET",
        headers: dict[str, str],
        timeout: float | None = None,
    ) -> tuple[int, bytes, str | None]:
        """One request to a metadata service, never through a proxy: (status, body, ETag)."""
        request = urllib.request.Request(url, method=method, headers=headers)
        try:
            with _NO_PROXY.open(request, timeout=timeout or self.request_timeout_s) as response:
                body = response.read(MAX_ANSWER_BYTES)
                return int(response.status), body, response.headers.get("ETag")
        except urllib.error.HTTPError as error:
            return int(error.code), error.read(MAX_ANSWER_BYTES) or b"", None


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Poller:
    """One poller's failure bookkeeping: back-off, logging once per kind, start-up state."""

    def __init__(self, source: str, where: str, initial_s: float, max_s: float) -> None:
        self.source = source
        self.where = where
        self.initial_s = initial_s
        self.max_s = max_s
        self.answered = False
        self.failures = 0
        self.kinds: set[str] = set()

    def failed(self, error: Exception) -> float:
        """Log a failed try (WARNING the first time of its kind) and return the back-off."""
        if isinstance(error, MetadataAnswerError):
            self.answered = True
        kind = (
            error.kind if isinstance(error, MetadataAnswerError) else type(_reason(error)).__name__
        )
        first = kind not in self.kinds
        self.kinds.add(kind)
        expected = isinstance(_reason(error), (OSError, HTTPException, MetadataAnswerError))
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "%s metadata service at %s: %s; retrying with back-off (at most %.3g s) while the "
            "watcher runs",
            self.source,
            self.where,
            _one_line(_reason(error)),
            self.max_s,
            exc_info=first and not expected,
        )
        self.failures += 1
        return min(self.max_s, self.initial_s * 2 ** min(self.failures - 1, 30))

    def succeeded(self) -> None:
        """Note an answer; after failures, say that the service is back."""
        if self.failures:
            log.info(
                "%s metadata service at %s answers again after %d failed tries",
                self.source,
                self.where,
                self.failures,
            )
        self.answered = True
        self.failures = 0


def _parse_aws_notice(body: bytes) -> tuple[str, float] | None:
    """(action, seconds left) of an instance-action notice, or None when it is malformed."""
    try:
        notice = json.loads(body)
    except ValueError:
        return None
    if not isinstance(notice, dict) or not isinstance(notice.get("action"), str):
        return None
    action = str(notice["action"])
    try:
        when = datetime.fromisoformat(str(notice["time"]).replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds_left = (when - datetime.now(timezone.utc)).total_seconds()
    except (KeyError, ValueError):
        return action, AWS_NOTICE_S
    return action, max(0.0, seconds_left)


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


def _snippet(body: bytes) -> str:
    return repr(body[:80])
