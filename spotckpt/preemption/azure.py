"""Azure Spot eviction notices through Scheduled Events: ``Preempt`` events that name this VM.

Each look GETs ``/metadata/scheduledevents`` (header ``Metadata: true``). Events reach every VM
of a placement group (availability set, scale set), so a ``Preempt`` event counts only when its
``Resources`` name this VM: its name comes from ``SPOTCKPT_AZURE_VM_NAME``, else from the
instance metadata (``compute/name``), asked once. When a ``Preempt`` event arrives and the name
cannot be had, the event is taken as ours (a needless save beats a missed eviction). Its
``NotBefore`` (at least 30 s ahead) becomes the deadline; an event without one, or one already
``Started``, leaves `AZURE_NOTICE_S` or nothing. No event is acknowledged (a StartRequests POST
would let Azure evict sooner). The endpoint comes from ``SPOTCKPT_AZURE_METADATA_ENDPOINT``,
else from the DMI data (Azure's chassis asset tag).
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from http.client import HTTPException
from typing import Any

from spotckpt.environment import AZURE_ENDPOINT_ENV, AZURE_VM_NAME_ENV
from spotckpt.errors import MetadataAnswerError
from spotckpt.preemption.dmi import dmi_value
from spotckpt.preemption.source import Notice, fetch, log, snippet

AZURE_DEFAULT_ENDPOINT = "http://169.254.169.254"
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
"""The chassis asset tag of every Azure VM, by which the DMI data tells Azure from Hyper-V."""
AZURE_NOTICE_S = 30.0
"""Azure's shortest Preempt notice: the deadline of an event whose NotBefore is unreadable."""
EVENTS_API = "api-version=2020-07-01"
INSTANCE_API = "api-version=2021-02-01"


def azure_metadata_endpoint() -> str | None:
    """The instance metadata base URL to poll, or None when this is evidently not Azure."""
    explicit = os.environ.get(AZURE_ENDPOINT_ENV)
    if explicit:
        return explicit.rstrip("/")
    tag = dmi_value("chassis_asset_tag")
    return AZURE_DEFAULT_ENDPOINT if tag == AZURE_ASSET_TAG else None


class AzureNoticeSource:
    """Scheduled Events, polled every `poll_interval_s` for a ``Preempt`` naming this VM."""

    name = "Azure"
    window_s = AZURE_NOTICE_S
    """The shortest notice this cloud gives (`PreemptionWatcher.window`)."""

    def __init__(self, endpoint: str, *, poll_interval_s: float, request_timeout_s: float) -> None:
        self.endpoint = endpoint
        self.where = f"{endpoint}/metadata/scheduledevents"
        self.poll_interval_s = poll_interval_s
        self.request_timeout_s = request_timeout_s
        self.vm_name: str | None = os.environ.get(AZURE_VM_NAME_ENV) or None

    def poll_once(self) -> Notice | float:
        """One look at the scheduled events: the notice, or the pause before the next look."""
        status, body, _ = fetch(
            f"{self.where}?{EVENTS_API}",
            headers={"Metadata": "true"},
            timeout_s=self.request_timeout_s,
        )
        if status != 200:
            raise MetadataAnswerError(f"HTTP {status}", snippet(body))
        preempts = _preempt_events(body)
        if not preempts:
            return self.poll_interval_s
        name = self._vm_name()
        ours = [event for event in preempts if name is None or _names(event, name)]
        if not ours:
            log.debug("Azure Preempt events for other VMs than %s: ignored", name)
            return self.poll_interval_s
        if name is None:
            log.warning(
                "Azure announced a Preempt event and this VM's name is unknown (set %s); "
                "taking it as this VM's",
                AZURE_VM_NAME_ENV,
            )
        return Notice("azure:preempt", time.monotonic() + min(_seconds_left(e) for e in ours))

    def _vm_name(self) -> str | None:
        """This VM's name as Scheduled Events call it; None when it cannot be had now."""
        if self.vm_name is None:
            try:
                status, body, _ = fetch(
                    f"{self.endpoint}/metadata/instance/compute/name?{INSTANCE_API}&format=text",
                    headers={"Metadata": "true"},
                    timeout_s=self.request_timeout_s,
                )
            except (OSError, HTTPException):
                return None
            text = body.decode("utf-8", errors="replace").strip()
            if status == 200 and text and text.isprintable() and len(text) <= 256:
                self.vm_name = text
        return self.vm_name


def _preempt_events(body: bytes) -> list[dict[str, Any]]:
    """The Preempt events of a Scheduled Events document; MetadataAnswerError when it is not
    one."""
    try:
        document = json.loads(body)
    except ValueError:
        raise MetadataAnswerError("malformed scheduled events", snippet(body)) from None
    events = document.get("Events") if isinstance(document, dict) else None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise MetadataAnswerError("malformed scheduled events", snippet(body))
    return [e for e in events if str(e.get("EventType", "")).lower() == "preempt"]


def _names(event: dict[str, Any], vm_name: str) -> bool:
    """Whether an event's Resources name `vm_name` (Azure's names ignore case)."""
    resources = event.get("Resources")
    if not isinstance(resources, list):
        return True  # an event that names nobody cannot be ruled out
    return any(isinstance(r, str) and r.lower() == vm_name.lower() for r in resources)


def _seconds_left(event: dict[str, Any]) -> float:
    """Seconds until the event's NotBefore; none left once Started; `AZURE_NOTICE_S` when the
    time is missing or unreadable."""
    if str(event.get("EventStatus", "")).lower() == "started":
        return 0.0
    try:
        when = parsedate_to_datetime(str(event.get("NotBefore", "")))
    except (TypeError, ValueError, IndexError):
        return AZURE_NOTICE_S
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
