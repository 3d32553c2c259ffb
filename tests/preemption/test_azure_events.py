"""Azure Scheduled Events against a fake endpoint on loopback: Preempt events for this VM and
for others, the VM's name from the instance metadata, hostile and flaky answers."""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from test_preemption import (
    HOSTILE,
    SLACK_S,
    WAIT_S,
    Answer,
    FakeMetadata,
    _hostile,
    _wait_for,
    _warnings,
)

from spotckpt import PreemptionWatcher
from spotckpt.preemption import AZURE_NOTICE_S

pytestmark = pytest.mark.process  # its tests start processes or servers

VM = "spot-vmss_3"


def _events(*events: dict[str, Any], incarnation: int = 1) -> bytes:
    return json.dumps({"DocumentIncarnation": incarnation, "Events": list(events)}).encode()


def _preempt(resources: list[str], seconds: float | None = 30, status: str = "Scheduled") -> dict:
    not_before = ""
    if seconds is not None:
        not_before = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=seconds), True)
    return {
        "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
        "EventStatus": status,
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": resources,
        "NotBefore": not_before,
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


def _serve(events: list[bytes | str], name: bytes | None = VM.encode()) -> Any:
    """A fake metadata service: the scheduled-events answers in turn (the last one repeats; a
    str is a hostile behaviour), and this VM's name (None: HTTP 404)."""
    seen: list[str] = []

    def respond(request: BaseHTTPRequestHandler) -> Answer | None:
        if request.headers.get("Metadata") != "true":
            return 400, {}, b'{"error": "Bad request. Required metadata header not specified"}'
        if request.command != "GET":
            return 405, {}, b"acknowledging is not expected"
        if request.path.startswith("/metadata/instance/compute/name"):
            return (404, {}, b"") if name is None else (200, {}, name)
        assert request.path.startswith("/metadata/scheduledevents?api-version=")
        step = events.pop(0) if len(events) > 1 else events[0]
        seen.append(step if isinstance(step, str) else "answer")
        if isinstance(step, str):
            return _hostile(step, server, request)
        return 200, {"Content-Type": "application/json"}, step

    server = FakeMetadata(respond)
    server.seen = seen  # type: ignore[attr-defined]
    return server


def _watch(
    monkeypatch: pytest.MonkeyPatch, server: FakeMetadata, watchers: list[PreemptionWatcher]
) -> PreemptionWatcher:
    monkeypatch.setenv("SPOTCKPT_AZURE_METADATA_ENDPOINT", f"http://{server.address}")
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, poll_interval_s=0.05, **HOSTILE)
    watchers.append(watcher.start())
    return watcher


def _stop(watchers: list[PreemptionWatcher]) -> None:
    for watcher in watchers:
        watcher.stop()


def test_a_preempt_for_this_vm_is_a_notice_with_its_deadline(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    monkeypatch.delenv("SPOTCKPT_AZURE_VM_NAME", raising=False)
    server = _serve([_events(), _events(), _events(_preempt(["other_1", VM.upper()], 45))])
    try:
        watcher = _watch(monkeypatch, server, watchers)
        assert _wait_for(lambda: watcher.preempted)
    finally:
        _stop(watchers)  # before its server goes: no poll meets a closed port
        server.close()
    assert watcher.reason == "azure:preempt"
    left = (watcher.deadline or 0) - time.monotonic()
    assert 45 - SLACK_S < left <= 45
    paths = [path for method, path, _ in server.requests]
    assert sum(p.startswith("/metadata/instance/compute/name") for p in paths) == 1
    assert all(method == "GET" for method, _, _ in server.requests)  # nothing acknowledged


def test_a_preempt_for_other_vms_of_the_group_is_ignored(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    monkeypatch.setenv("SPOTCKPT_AZURE_VM_NAME", VM)
    server = _serve([_events(_preempt(["spot-vmss_30", "spot-vmss_4"]))])
    try:
        watcher = _watch(monkeypatch, server, watchers)
        assert _wait_for(lambda: len(server.seen) >= 5)  # type: ignore[attr-defined]
        assert not watcher.preempted
    finally:
        _stop(watchers)  # before its server goes: no poll meets a closed port
        server.close()
    assert not any(p.startswith("/metadata/instance") for _, p, _ in server.requests)


def test_a_started_preempt_leaves_no_time_and_an_unreadable_one_the_minimum(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    monkeypatch.setenv("SPOTCKPT_AZURE_VM_NAME", VM)
    server = _serve([_events(_preempt([VM], None, status="Started"))])
    try:
        watcher = _watch(monkeypatch, server, watchers)
        assert _wait_for(lambda: watcher.preempted)
    finally:
        _stop(watchers)  # before its server goes: no poll meets a closed port
        server.close()
    assert (watcher.deadline or 0) <= time.monotonic()
    second = _serve([_events({**_preempt([VM]), "NotBefore": "soon, probably"})])
    try:
        other = _watch(monkeypatch, second, watchers)
        assert _wait_for(lambda: other.preempted)
    finally:
        second.close()
    assert 0 < (other.deadline or 0) - time.monotonic() <= AZURE_NOTICE_S


def test_an_unknown_vm_name_takes_the_preempt_as_ours(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watchers: list[PreemptionWatcher],
) -> None:
    monkeypatch.delenv("SPOTCKPT_AZURE_VM_NAME", raising=False)
    server = _serve([_events(_preempt(["somebody"]))], name=None)
    try:
        watcher = _watch(monkeypatch, server, watchers)
        assert _wait_for(lambda: watcher.preempted)
    finally:
        _stop(watchers)  # before its server goes: no poll meets a closed port
        server.close()
    assert any("name is unknown" in w for w in _warnings(caplog))


def test_azure_survives_hostile_and_flaky_metadata(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watchers: list[PreemptionWatcher],
) -> None:
    caplog.set_level(logging.DEBUG, logger="spotckpt.preemption")
    monkeypatch.setenv("SPOTCKPT_AZURE_VM_NAME", VM)
    script: list[bytes | str] = [
        *("500", "500", "hang", "reset", "not-http"),
        b"{not json",
        b'{"Events": "none"}',
        b'{"Events": [1, 2]}',
        b"[" * 70_000,  # more than is ever read of one answer
        _events(),
        _events(_preempt([VM], 40)),
    ]
    server = _serve(script)
    try:
        watcher = _watch(monkeypatch, server, watchers)
        assert _wait_for(lambda: watcher.preempted, WAIT_S)
    finally:
        _stop(watchers)  # before its server goes: no poll meets a closed port
        server.close()
    assert watcher.reason == "azure:preempt"
    warnings = _warnings(caplog)
    assert len(warnings) == len(set(warnings))
    for kind in ("HTTP 500", "timed out", "BadStatusLine", "malformed scheduled events"):
        assert sum(kind in w for w in warnings) == 1, (kind, warnings)


def test_no_azure_service_is_quiet(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watchers: list[PreemptionWatcher],
) -> None:
    monkeypatch.setenv("SPOTCKPT_AZURE_METADATA_ENDPOINT", "http://127.0.0.1:9")
    caplog.set_level(logging.DEBUG, logger="spotckpt")
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, poll_interval_s=0.01)
    watchers.append(watcher.start())
    for thread in watcher._threads:
        thread.join(WAIT_S)
    assert not watcher.preempted and len(watcher._threads) == 1
    assert sum("Azure notices are off" in r.getMessage() for r in caplog.records) == 1


def test_azure_is_found_by_its_asset_tag(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, watchers: list[PreemptionWatcher]
) -> None:
    from spotckpt.preemption.azure import AZURE_ASSET_TAG, azure_metadata_endpoint

    monkeypatch.delenv("SPOTCKPT_AZURE_METADATA_ENDPOINT", raising=False)
    monkeypatch.setattr("spotckpt.preemption.dmi._DMI", tmp_path)
    (tmp_path / "sys_vendor").write_text("Microsoft Corporation\n")
    assert azure_metadata_endpoint() is None  # Hyper-V anywhere is not Azure
    (tmp_path / "chassis_asset_tag").write_text(f"{AZURE_ASSET_TAG}\n")
    assert azure_metadata_endpoint() == "http://169.254.169.254"


def test_the_azure_variables_are_not_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from spotckpt.config import Config

    monkeypatch.setenv("SPOTCKPT_URI", str(tmp_path / "ck"))
    monkeypatch.setenv("SPOTCKPT_AZURE_METADATA_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("SPOTCKPT_AZURE_VM_NAME", VM)
    assert Config.load(cwd=tmp_path).uri == str(tmp_path / "ck")
