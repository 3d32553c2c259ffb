"""Goodput: what checkpointing costs, recorded as events, and the checkpoint interval it implies.

Three parts, none of which imports torch:

- Events (`EventLog`): every committed save, every preemption and every restore leaves a small
  JSON object under ``<root>/events/`` (layout: `spotckpt.catalog`), written by the coordinator
  only, create-only, under a unique name. They survive restarts, so the figures of a run add up
  over all its sessions. At most `max_events` objects are kept: the oldest are folded into
  ``events/summary.json`` (counts, sums and a bounded reservoir of recent values).
- The interval model (`IntervalModel`): the mean step time, the save cost (the seconds the
  training loop was blocked, not the background upload) and the eviction rate give the interval
  of Daly's higher-order formula (`daly_interval_s`), in steps, for ``interval_steps="auto"``.
- Statistics (`GoodputStats`, `load_stats`): what ``spotckpt stats`` prints.

Everything read back from ``events/`` may be corrupt or forged: each object is parsed with
bounded cost (`spotckpt.format.bounded_json`) and checked field by field (`event_problem`,
`summary_problem`); a malformed one is left out of every figure, with one warning per read that
names it. The interval is always within ``[max(1, min_interval_steps), max_interval_steps]``
(the ceiling defaults to `spotckpt.config.DEFAULT_MAX_INTERVAL_STEPS`), and figures that cannot
be true are not used: a mean time between evictions below the step time or the save stall
(`possible_figures`); an event counting more requests or bytes than its recorded time could
carry (`impossible_rates`); an event that would take the run's checkpoint overhead above its
training time (`impossible_overhead`). Such an event is rejected (left out of every figure and
counted, with a warning naming it); a summary whose sums break the same rules is malformed.

The model of `expected_goodput` and `daly_interval_s` (J. T. Daly, "A higher order estimate of
the optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22, 2006)
assumes failures without notice. A spot eviction usually comes with one, and spotckpt then saves
the current step, so it loses less than the model says: the estimate is conservative.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from spotckpt.catalog import (
    EVENT_SUMMARY_KEY,
    EVENTS_PREFIX,
    event_key,
    event_stamp,
    parse_event_key,
)
from spotckpt.config import DEFAULT_MAX_INTERVAL_STEPS, Settings
from spotckpt.cost import DEFAULT_PRICES, PriceTable
from spotckpt.errors import (
    AlreadyExistsError,
    BoundedJSONError,
    ObjectNotFoundError,
    StorageError,
)
from spotckpt.format import bounded_json
from spotckpt.storage.base import ObjectStore
from spotckpt.storage.requests import RequestTally
from spotckpt.units import human_size

log = logging.getLogger("spotckpt")

PRIOR_EVICTIONS_PER_HOUR = 0.5
"""The eviction rate assumed before a run has observed any: one eviction per two hours.

Not a measured figure but a deliberately pessimistic starting point (it errs towards saving too
often, which costs a little overhead, rather than too rarely, which can cost hours). Published
figures are lower: AWS's Spot Instance Advisor groups instance types by the share of instances
interrupted per month (<5 %, 5-10 %, 10-15 %, 15-20 %, >20 %), and GCE preemptible VMs stop after
24 hours at the latest (at least 1/24 per hour). It weighs as much as `PRIOR_WEIGHT_HOURS` of
observed training, so a run's own evictions soon outweigh it (see `eviction_rate`).
"""
PRIOR_WEIGHT_HOURS = 2.0
"""Hours of training that the prior counts for in `eviction_rate`."""
MIN_SAVES_FOR_FIGURES = 3
MIN_TRAINING_S_FOR_FIGURES = 600.0
"""``spotckpt stats`` shows the overhead, the suggested interval and the goodput estimate only
from this many saves over this much training; below, it says "too little data": in a short run
the first save, a restore and start-up weigh as much as hours of training."""
STARTING_INTERVAL_STEPS = 100
"""The ``"auto"`` interval until a step time and a save cost are measured (clamped to bounds)."""
MIN_STEP_SAMPLES = 3
"""Step durations measured before the session's own step time replaces a recorded one."""
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
_STEP_WINDOW = 64
_SAVE_WINDOW = 16
_READERS = 16
SUMMARY_FORMAT = "spotckpt-events-summary/1"

# The model ---------------------------------------------------------------------------------------


def daly_interval_s(delta_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints.

    For checkpoint cost δ and mean time between failures M: ``sqrt(2δM)·[1 + (1/3)·sqrt(δ/(2M))
    + (1/9)·(δ/(2M))] - δ`` when δ < 2M, else M.
    """
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta_s


def clamp_interval(steps: float, minimum: int = 1, maximum: int | None = None) -> int:
    """`steps` rounded and clamped to ``[max(1, minimum), maximum]``; `maximum` None is
    `DEFAULT_MAX_INTERVAL_STEPS`, never unbounded. Infinity is the ceiling, NaN the floor."""
    ceiling = DEFAULT_MAX_INTERVAL_STEPS if maximum is None else maximum
    if not math.isfinite(steps):
        steps = ceiling if steps > 0 else minimum
    return min(max(minimum, 1, round(steps)), ceiling)


def interval_steps_for(
    delta_s: float,
    mtbf_s: float,
    step_time_s: float,
    minimum: int = 1,
    maximum: int | None = None,
) -> int:
    """Daly's interval in steps: ``round(τ_opt / step_time)``, clamped to the bounds."""
    return clamp_interval(daly_interval_s(delta_s, mtbf_s) / step_time_s, minimum, maximum)


def possible_figures(mtbf_s: float, step_time_s: float | None, save_cost_s: float | None) -> bool:
    """Whether a mean time between evictions can be true beside a step time and a save stall.

    Evictions more often than steps, or saves that block longer than the time between evictions,
    would leave a run that never progresses: such figures come from corrupt or forged events.
    """
    if not (math.isfinite(mtbf_s) and mtbf_s > 0):
        return False
    return all(
        figure is None or (math.isfinite(figure) and 0 <= figure <= mtbf_s)
        for figure in (step_time_s, save_cost_s)
    )


_DURATIONS = ("train_s", "stall_s", "upload_s", "restore_s", "emergency_save_s")
_OVERHEAD = ("stall_s", "emergency_save_s", "restore_s")
_REQUESTS = ("write_requests", "read_requests", "delete_requests")


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
    moved = sum(_number(sums.get(name)) or 0.0 for name in ("bytes_sent", "bytes_received"))
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


def expected_goodput(delta_s: float, mtbf_s: float, tau_s: float, restart_s: float = 0.0) -> float:
    """Expected share of wall-clock time spent on useful work (Daly's model, exponential
    failures): ``τ / (M·e^{R/M}·(e^{(τ+δ)/M} - 1))`` for interval τ, cost δ, restart R."""
    if tau_s <= 0:
        return 0.0
    if math.isinf(mtbf_s):
        return tau_s / (tau_s + delta_s)
    try:
        wall = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((tau_s + delta_s) / mtbf_s)
    except OverflowError:
        return 0.0
    return tau_s / wall if wall > 0 else tau_s / (tau_s + delta_s)  # wall underflowed: its limit


def eviction_rate(evictions: int, training_s: float, configured: float | None = None) -> float:
    """Evictions per hour: `configured`, else the observed rate shrunk towards the prior.

    ``(evictions + prior·w) / (hours + w)`` with w = `PRIOR_WEIGHT_HOURS`: the posterior mean of a
    Poisson rate under a gamma prior of mean `PRIOR_EVICTIONS_PER_HOUR`. It is the prior for a
    new run and tends to the observed rate as training hours add up.
    """
    if configured is not None:
        return configured
    hours = max(0.0, training_s) / 3600
    return (evictions + PRIOR_EVICTIONS_PER_HOUR * PRIOR_WEIGHT_HOURS) / (
        hours + PRIOR_WEIGHT_HOURS
    )


@dataclass
class Figures:
    """What the interval is chosen from; None where not measured yet."""

    step_time_s: float | None
    save_cost_s: float | None
    evictions_per_hour: float

    @property
    def mtbf_s(self) -> float:
        """Mean time between evictions."""
        return 3600 / self.evictions_per_hour


class IntervalModel:
    """Measures step time and save cost, and chooses the checkpoint interval from them.

    Call `observe_step` at every ``maybe_save``, `record_stall` after each save with the seconds
    the loop was blocked, `seed` with a run's recorded `Totals`, and `update` to recompute. The
    step time is the time between `observe_step` calls less the stalls recorded in between; the
    first call only starts the measurement (so does the first after `restart_measurement`).
    `clock` (monotonic seconds) may be replaced, e.g. by a test's fake clock. The interval stays
    within ``[max(1, min_interval_steps), max_interval_steps]`` (None: the default ceiling).
    """

    def __init__(
        self,
        *,
        eviction_rate_per_hour: float | None = None,
        min_interval_steps: int = 1,
        max_interval_steps: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.configured_rate = eviction_rate_per_hour
        self.minimum = min_interval_steps
        self.maximum = (
            DEFAULT_MAX_INTERVAL_STEPS if max_interval_steps is None else max_interval_steps
        )
        self.clock = clock
        self.history = Totals()
        self.interval_steps = clamp_interval(STARTING_INTERVAL_STEPS, self.minimum, self.maximum)
        self._started = clock()
        self._marked = self._started
        self._steps: deque[float] = deque(maxlen=_STEP_WINDOW)
        self._stalls: deque[float] = deque(maxlen=_SAVE_WINDOW)
        self._last: tuple[int, float] | None = None
        self._paused = 0.0
        self._warned: set[str] = set()

    def observe_step(self, step: int) -> None:
        """Note that `step` is done now; measures the time per step since the previous call."""
        now = self.clock()
        if self._last is not None and step > self._last[0]:
            per_step = (now - self._last[1] - self._paused) / (step - self._last[0])
            if per_step > 0:
                self._steps.append(per_step)
        self._last, self._paused = (step, now), 0.0

    def restart_measurement(self) -> None:
        """Forget the previous step's time (after a restore: the next call starts anew)."""
        self._last, self._paused = None, 0.0

    def record_stall(self, seconds: float, *, periodic: bool = True) -> None:
        """A save blocked the loop for `seconds`; a periodic one also counts as the save cost."""
        self._paused += seconds
        if periodic:
            self._stalls.append(seconds)

    def seed(self, history: Totals) -> None:
        """Use a run's recorded events: evictions, training time, step time, save cost."""
        self.history = history

    def take_training_s(self) -> float:
        """Seconds of this session since the previous call (or since the model was made)."""
        now = self.clock()
        elapsed, self._marked = now - self._marked, now
        return max(0.0, elapsed)

    @property
    def step_time_s(self) -> float | None:
        """This session's mean step time, else the last recorded one, else None."""
        if len(self._steps) >= MIN_STEP_SAMPLES:
            return statistics.fmean(self._steps)
        return self.history.last_number("step_time_s")

    @property
    def save_cost_s(self) -> float | None:
        """Mean recent stall of this session's periodic saves, else the recorded median."""
        if self._stalls:
            return statistics.fmean(self._stalls)
        return median(self.history.recent.get("stall_s", []))

    def figures(self) -> Figures:
        """The current figures; an observed eviction rate that cannot be true (see
        `possible_figures`) gives way to the prior."""
        step_time_s, save_cost_s = self.step_time_s, self.save_cost_s
        return Figures(step_time_s, save_cost_s, self._eviction_rate(step_time_s, save_cost_s))

    def _eviction_rate(self, step_time_s: float | None, save_cost_s: float | None) -> float:
        if self.configured_rate is not None:
            return self.configured_rate
        training_s = self.history.sums.get("train_s", 0.0) + (self.clock() - self._started)
        observed = eviction_rate(self.history.counts.get("preemption", 0), training_s)
        if possible_figures(3600 / observed, step_time_s, save_cost_s):
            return observed
        self._warn_once(
            "rate",
            "the run's events give a mean time between evictions of %.3g s, below the step time "
            "(%s) or the save stall (%s): that cannot be true, so the prior rate of %s per hour "
            "is used instead",
            3600 / observed,
            _seconds(step_time_s),
            _seconds(save_cost_s),
            PRIOR_EVICTIONS_PER_HOUR,
        )
        return PRIOR_EVICTIONS_PER_HOUR

    def _warn_once(self, reason: str, message: str, *args: object) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning(message, *args)

    def update(self) -> int:
        """Recompute the interval; logs one INFO line when it changes. Returns it. Figures that
        cannot be true (see `possible_figures`) leave the interval as it is, with a warning."""
        figures = self.figures()
        if figures.step_time_s is None or figures.save_cost_s is None:
            return self.interval_steps
        if not possible_figures(figures.mtbf_s, figures.step_time_s, figures.save_cost_s):
            self._warn_once(
                "figures",
                "auto checkpoint interval kept at %d steps: a mean time between evictions of "
                "M=%.0f s is below the step time %.4f s or the save cost δ=%.3f s (if "
                "eviction_rate_per_hour is set, check it)",
                self.interval_steps,
                figures.mtbf_s,
                figures.step_time_s,
                figures.save_cost_s,
            )
            return self.interval_steps
        chosen = interval_steps_for(
            figures.save_cost_s, figures.mtbf_s, figures.step_time_s, self.minimum, self.maximum
        )
        if chosen != self.interval_steps:
            log.info(
                "auto checkpoint interval: %d -> %d steps (save cost δ=%.3f s, mean time between "
                "evictions M=%.0f s, step time %.4f s)",
                self.interval_steps,
                chosen,
                figures.save_cost_s,
                figures.mtbf_s,
                figures.step_time_s,
            )
            self.interval_steps = chosen
        return chosen


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
_PER_SAVE = ("write_requests", "read_requests", "delete_requests")
_SUMMED = {
    "save": ("train_s", "stall_s", "upload_s", "bytes", "referenced_bytes", *REQUEST_FIELDS),
    "preemption": ("train_s", "steps_lost", "emergency_save_s"),
    "restore": ("train_s", "restore_s", *REQUEST_FIELDS),
}
_RECENT = {
    "save": ("stall_s", "upload_s", *_PER_SAVE),
    "preemption": ("emergency_save_s", "notice_left_s"),
    "restore": ("restore_s",),
}
_LAST = ("interval_steps", "step_time_s", "step", "time")
_SUM_NAMES = frozenset(name for names in _SUMMED.values() for name in names)
_RECENT_NAMES = frozenset(name for names in _RECENT.values() for name in names)
_COUNTED = frozenset({"bytes", "referenced_bytes", "steps_lost", *REQUEST_FIELDS})


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
    **dict.fromkeys(("restore_s", "step_time_s"), _DURATION),
    "notice_left_s": _within(-MAX_EVENT_SECONDS, MAX_EVENT_SECONDS),  # negative: notice missed
    **dict.fromkeys(
        ("bytes", "referenced_bytes", "steps_lost", "step", *REQUEST_FIELDS), _whole(0)
    ),
    "interval_steps": _whole(1),
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


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values."""
    ordered = sorted(values)
    return statistics.median(ordered) if ordered else None


def p95(values: Iterable[float]) -> float | None:
    """The 95th percentile (nearest rank), or None for no values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)] if ordered else None


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

    def problem_with(self, event: Mapping[str, Any]) -> str | None:
        """What cannot be true of `event` (checked with `event_problem` already) or of the run
        once it is added, or None: the rule of `impossible_rates` on the event's own figures,
        and of `impossible_overhead` on the run's sums with it."""
        own = _summed(event)
        grown = {name: self.sums.get(name, 0.0) + own.get(name, 0.0) for name in _OVERHEAD}
        grown["train_s"] = self.sums.get("train_s", 0.0) + own.get("train_s", 0.0)
        return impossible_rates(event, 1) or impossible_overhead(grown)

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
        for name in _LAST:
            if event.get(name) is not None and (name != "interval_steps" or not emergency):
                self.last[name] = event[name]

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
        value = _number(event.get(name))
        if value is not None and not (emergency and name in ("stall_s", "upload_s")):
            found[name] = value
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

    # Writing ----------------------------------------------------------------------------------

    def record(self, event: dict[str, Any], *, compact: bool = True) -> str:
        """Write one event (adds ``time``), create-only; compacts when the bound is near.

        Raises StorageError; callers treat that as a warning.
        """
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


# The manager's hooks -----------------------------------------------------------------------------


class GoodputTracker:
    """What `CheckpointManager` does for goodput: the interval, events and metrics.

    Every rank measures and decides (the manager makes the ranks agree on the coordinator's
    interval); only the coordinator writes events and calls `metrics`. Nothing here can fail a
    save: event writes that fail are warnings, a metrics callable that raises is logged once.
    """

    def __init__(self, store: ObjectStore, settings: Settings, *, is_coordinator: bool) -> None:
        self.auto = settings.interval_steps == "auto"
        self.fixed = None if settings.interval_steps == "auto" else settings.interval_steps
        self.model = IntervalModel(
            eviction_rate_per_hour=settings.eviction_rate_per_hour,
            min_interval_steps=settings.min_interval_steps,
            max_interval_steps=settings.max_interval_steps,
        )
        self.events = EventLog(store, settings.max_events) if is_coordinator else None
        self.metrics: Callable[[dict[str, Any]], Any] | None = settings.metrics
        self.last_started_step = 0
        self.last_committed_step: int | None = None
        self._metrics_failed = False

    @property
    def interval_steps(self) -> int | None:
        """The current interval: the fixed one, or the one ``"auto"`` chose."""
        return self.model.interval_steps if self.auto else self.fixed

    def due(self, step: int) -> bool:
        """Whether `maybe_save` saves `step`: on the fixed interval, or for ``"auto"`` when at
        least the chosen number of steps passed since the last save (or the restored step)."""
        interval = self.interval_steps
        if interval is None:
            return False
        if self.auto:
            return step - self.last_started_step >= interval
        return step % interval == 0

    def observe_step(self, step: int) -> None:
        """At every `maybe_save`: measures the step time."""
        self.model.observe_step(step)

    def stalled(self, step: int, seconds: float, *, emergency: bool) -> None:
        """A save of `step` blocked the loop for `seconds` (staging, for an async save)."""
        self.last_started_step = step
        self.model.record_stall(seconds, periodic=not emergency)

    def recompute(self) -> None:
        """Recompute the ``"auto"`` interval from the current figures."""
        if self.auto:
            self.model.update()

    def adopt(self, interval: int) -> None:
        """Use the coordinator's choice (ranks must agree on when to save)."""
        self.model.interval_steps = interval

    def committed(
        self,
        step: int,
        *,
        stall_s: float,
        upload_s: float,
        size: int | None,
        asynchronous: bool,
        emergency: bool,
        referenced: int | None = None,
        requests: RequestTally | None = None,
        digest: str | None = None,
    ) -> None:
        """A save of `step` committed: record it (`size`: bytes it wrote; `referenced`: bytes
        an incremental save referenced in earlier steps instead; its `spotckpt.digest` when
        known), with the job's `requests` since the last event (None: its store does not count
        them)."""
        self.last_committed_step = step
        event: dict[str, Any] = {
            "kind": "save",
            "step": step,
            "stall_s": stall_s,
            "upload_s": upload_s,
            "bytes": size,
            "referenced_bytes": referenced,
            "throughput_bytes_per_s": size / upload_s if size and upload_s > 0 else None,
            "async": asynchronous,
            "emergency": emergency,
            "digest": digest,
        }
        self._publish(event | (requests.to_dict() if requests is not None else {}))

    def preempted(
        self,
        *,
        source: str,
        notice_left_s: float | None,
        step: int,
        emergency_save_s: float,
        refused: str | None = None,
    ) -> None:
        """A preemption was handled at `step`: record what was saved and what was lost (and,
        when an integrity check refused the emergency save, why)."""
        saved = self.last_committed_step
        event: dict[str, Any] = {
            "kind": "preemption",
            "source": source,
            "notice_left_s": notice_left_s,
            "step_at_notice": step,
            "step_saved": saved,
            "steps_lost": step - (saved if saved is not None else 0),
            "emergency_save_s": emergency_save_s,
        }
        if refused is not None:
            event["emergency_save_refused"] = refused
        self._publish(event, compact=False)  # the deadline is near: no listing now

    def refused(self, step: int, check: str, reason: str, *, emergency: bool) -> None:
        """An integrity check (`check`: ``replicas`` or ``health``) refused the save of `step`:
        nothing was committed. Recorded without the goodput figures (no save happened)."""
        event = {
            "kind": "refused",
            "step": step,
            "check": check,
            "reason": reason[:2000],
            "emergency": emergency,
        }
        self._publish(event, figures=False)

    def restored(
        self, step: int | None, seconds: float, requests: RequestTally | None = None
    ) -> None:
        """`restore` finished (`step` None: nothing to restore); for ``"auto"`` the run's
        recorded events seed the model (the manager then recomputes the interval). `requests`:
        as for `committed`."""
        if step is not None:
            self.last_started_step = step
            self.last_committed_step = step
        self.model.restart_measurement()
        if self.auto and self.events is not None:
            try:
                self.model.seed(self.events.totals())
            except StorageError as error:
                log.warning(
                    "could not read the run's events (goodput figures start anew): %s", error
                )
        if step is not None:
            event: dict[str, Any] = {"kind": "restore", "step": step, "restore_s": seconds}
            self._publish(event | (requests.to_dict() if requests is not None else {}))

    def _publish(
        self, event: dict[str, Any], *, compact: bool = True, figures: bool = True
    ) -> None:
        """Add the common figures (unless not `figures`); write the event (coordinator) and
        pass it to `metrics`."""
        if self.events is None:
            return
        if figures:
            event.update(
                train_s=self.model.take_training_s(),
                step_time_s=self.model.step_time_s,
                interval_steps=self.interval_steps,
            )
        event["writer"] = self.events.writer
        try:
            self.events.record(event, compact=compact)
        except StorageError as error:
            log.warning(
                "could not record the %s event of step %s (the checkpoint is not affected): %s",
                event["kind"],
                event.get("step_at_notice", event.get("step")),
                error,
            )
        self._emit(event)

    def _emit(self, record: dict[str, Any]) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics(dict(record))
        except Exception as error:  # a user's callable: never let it break training
            if not self._metrics_failed:
                self._metrics_failed = True
                log.warning("the metrics callable failed (reported once): %r", error)


# Statistics --------------------------------------------------------------------------------------


@dataclass
class GoodputStats:
    """What ``spotckpt stats`` reports for one checkpoint root."""

    uri: str
    events: int
    rejected_events: int = 0
    """Events left out of every figure: malformed, or with figures that cannot be true."""
    saves: int = 0
    restores: int = 0
    evictions: int = 0
    steps_lost: int = 0
    saved_bytes: int = 0
    referenced_bytes: int = 0
    training_s: float = 0.0
    stall_median_s: float | None = None
    stall_p95_s: float | None = None
    upload_median_s: float | None = None
    upload_p95_s: float | None = None
    restore_median_s: float | None = None
    overhead_share: float | None = None
    evictions_per_hour: float | None = None
    step_time_s: float | None = None
    interval_steps: int | None = None
    suggested_interval_steps: int | None = None
    estimated_goodput: float | None = None
    write_requests: int = 0
    read_requests: int = 0
    delete_requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    requests_per_checkpoint: float | None = None
    """Median requests of one save (all classes), over the recent saves that counted them."""
    cost_requests_total: float | None = None
    """The price of every request the run's events counted."""
    cost_per_checkpoint: float | None = None
    """Requests of one save (medians by class), priced."""
    cost_storage_per_checkpoint_month: float | None = None
    """Keeping one checkpoint (the mean save's bytes) for a month."""
    retained_bytes: int | None = None
    """Bytes under the root now (listed), whatever retention keeps."""
    cost_retention_per_month: float | None = None
    """Keeping `retained_bytes` for a month."""
    currency: str = DEFAULT_PRICES.currency

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return dict(self.__dict__)

    def one_line(self) -> str:
        """``goodput: overhead 1.2 % of 0.3 h, 0 steps lost in 3 evictions, interval 25 ...``."""
        if not self.events:
            return f"goodput: no events yet at {self.uri}"
        lost = f"{_count(self.steps_lost, 'step')} lost in {_count(self.evictions, 'eviction')}"
        interval = "-" if self.interval_steps is None else f"{self.interval_steps} steps"
        if not self.enough_data:
            return (
                f"goodput: {lost}, interval {interval}; too little data yet for the overhead "
                f"and the goodput estimate ({self._observed()})"
            )
        overhead = "-" if self.overhead_share is None else f"{100 * self.overhead_share:.1f} %"
        estimate = "" if self.estimated_goodput is None else f", {self._goodput()} goodput"
        return (
            f"goodput: checkpoint overhead {overhead} of {_duration(self.training_s)}, {lost}, "
            f"interval {interval} "
            f"(suggested {_or_dash(self.suggested_interval_steps)}){estimate}"
        )

    @property
    def enough_data(self) -> bool:
        """Whether the run is long enough for the overhead and the model's figures to mean
        anything (`MIN_SAVES_FOR_FIGURES` saves over `MIN_TRAINING_S_FOR_FIGURES`)."""
        return self.saves >= MIN_SAVES_FOR_FIGURES and self.training_s >= MIN_TRAINING_S_FOR_FIGURES

    def _observed(self) -> str:
        """``2 saves in 40.0 s of training; figures need 3 saves and 10.0 min``."""
        return (
            f"{_count(self.saves, 'save')} in {_duration(self.training_s)} of training; "
            f"figures need {MIN_SAVES_FOR_FIGURES} saves and "
            f"{_duration(MIN_TRAINING_S_FOR_FIGURES)}"
        )

    def _goodput(self) -> str:
        return "-" if self.estimated_goodput is None else f"{100 * self.estimated_goodput:.1f} %"

    def _rate_basis(self) -> str:
        """Where the eviction rate of the model's figures comes from."""
        if self.evictions == 0:
            return "assumed eviction rate"
        return "observed eviction rate, blended with the assumed prior"

    def _rate_row(self) -> str:
        if self.evictions_per_hour is None:
            return "-"
        rate = f"{self.evictions_per_hour:.3f} per hour"
        prior = f"{PRIOR_EVICTIONS_PER_HOUR} per hour, weighted as {PRIOR_WEIGHT_HOURS:g} h"
        if self.evictions == 0:
            return (
                f"{rate} (assumed: no eviction observed in {_duration(self.training_s)}, so "
                f"the prior of {prior})"
            )
        return (
            f"{rate} ({_count(self.evictions, 'eviction')} observed in "
            f"{_duration(self.training_s)}, blended with an assumed prior of {prior})"
        )

    def _model_rows(self) -> list[tuple[str, str]]:
        """The overhead (measured) and the figures of Daly's model (measured save stall and
        step time, and the eviction rate), or "too little data"."""
        if not self.enough_data:
            little = f"too little data ({self._observed()})"
            return [("overhead", little), ("suggested", "too little data"), ("goodput", little)]
        basis = self._rate_basis()
        return [
            (
                "overhead",
                _share(self.overhead_share) + " of training time (measured: save stalls, "
                "emergency saves and restores)",
            ),
            (
                "suggested",
                f"{_or_dash(self.suggested_interval_steps)} steps (Daly's formula: measured "
                f"save stall and step time, {basis})",
            ),
            (
                "goodput",
                f"{self._goodput()} (estimated by Daly's model at the current interval, {basis})",
            ),
        ]

    def text(self) -> str:
        """The multi-line report."""
        if not self.events:
            return f"no events yet at {self.uri}"
        rows = [
            (
                "events",
                f"{self.events} ({_count(self.saves, 'save')}, {_count(self.restores, 'restore')})",
            ),
            *self._rejected_rows(),
            ("evictions", str(self.evictions)),
            ("steps lost", str(self.steps_lost)),
            ("training time", _duration(self.training_s)),
            ("save stall", _spread(self.stall_median_s, self.stall_p95_s)),
            ("save upload", _spread(self.upload_median_s, self.upload_p95_s)),
            ("save bytes", _written_and_referenced(self.saved_bytes, self.referenced_bytes)),
            ("restore", f"median {_seconds(self.restore_median_s)}"),
            ("eviction rate", self._rate_row()),
            ("step time", _seconds(self.step_time_s)),
            ("interval", f"{_or_dash(self.interval_steps)} steps (last recorded)"),
            *self._model_rows(),
            *self._cost_rows(),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join([f"goodput at {self.uri}"] + [f"  {n.ljust(width)}  {v}" for n, v in rows])

    def _rejected_rows(self) -> list[tuple[str, str]]:
        if not self.rejected_events:
            return []
        return [("rejected", f"{self.rejected_events} events left out (malformed or impossible)")]

    def _cost_rows(self) -> list[tuple[str, str]]:
        if self.cost_requests_total is None:
            return [("requests", "- (not counted by this store)")]
        money = self._money
        return [
            (
                "requests",
                f"{self.write_requests} write, {self.read_requests} read, "
                f"{self.delete_requests} delete: {money(self.cost_requests_total)}",
            ),
            (
                "per checkpoint",
                f"{_or_dash(self.requests_per_checkpoint)} requests: "
                f"{money(self.cost_per_checkpoint)}, storage "
                f"{money(self.cost_storage_per_checkpoint_month)} per month",
            ),
            (
                "retention",
                f"{_bytes(self.retained_bytes)} stored: "
                f"{money(self.cost_retention_per_month)} per month",
            ),
        ]

    def _money(self, value: float | None) -> str:
        return "-" if value is None else f"{value:.4f} {self.currency} (estimated)"


def _bytes(value: int | None) -> str:
    return "-" if value is None else human_size(value)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def _written_and_referenced(written: int, referenced: int) -> str:
    """``812.0 MiB written, 7.5 GiB referenced (incremental)``."""
    text = f"{human_size(written)} written"
    return text + (f", {human_size(referenced)} referenced (incremental)" if referenced else "")


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _spread(middle: float | None, high: float | None) -> str:
    return f"median {_seconds(middle)}, p95 {_seconds(high)}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f} %"


def stats_from_totals(
    uri: str,
    totals: Totals,
    prices: PriceTable = DEFAULT_PRICES,
    retained_bytes: int | None = None,
) -> GoodputStats:
    """The report's figures from a run's `Totals`; prices from `prices`, the retention cost
    from `retained_bytes` (None: not known)."""
    sums, recent, counts = totals.sums, totals.recent, totals.counts
    training_s = sums.get("train_s", 0.0)
    stalls = recent.get("stall_s", [])
    evictions = counts.get("preemption", 0)
    cost = sums.get("stall_s", 0.0) + sums.get("emergency_save_s", 0.0) + sums.get("restore_s", 0)
    stats = GoodputStats(
        uri=uri,
        events=totals.events,
        rejected_events=totals.rejected,
        saves=counts.get("save", 0),
        restores=counts.get("restore", 0),
        evictions=evictions,
        steps_lost=int(sums.get("steps_lost", 0)),
        saved_bytes=int(sums.get("bytes", 0)),
        referenced_bytes=int(sums.get("referenced_bytes", 0)),
        training_s=training_s,
        stall_median_s=median(stalls),
        stall_p95_s=p95(stalls),
        upload_median_s=median(recent.get("upload_s", [])),
        upload_p95_s=p95(recent.get("upload_s", [])),
        restore_median_s=median(recent.get("restore_s", [])),
        overhead_share=cost / training_s if training_s > 0 else None,
        evictions_per_hour=eviction_rate(evictions, training_s),
        step_time_s=totals.last_number("step_time_s"),
    )
    interval = _number(totals.last.get("interval_steps"))
    stats.interval_steps = int(interval) if interval is not None and interval >= 1 else None
    _add_model_figures(stats)
    _add_cost_figures(stats, totals, prices, retained_bytes)
    return stats


def _add_cost_figures(
    stats: GoodputStats, totals: Totals, prices: PriceTable, retained_bytes: int | None
) -> None:
    """Requests and prices; none when no event counted requests (a store that does not)."""
    sums = totals.sums
    if not any(name in sums for name in REQUEST_FIELDS):
        return
    counted = {name: int(sums.get(name, 0)) for name in REQUEST_FIELDS}
    tally = RequestTally.from_dict(counted)
    stats.write_requests, stats.read_requests = tally.write, tally.read
    stats.delete_requests, stats.bytes_sent, stats.bytes_received = (
        tally.delete,
        tally.sent,
        tally.received,
    )
    stats.currency = prices.currency
    stats.cost_requests_total = prices.requests_cost(tally)
    medians = {name: median(totals.recent.get(name, [])) for name in _PER_SAVE}
    if all(value is not None for value in medians.values()):
        one = RequestTally(
            write=round(medians["write_requests"] or 0),
            read=round(medians["read_requests"] or 0),
            delete=round(medians["delete_requests"] or 0),
        )
        stats.requests_per_checkpoint = one.requests
        stats.cost_per_checkpoint = prices.requests_cost(one)
    saves_with_bytes = totals.counts.get("save", 0)
    if saves_with_bytes and sums.get("bytes"):
        stats.cost_storage_per_checkpoint_month = prices.storage_cost_per_month(
            sums["bytes"] / saves_with_bytes
        )
    if retained_bytes is not None:
        stats.retained_bytes = retained_bytes
        stats.cost_retention_per_month = prices.storage_cost_per_month(retained_bytes)


def _add_model_figures(stats: GoodputStats) -> None:
    """The suggested interval and the goodput estimate, from figures as the auto interval
    takes them: an impossible observed rate gives way to the prior, and none is suggested
    from figures that are impossible even then."""
    if stats.evictions_per_hour is None or stats.stall_median_s is None or not stats.step_time_s:
        return
    mtbf = 3600 / stats.evictions_per_hour
    if not possible_figures(mtbf, stats.step_time_s, stats.stall_median_s):
        mtbf = 3600 / PRIOR_EVICTIONS_PER_HOUR
    if not possible_figures(mtbf, stats.step_time_s, stats.stall_median_s):
        return
    stats.suggested_interval_steps = interval_steps_for(
        stats.stall_median_s, mtbf, stats.step_time_s
    )
    if stats.interval_steps is not None:
        stats.estimated_goodput = expected_goodput(
            stats.stall_median_s,
            mtbf,
            stats.interval_steps * stats.step_time_s,
            stats.restore_median_s or 0.0,
        )


def load_stats(store: ObjectStore, prices: PriceTable = DEFAULT_PRICES) -> GoodputStats:
    """The report for the root of `store` (raises StorageError); the bytes retained are listed
    (one request per 1,000 objects)."""
    totals = EventLog(store).totals()
    retained = sum(info.size for info in store.list("")) if totals.events else None
    return stats_from_totals(store.uri, totals, prices, retained)


__all__ = [
    "PRIOR_EVICTIONS_PER_HOUR",
    "STARTING_INTERVAL_STEPS",
    "EventLog",
    "GoodputStats",
    "GoodputTracker",
    "IntervalModel",
    "Totals",
    "daly_interval_s",
    "eviction_rate",
    "expected_goodput",
    "interval_steps_for",
    "load_stats",
]
