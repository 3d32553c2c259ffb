"""The goodput event log: what saves, preemptions and restores cost, recorded in the bucket.

A module of its own because the log is storage and validation: every committed save, every
preemption and every restore leaves a small JSON object under ``<root>/events/`` (layout:
`spotckpt.layout`), written by the coordinator only, create-only, under a unique name. They
survive restarts, so the figures of a run add up over all its sessions. At most `max_events`
objects are kept: the oldest are folded into ``events/summary.json`` (counts, sums and a bounded
reservoir of recent values). `EventLog` writes and reads them, `Totals` is a run folded together
(what the interval model of `spotckpt.interval` is seeded with and what ``spotckpt stats`` of
`spotckpt.stats` shows); `spotckpt.tracker` is the manager's side of it. No torch.

Everything read back from ``events/`` may be corrupt or forged: each object is parsed with
bounded cost (`spotckpt.format.bounded_json`) and checked field by field (`event_problem`,
`summary_problem`); a malformed one is left out of every figure, with one warning per read that
names it. Figures that cannot be true are not used: an event counting more requests or bytes
than its recorded time could carry (`impossible_rates`); an event that would take the run's
checkpoint overhead above its training time (`impossible_overhead`). Such an event is rejected
(left out of every figure and counted, with a warning naming it); a summary whose sums break the
same rules is malformed.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from spotckpt.cost import PROVIDERS, provider
from spotckpt.errors import AlreadyExistsError, BoundedJSONError, ObjectNotFoundError
from spotckpt.format import bounded_json
from spotckpt.layout import (
    EVENT_SUMMARY_KEY,
    EVENTS_PREFIX,
    event_key,
    event_stamp,
    parse_event_key,
)
from spotckpt.storage.base import ObjectStore

log = logging.getLogger("spotckpt")

RESERVOIR = 256
"""Recent values kept per figure in ``events/summary.json`` (for medians and p95)."""
MAX_EVENT_BYTES = 64 << 10
MAX_SUMMARY_BYTES = 4 << 20
MAX_EVENT_SECONDS = 366 * 86400.0
"""The longest duration one event may record: no save, restore or stretch of training between
two events of a session lasts a year; a larger figure is corrupt or forged."""
MAX_TOTAL_SECONDS = 100 * MAX_EVENT_SECONDS
"""The largest sum of durations a summary may record (a century of training)."""
MAX_COUNT = 2**63 - 1
"""The largest count (steps, bytes, events) an event or a summary may record."""
MAX_REQUESTS_PER_S = 1e6
"""The most requests a whole job can make per second of the time an event records: far beyond
what an object store serves one bucket (S3 starts at 3,500 writes and 5,500 reads per second per
prefix, GCS at 1,000 and 5,000 per bucket, and both scale up gradually)."""
MAX_BYTES_PER_S = 1e14
"""The most bytes a whole job can move per second of an event's time (100 TB/s: 8,000 nodes at
100 Gbit/s each)."""
GRACE_S = 1.0
"""Seconds added to each event's recorded time before the rates above bound it (clock
granularity; the event's own PUT)."""
_READERS = 16
SUMMARY_FORMAT = "spotckpt-events-summary/1"


_DURATIONS = ("train_s", "stall_s", "upload_s", "restore_s", "emergency_save_s", "mirror_s")
_OVERHEAD = ("stall_s", "emergency_save_s", "restore_s")
_REQUESTS = ("write_requests", "read_requests", "delete_requests")
_MOVED = ("bytes_sent", "bytes_received", "mirror_bytes")


def impossible_rates(sums: Mapping[str, Any], events: int) -> str | None:
    """What cannot be true of the requests and bytes that `events` events count in the time
    they record (`sums`: one event's own fields, or a summary's sums), or None.

    The seconds an event records (training, stall, upload, restore, emergency save; overlaps
    counted twice, which only widens the bound), plus `GRACE_S`, at `MAX_REQUESTS_PER_S` and
    `MAX_BYTES_PER_S`, bound what it can have counted: more is a forged or corrupt figure. This
    also bounds the request cost per hour of the run (the rates times the prices).
    """
    seconds = sum(_number(sums.get(name)) or 0.0 for name in _DURATIONS) + GRACE_S * events
    requests = sum(_number(sums.get(name)) or 0.0 for name in _REQUESTS)
    moved = sum(_number(sums.get(name)) or 0.0 for name in _MOVED)
    if requests > MAX_REQUESTS_PER_S * seconds:
        return (
            f"{requests:.3g} requests in {seconds:.3g} s, above {MAX_REQUESTS_PER_S:g} per second"
        )
    if moved > MAX_BYTES_PER_S * seconds:
        return f"{moved:.3g} bytes in {seconds:.3g} s, above {MAX_BYTES_PER_S:g} per second"
    return None


def impossible_overhead(sums: Mapping[str, Any]) -> str | None:
    """What cannot be true of a run's summed figures (`Totals.sums`), or None: its checkpoint
    overhead (save stalls, emergency saves, restores) exceeding its training time.

    Each event's ``train_s`` is the wall time since the session's previous event, and stalls,
    emergency saves and restores are disjoint stretches of that time, so a run's overhead is at
    most its training time (an overhead share of at most 100 %; a relative 1e-9 for rounding).
    """
    overhead = sum(_number(sums.get(name)) or 0.0 for name in _OVERHEAD)
    training = _number(sums.get("train_s")) or 0.0
    if overhead > training * (1 + 1e-9) + 1e-6:
        return (
            f"checkpoint overhead of {overhead:.3g} s within {training:.3g} s of training "
            "(a share above 100 %)"
        )
    return None


# Events ------------------------------------------------------------------------------------------

REQUEST_FIELDS = (
    "write_requests",
    "read_requests",
    "delete_requests",
    "bytes_sent",
    "bytes_received",
)
"""What the job's stores counted (`spotckpt.storage.requests`) since the previous event, in the
save and restore events: so every request of a run is in exactly one event (gc, retention and
the fast tier's drain in the save or restore that follows or contains them)."""
PER_SAVE_FIELDS = ("write_requests", "read_requests", "delete_requests")
"""The request counts kept among a summary's recent values: the requests of one save."""
MIRROR_BYTES_TO = {name: f"mirror_bytes_to_{name}" for name in PROVIDERS}
"""The sums of a ``mirror`` event's bytes by the mirror's provider (`spotckpt.cost.provider`),
so that a run's egress is priced per provider pair after compaction too: the event's ``bytes``
and ``objects`` are summed as ``mirror_bytes`` and ``mirror_objects`` (a save's ``bytes`` are
another figure)."""
_RENAMED = {("mirror", "mirror_bytes"): "bytes", ("mirror", "mirror_objects"): "objects"}
"""Sums whose event field has another name (kind, sum name) -> field."""
MAX_MIRRORS_SHOWN = 32
"""Mirrors followed one by one in `Totals.mirrors` (events of more are in the sums only)."""
_SUMMED = {
    "save": ("train_s", "stall_s", "upload_s", "bytes", "referenced_bytes", *REQUEST_FIELDS),
    "preemption": ("train_s", "steps_lost", "emergency_save_s"),
    "restore": ("train_s", "restore_s", *REQUEST_FIELDS),
    "mirror": ("mirror_s", "mirror_bytes", "mirror_objects", *MIRROR_BYTES_TO.values()),
}
_RECENT: dict[str, tuple[str, ...]] = {
    "save": ("stall_s", "upload_s", *PER_SAVE_FIELDS),
    "preemption": ("emergency_save_s", "notice_left_s"),
    "restore": ("restore_s",),
    "mirror": (),
}
_EMERGENCY = (
    "emergency_estimate_s",
    "emergency_route",
    "emergency_window_s",
    "emergency_window_source",
)
"""The emergency estimate a save event carries (`spotckpt.deadline`): the latest is shown."""
_LAST = ("interval_steps", "step_time_s", "step", "time", *_EMERGENCY)
_SUM_NAMES = frozenset(name for names in _SUMMED.values() for name in names)
_RECENT_NAMES = frozenset(name for names in _RECENT.values() for name in names)
_COUNTED = frozenset(
    {
        "bytes",
        "referenced_bytes",
        "steps_lost",
        "mirror_bytes",
        "mirror_objects",
        *MIRROR_BYTES_TO.values(),
        *REQUEST_FIELDS,
    }
)


def _number(value: Any) -> float | None:
    """`value` as a float if it is a finite number (never a bool, nor an int beyond MAX_COUNT)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):
        return float(value) if -MAX_COUNT <= value <= MAX_COUNT else None
    return value if math.isfinite(value) else None


# Checking what is read back: each check names what is wrong with a value, or returns None.

_Check = Callable[[Any], "str | None"]
_JSON_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean"}


def _shown(value: Any) -> str:
    """A value for a message: numbers as they are, anything else by its type (never its text)."""
    if isinstance(value, int) and not -MAX_COUNT <= value <= MAX_COUNT:
        return "an integer beyond 2**63"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a JSON {_JSON_NAMES.get(type(value), type(value).__name__)}"


def _within(low: float, high: float) -> _Check:
    """A finite number in ``[low, high]`` (comparisons also refuse NaN and infinities)."""

    def check(value: Any) -> str | None:
        if _number(value) is not None and low <= value <= high:
            return None
        return f"must be a number from {low:g} to {high:g}, got {_shown(value)}"

    return check


def _whole(low: int) -> _Check:
    """An integer in ``[low, MAX_COUNT]``."""

    def check(value: Any) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_COUNT:
            return None
        return f"must be an integer from {low} to 2**63-1, got {_shown(value)}"

    return check


def _of_type(kind: type) -> _Check:
    def check(value: Any) -> str | None:
        if isinstance(value, kind):
            return None
        return f"must be a JSON {_JSON_NAMES[kind]}, got {_shown(value)}"

    return check


def _list_of(item: _Check) -> _Check:
    def check(value: Any) -> str | None:
        if not isinstance(value, list):
            return f"must be a list, got {_shown(value)}"
        problems = (item(x) for x in value)
        return next((f"an item {p}" for p in problems if p is not None), None)

    return check


def _short_text(value: Any) -> str | None:
    if isinstance(value, str) and len(value) <= 64 and value.isprintable():
        return None
    return f"must be a short printable string, got {_shown(value)}"


def _uri_text(value: Any) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= 1024 and value.isprintable():
        return None
    return f"must be a printable URI of at most 1024 characters, got {_shown(value)}"


def _event_name(value: Any) -> str | None:
    if isinstance(value, str) and parse_event_key(value) is not None:
        return None
    return f"must be the key of an event object, got {_shown(value)}"


_DURATION = _within(0.0, MAX_EVENT_SECONDS)
_EVENT_FIELDS: dict[str, _Check] = {
    "kind": _of_type(str),
    "emergency": _of_type(bool),
    "time": _of_type(str),
    **dict.fromkeys(("train_s", "stall_s", "upload_s", "emergency_save_s"), _DURATION),
    **dict.fromkeys(("restore_s", "step_time_s", "mirror_s", "seconds_behind"), _DURATION),
    "notice_left_s": _within(-MAX_EVENT_SECONDS, MAX_EVENT_SECONDS),  # negative: notice missed
    **dict.fromkeys(
        (
            "bytes",
            "referenced_bytes",
            "steps_lost",
            "step",
            "objects",
            "steps_behind",
            "failed_steps",
            *REQUEST_FIELDS,
        ),
        _whole(0),
    ),
    "interval_steps": _whole(1),
    **dict.fromkeys(("emergency_estimate_s", "emergency_window_s"), _DURATION),
    **dict.fromkeys(("emergency_route", "emergency_window_source"), _short_text),
    "mirror": _uri_text,
}
"""Every field that a figure reads, and what it must be when present and not null."""
_SUMMARY_TABLES: dict[str, dict[str, _Check]] = {
    "counts": dict.fromkeys(_SUMMED, _whole(0)),
    "sums": {
        name: _within(0.0, float(MAX_COUNT) if name in _COUNTED else MAX_TOTAL_SECONDS)
        for name in _SUM_NAMES
    },
    "recent": {  # counts are kept as numbers like the durations
        name: _list_of(_within(0.0, float(MAX_COUNT)) if name in _COUNTED else _EVENT_FIELDS[name])
        for name in _RECENT_NAMES
    },
    "last": {name: _EVENT_FIELDS[name] for name in _LAST},
}
_SUMMARY_FIELDS: dict[str, _Check] = {
    "events": _whole(0),
    "rejected": _whole(0),
    "through": _event_name,
    **dict.fromkeys(_SUMMARY_TABLES, _of_type(dict)),
}


def _fields_problem(document: Mapping[str, Any], checks: Mapping[str, _Check]) -> str | None:
    for name, check in checks.items():
        value = document.get(name)
        problem = None if value is None else check(value)
        if problem is not None:
            return f"{name}: {problem}"
    return None


def event_problem(document: Any) -> str | None:
    """What makes `document` no valid event, or None: a JSON object whose fields that figures
    read are of their type and within sane ranges (finite, non-negative, at most a year)."""
    if not isinstance(document, dict):
        return f"must be a JSON object, got {_shown(document)}"
    return _fields_problem(document, _EVENT_FIELDS)


def summary_problem(document: Any) -> str | None:
    """What makes `document` no valid ``events/summary.json``, or None (see `event_problem`;
    names that no figure reads are not checked, and `Totals.from_dict` drops them). Its sums
    must also be figures that can be true (`impossible_rates`, `impossible_overhead`)."""
    if not isinstance(document, dict):
        return f"must be a JSON object, got {_shown(document)}"
    problem = _fields_problem(document, _SUMMARY_FIELDS)
    for name, checks in _SUMMARY_TABLES.items():
        if problem is not None:
            return problem
        inner = _fields_problem(document.get(name) or {}, checks)
        problem = None if inner is None else f"{name}.{inner}"
    if problem is not None:
        return problem
    sums = document.get("sums") or {}
    problem = impossible_rates(sums, document.get("events") or 0) or impossible_overhead(sums)
    return None if problem is None else f"sums: {problem}"


@dataclass
class Totals:
    """Events folded together: counts by kind, sums, recent values, the latest figures."""

    counts: dict[str, int] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    recent: dict[str, list[float]] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)
    events: int = 0
    rejected: int = 0
    """Events left out of every figure: malformed, or with figures that cannot be true."""
    mirrors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per mirror (its URI, redacted), from the ``mirror`` events added one by one (not from a
    summary: compaction keeps the sums only): ``events``, ``bytes`` and the latest ``step``,
    ``steps_behind``, ``seconds_behind``, ``failed_steps`` and ``time``."""

    def problem_with(self, event: Mapping[str, Any]) -> str | None:
        """What cannot be true of `event` (checked with `event_problem` already) or of the run
        once it is added, or None: the rule of `impossible_rates` on the event's own figures,
        and of `impossible_overhead` on the run's sums with it."""
        own = _summed(event)
        grown = {name: self.sums.get(name, 0.0) + own.get(name, 0.0) for name in _OVERHEAD}
        grown["train_s"] = self.sums.get("train_s", 0.0) + own.get("train_s", 0.0)
        return impossible_rates({**event, **own}, 1) or impossible_overhead(grown)

    def add(self, event: Mapping[str, Any]) -> None:
        """Fold in one event (check it with `event_problem` and `problem_with` first); unknown
        kinds and malformed figures are skipped."""
        kind = event.get("kind")
        if not isinstance(kind, str) or kind not in _SUMMED:
            return
        self.events += 1
        self.counts[kind] = self.counts.get(kind, 0) + 1
        emergency = kind == "save" and event.get("emergency") is True
        for name, amount in _summed(event).items():
            self.sums[name] = self.sums.get(name, 0.0) + amount
        for name in () if emergency else _RECENT[kind]:
            value = _number(event.get(name))
            if value is not None:
                values = self.recent.setdefault(name, [])
                values.append(value)
                del values[:-RESERVOIR]
        if kind == "mirror":
            self._add_mirror(event)
            return  # its step and time are the mirror's, not the run's latest figures
        for name in _LAST:
            if event.get(name) is not None and (name != "interval_steps" or not emergency):
                self.last[name] = event[name]

    def _add_mirror(self, event: Mapping[str, Any]) -> None:
        name = event.get("mirror")
        if not isinstance(name, str):
            return
        if name not in self.mirrors and len(self.mirrors) >= MAX_MIRRORS_SHOWN:
            return
        row = self.mirrors.setdefault(name, {"events": 0, "bytes": 0})
        row["events"] += 1
        row["bytes"] += int(_number(event.get("bytes")) or 0)
        for latest in ("step", "steps_behind", "seconds_behind", "failed_steps", "time"):
            if latest in event and (latest != "step" or event[latest] is not None):
                row[latest] = event[latest]

    def last_number(self, name: str) -> float | None:
        """A latest figure if it is a positive number."""
        value = _number(self.last.get(name))
        return value if value is not None and value > 0 else None

    def to_dict(self) -> dict[str, Any]:
        """The summary document (without ``through``)."""
        return {
            "format": SUMMARY_FORMAT,
            "events": self.events,
            "rejected": self.rejected,
            "counts": dict(self.counts),
            "sums": dict(self.sums),
            "recent": {k: list(v) for k, v in self.recent.items()},
            "last": dict(self.last),
        }

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> Totals:
        """Totals from a summary document (check it with `summary_problem` first); malformed
        parts and names that no figure reads are dropped."""

        def table(name: str, known: Iterable[str]) -> dict[str, Any]:
            value = document.get(name)
            return {k: v for k, v in value.items() if k in known} if isinstance(value, dict) else {}

        counts = {k: int(v) for k, v in table("counts", _SUMMED).items() if _number(v) is not None}
        sums = {k: float(v) for k, v in table("sums", _SUM_NAMES).items() if _number(v) is not None}
        recent = {
            k: [x for x in v if _number(x) is not None][-RESERVOIR:]
            for k, v in table("recent", _RECENT_NAMES).items()
            if isinstance(v, list)
        }
        events = _number(document.get("events"))
        rejected = _number(document.get("rejected"))
        last = table("last", _LAST)
        return cls(
            counts,
            sums,
            recent,
            last,
            int(events) if events is not None else 0,
            int(rejected) if rejected is not None else 0,
        )


def _summed(event: Mapping[str, Any]) -> dict[str, float]:
    """What `event` adds to a run's sums (an emergency save's stall and upload are counted by
    its preemption event instead)."""
    kind = event.get("kind")
    if not isinstance(kind, str) or kind not in _SUMMED:
        return {}
    emergency = kind == "save" and event.get("emergency") is True
    found = {}
    for name in _SUMMED[kind]:
        value = _number(event.get(_RENAMED.get((kind, name), name)))
        if value is not None and not (emergency and name in ("stall_s", "upload_s")):
            found[name] = value
    if kind == "mirror":
        for name in MIRROR_BYTES_TO.values():
            found.pop(name, None)
        target, moved = event.get("mirror"), _number(event.get("bytes"))
        if isinstance(target, str) and moved is not None:
            found[MIRROR_BYTES_TO[provider(target)]] = moved
    return found


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


class EventLog:
    """The events of one checkpoint root; `writer` names this session's events."""

    def __init__(self, store: ObjectStore, max_events: int = 500, writer: str | None = None):
        self.store = store
        self.max_events = max_events
        self.writer = writer if writer is not None else uuid.uuid4().hex[:8]
        self._number = 0
        self._room: int | None = None
        self._lock = threading.Lock()  # the mirror thread records events beside the loop

    # Writing ----------------------------------------------------------------------------------

    def record(self, event: dict[str, Any], *, compact: bool = True) -> str:
        """Write one event (adds ``time``), create-only; compacts when the bound is near.

        Raises StorageError; callers treat that as a warning. Safe from several threads.
        """
        with self._lock:
            return self._record(event, compact)

    def _record(self, event: dict[str, Any], compact: bool) -> str:
        event.setdefault("time", _now_iso())
        data = json.dumps(event, sort_keys=True, default=str).encode()
        while True:
            self._number += 1
            key = event_key(
                event_stamp(datetime.now(timezone.utc)), event["kind"], self.writer, self._number
            )
            try:
                self.store.put(key, data, create_only=True)
                break
            except AlreadyExistsError:
                continue  # another writer's event of the same name: take the next number
        if self._room is not None:
            self._room -= 1
        if compact and (self._room is None or self._room <= 0):
            self.compact()
        return key

    def event_keys(self) -> list[str]:
        """Keys of the event objects (not the summary), oldest first."""
        keys = [i.key for i in self.store.list(EVENTS_PREFIX) if parse_event_key(i.key)]
        return sorted(keys)

    def compact(self) -> int:
        """Fold the oldest events into the summary when at most one slot is left; returns how
        many were folded. Leaves room for one more event (a preemption never compacts)."""
        keys = self.event_keys()
        folded = 0
        if len(keys) >= self.max_events - 1:
            fold = keys[: len(keys) - self.max_events // 2]
            totals, through = self.read_summary()
            self._fold(totals, (k for k in fold if through is None or k > through))
            self.store.put(
                EVENT_SUMMARY_KEY,
                json.dumps({**totals.to_dict(), "through": fold[-1]}, sort_keys=True).encode(),
            )
            self.store.delete_many(fold)  # after the summary: a crash between them counts once
            folded = len(fold)
            log.debug("compacted %d events into %s", folded, EVENT_SUMMARY_KEY)
        self._room = self.max_events - 1 - (len(keys) - folded)
        return folded

    # Reading ----------------------------------------------------------------------------------

    def read_summary(self) -> tuple[Totals, str | None]:
        """The summary's totals and the newest event key folded into it. A malformed summary
        counts as none (with a warning); the next compaction writes a good one over it."""
        document, problem = _read_checked(
            self.store, EVENT_SUMMARY_KEY, MAX_SUMMARY_BYTES, summary_problem
        )
        _report_malformed([(EVENT_SUMMARY_KEY, problem)] if problem is not None else [])
        if document is None:
            return Totals(), None
        through = document.get("through")
        return Totals.from_dict(document), through if isinstance(through, str) else None

    def totals(self) -> Totals:
        """Everything recorded: the summary plus every event not yet folded into it."""
        totals, through = self.read_summary()
        self._fold(totals, (k for k in self.event_keys() if through is None or k > through))
        return totals

    def _fold(self, totals: Totals, keys: Iterable[str]) -> None:
        """Add the events under `keys` to `totals`, in key order. Gone ones are skipped;
        malformed ones (`event_problem`) and those whose figures cannot be true
        (`Totals.problem_with`) are left out, counted in ``totals.rejected``, with one warning
        for each kind per read."""
        listed = list(keys)
        with ThreadPoolExecutor(min(_READERS, max(1, len(listed)))) as pool:
            results = list(pool.map(self._read_one, listed))
        malformed, impossible = [], []
        for key, (document, problem) in zip(listed, results, strict=True):
            if problem is not None:
                malformed.append((key, problem))
            elif document is not None:
                problem = totals.problem_with(document)
                if problem is None:
                    totals.add(document)
                else:
                    impossible.append((key, problem))
        totals.rejected += len(malformed) + len(impossible)
        _report_malformed(malformed)
        _report_impossible(impossible)

    def _read_one(self, key: str) -> tuple[dict[str, Any] | None, str | None]:
        return _read_checked(self.store, key, MAX_EVENT_BYTES, event_problem)


def _read_checked(
    store: ObjectStore, key: str, limit: int, problem_of: _Check
) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object at `key` if it is at most `limit` bytes, parses within the bounds of
    `bounded_json` and passes `problem_of`; else None and what is wrong (None for a gone one)."""
    try:
        data = store.get_range(key, 0, limit + 1)
    except ObjectNotFoundError:
        return None, None
    if len(data) > limit:
        return None, f"larger than {limit} bytes"
    try:
        document = bounded_json.loads(data, "the object")
    except BoundedJSONError as error:
        return None, str(error)
    problem = problem_of(document)
    return (None, problem) if problem is not None else (document, None)


def _report_malformed(skipped: list[tuple[str, str]]) -> None:
    """One warning for all the malformed objects of one read, naming the first."""
    if not skipped:
        return
    key, problem = skipped[0]
    others = f" and {len(skipped) - 1} more" if len(skipped) > 1 else ""
    log.warning(
        "ignoring malformed goodput record %s (%s)%s: left out of the goodput figures and the "
        "auto interval; spotckpt never writes such objects, so check who can write to the "
        "bucket and delete them",
        key,
        problem,
        others,
    )


def _report_impossible(rejected: list[tuple[str, str]], named: int = 10) -> None:
    """One warning for the events of one read whose figures cannot be true, naming each (the
    first `named` of them)."""
    if not rejected:
        return
    listed = "; ".join(f"{key} ({problem})" for key, problem in rejected[:named])
    more = f"; and {len(rejected) - named} more" if len(rejected) > named else ""
    log.warning(
        "rejected %d goodput event(s) whose figures cannot be true: %s%s. They are left out of "
        "the goodput figures, the request costs and the auto interval; spotckpt never writes "
        "such events, so check who can write to the bucket and delete them",
        len(rejected),
        listed,
        more,
    )


__all__ = [
    "MIRROR_BYTES_TO",
    "PER_SAVE_FIELDS",
    "REQUEST_FIELDS",
    "EventLog",
    "Totals",
    "event_problem",
    "summary_problem",
]
