"""GCE preemption notices: the ``instance/preempted`` metadata value, long-polled with
``wait_for_change``; GCE gives 30 s from the notice. The host comes from ``GCE_METADATA_HOST``,
else from the DMI data."""

from __future__ import annotations

import os
import time
from urllib.parse import quote

from spotckpt.errors import MetadataAnswerError
from spotckpt.preemption.dmi import dmi_says
from spotckpt.preemption.source import Notice, fetch, snippet

GCE_DEFAULT_HOST = "metadata.google.internal"
GCE_DEFAULT_URL = f"http://{GCE_DEFAULT_HOST}"
GCE_NOTICE_S = 30.0


def gce_metadata_url() -> str | None:
    """The GCE metadata base URL to poll, or None when this is evidently not a GCE machine."""
    host = os.environ.get("GCE_METADATA_HOST")
    if host:
        return host.rstrip("/") if "://" in host else f"http://{host.rstrip('/')}"
    return GCE_DEFAULT_URL if dmi_says("Google") else None


class GceNoticeSource:
    """``instance/preempted``, each look one long poll of about `poll_interval_s`: the server
    holds the request until the value changes, so the notice comes as soon as it is given."""

    name = "GCE"
    window_s = GCE_NOTICE_S
    """The shortest notice this cloud gives (`PreemptionWatcher.window`)."""

    def __init__(self, url: str, *, poll_interval_s: float, request_timeout_s: float) -> None:
        self.where = f"{url}/computeMetadata/v1/instance/preempted"
        self.poll_interval_s = poll_interval_s
        self.request_timeout_s = request_timeout_s
        self._etag = "0"

    def poll_once(self) -> Notice | float:
        """One long poll: the notice, or the pause before the next one."""
        wait_s = max(1, round(self.poll_interval_s))
        sent, started = self._etag, time.monotonic()
        status, body, etag = fetch(
            f"{self.where}?wait_for_change=true&last_etag={quote(sent)}&timeout_sec={wait_s}",
            headers={"Metadata-Flavor": "Google"},
            timeout_s=self.request_timeout_s + wait_s,
        )
        if status != 200:
            raise MetadataAnswerError(f"HTTP {status}", snippet(body))
        value = body.decode("ascii", errors="replace").strip().upper()
        if value == "TRUE":
            return Notice("gce:preempted", time.monotonic() + GCE_NOTICE_S)
        if value != "FALSE":
            raise MetadataAnswerError("unexpected instance/preempted value", snippet(body))
        self._etag = etag or sent
        if etag and etag != sent:
            return 0.0
        # Unchanged: a server that did not hold the request must not be asked in a tight loop.
        return max(0.0, wait_s - (time.monotonic() - started))
