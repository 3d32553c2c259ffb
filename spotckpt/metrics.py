"""Metrics writers for ``CheckpointManager(metrics=...)``.

The manager (on the coordinator) calls ``metrics(record)`` once per committed save, restore and
preemption with the same dict that it records as an event, e.g. ``{"kind": "save", "step": 400,
"stall_s": 0.21, "upload_s": 3.4, "bytes": 1048576, "throughput_bytes_per_s": ..., "async": True,
"emergency": False, "train_s": ..., "step_time_s": 0.05, "interval_steps": 200, ...}``. Any
callable works; a callable that raises is logged once and never breaks training.

- `JsonLinesMetrics(path)`: appends one JSON line per record.
- `PrometheusTextfileMetrics(path)`: rewrites a node-exporter textfile atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, TypeGuard

__all__ = ["JsonLinesMetrics", "PrometheusTextfileMetrics"]


class JsonLinesMetrics:
    """Appends each record to `path` as one JSON line (the folder is created if needed)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True, default=str) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(line)


_GAUGES = {
    "spotckpt_last_save_stall_seconds": "Seconds the training loop was blocked by the last save.",
    "spotckpt_last_save_upload_seconds": "Seconds the last save took to upload and commit.",
    "spotckpt_last_save_bytes": "Bytes of the last committed checkpoint.",
    "spotckpt_last_save_step": "Step of the last committed checkpoint.",
    "spotckpt_last_restore_seconds": "Seconds the last restore took.",
    "spotckpt_last_emergency_save_seconds": "Seconds the last emergency (preemption) save took.",
    "spotckpt_step_time_seconds": "Mean measured training step time.",
    "spotckpt_interval_steps": "Current checkpoint interval in steps.",
}
_COUNTERS = {
    "spotckpt_saves_total": "Committed saves by this process.",
    "spotckpt_restores_total": "Restores by this process.",
    "spotckpt_evictions_total": "Preemptions handled by this process.",
    "spotckpt_steps_lost_total": "Steps lost to preemptions (step at notice minus step saved).",
}
_SAVE_GAUGES = {
    "spotckpt_last_save_stall_seconds": "stall_s",
    "spotckpt_last_save_upload_seconds": "upload_s",
    "spotckpt_last_save_bytes": "bytes",
    "spotckpt_last_save_step": "step",
}


class PrometheusTextfileMetrics:
    """Keeps gauges and counters and rewrites `path` (a ``.prom`` file) after every record.

    The file is written to a temporary name in the same folder and renamed over `path`, so the
    node exporter never reads half a file (its textfile collector reads ``*.prom`` only, and the
    temporary name does not end so). Point the exporter at the folder::

        node_exporter --collector.textfile.directory=/var/lib/node_exporter/textfile
        CheckpointManager(uri, metrics=PrometheusTextfileMetrics(
            "/var/lib/node_exporter/textfile/spotckpt.prom"))

    Series: ``spotckpt_last_save_stall_seconds``, ``spotckpt_last_save_upload_seconds``,
    ``spotckpt_last_save_bytes``, ``spotckpt_last_save_step``, ``spotckpt_last_restore_seconds``,
    ``spotckpt_last_emergency_save_seconds``, ``spotckpt_step_time_seconds``,
    ``spotckpt_interval_steps`` (gauges) and ``spotckpt_saves_total``,
    ``spotckpt_restores_total``, ``spotckpt_evictions_total``, ``spotckpt_steps_lost_total``
    (counters, per process: they start at 0 in a new process, which Prometheus reads as a reset).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.values: dict[str, float] = dict.fromkeys(_COUNTERS, 0.0)
        self._lock = threading.Lock()

    def __call__(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._update(record)
            self._write()

    def _update(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "save":
            self.values["spotckpt_saves_total"] += 1
            for name, field in _SAVE_GAUGES.items():
                self._set(name, record.get(field))
        elif kind == "restore":
            self.values["spotckpt_restores_total"] += 1
            self._set("spotckpt_last_restore_seconds", record.get("restore_s"))
        elif kind == "preemption":
            self.values["spotckpt_evictions_total"] += 1
            lost = record.get("steps_lost")
            if _is_number(lost):
                self.values["spotckpt_steps_lost_total"] += lost
            self._set("spotckpt_last_emergency_save_seconds", record.get("emergency_save_s"))
        self._set("spotckpt_step_time_seconds", record.get("step_time_s"))
        self._set("spotckpt_interval_steps", record.get("interval_steps"))

    def _set(self, name: str, value: Any) -> None:
        if _is_number(value):
            self.values[name] = float(value)

    def render(self) -> str:
        """The textfile's content in the Prometheus text exposition format."""
        lines = []
        for kind, table in (("gauge", _GAUGES), ("counter", _COUNTERS)):
            for name, help_text in table.items():
                if name in self.values:
                    lines += [
                        f"# HELP {name} {help_text}",
                        f"# TYPE {name} {kind}",
                        f"{name} {self.values[name]!r}",
                    ]
        return "\n".join(lines) + "\n"

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(self.render())
            os.chmod(
                temporary, 0o644
            )  # mkstemp makes it 0600; the exporter may run as another user
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
