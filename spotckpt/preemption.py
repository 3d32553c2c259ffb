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
start at all; a poller that finds no metadata service switches itself off and logs that once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("spotckpt.preemption")

AWS_DEFAULT_ENDPOINT = "http://169.254.169.254"
GCE_DEFAULT_HOST = "metadata.google.internal"
AWS_TOKEN_TTL_S = 21600
GCE_NOTICE_S = 30.0
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_DMI = Path("/sys/class/dmi/id")

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
    automatic detection (see the module docstring).
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
    ) -> None:
        self.signals = tuple(signals)
        self.poll_interval_s = poll_interval_s
        self.signal_budget_s = signal_budget_s
        self.request_timeout_s = request_timeout_s
        self.aws_rebalance = aws_rebalance
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

    # AWS ------------------------------------------------------------------------------------

    def _poll_aws(self) -> None:
        endpoint = self._aws_endpoint
        token: str | None = None
        while not self._stopping.is_set() and not self._preempted:
            try:
                if token is None:
                    token = self._aws_token(endpoint)
                status, body, _ = self._http(
                    f"{endpoint}/latest/meta-data/spot/instance-action",
                    headers={"X-aws-ec2-metadata-token": token},
                )
                if status == 401:
                    token = None
                    continue
                if status == 200:
                    self._aws_notice(body)
                    return
                if self.aws_rebalance:
                    self._aws_rebalance_check(endpoint, token)
            except OSError as error:
                log.info("no AWS metadata service at %s (%s); AWS notices are off", endpoint, error)
                return
            self._stopping.wait(self.poll_interval_s)

    def _aws_token(self, endpoint: str | None) -> str:
        status, body, _ = self._http(
            f"{endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
        )
        if status != 200:
            raise OSError(f"IMDSv2 token request answered HTTP {status}")
        return body.decode().strip()

    def _aws_notice(self, body: bytes) -> None:
        try:
            notice = json.loads(body)
            action = str(notice.get("action", "terminate"))
            when = datetime.fromisoformat(str(notice["time"]).replace("Z", "+00:00"))
            seconds_left = (when - datetime.now(timezone.utc)).total_seconds()
            deadline: float | None = time.monotonic() + max(0.0, seconds_left)
        except (ValueError, KeyError, TypeError, AttributeError):
            action, deadline = "terminate", time.monotonic() + 120.0
        self.trigger(f"aws:{action}", deadline)

    def _aws_rebalance_check(self, endpoint: str | None, token: str) -> None:
        status, _, _ = self._http(
            f"{endpoint}/latest/meta-data/events/recommendations/rebalance",
            headers={"X-aws-ec2-metadata-token": token},
        )
        if status == 200 and not self.rebalance_recommended:
            self.rebalance_recommended = True
            log.warning("AWS rebalance recommendation: this spot instance is at elevated risk")

    # GCE ------------------------------------------------------------------------------------

    def _poll_gce(self) -> None:
        url = f"{self._gce_url}/computeMetadata/v1/instance/preempted"
        etag = "0"
        while not self._stopping.is_set() and not self._preempted:
            try:
                status, body, new_etag = self._http(
                    f"{url}?wait_for_change=true&last_etag={etag}&timeout_sec=5",
                    headers={"Metadata-Flavor": "Google"},
                    timeout=self.request_timeout_s + 6,
                )
            except OSError as error:
                log.info("no GCE metadata service at %s (%s); GCE notices are off", url, error)
                return
            if status != 200:
                log.info("GCE metadata answered HTTP %d; GCE notices are off", status)
                return
            text, etag = body.decode(errors="replace").strip(), new_etag or etag
            if text.upper() == "TRUE":
                self.trigger("gce:preempted", time.monotonic() + GCE_NOTICE_S)
                return

    # HTTP -----------------------------------------------------------------------------------

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
                return int(response.status), response.read(), response.headers.get("ETag")
        except urllib.error.HTTPError as error:
            return int(error.code), error.read() or b"", None


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
