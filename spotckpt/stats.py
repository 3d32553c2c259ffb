"""``spotckpt stats``: a run's goodput and cost figures, from its events, as text or JSON.

A module of its own because it is display: it reads the event log (`spotckpt.goodput`), applies
the interval model's formulas (`spotckpt.interval`) as the ``"auto"`` interval would, and prices
the requests and bytes with a `spotckpt.cost.PriceTable`; nothing below it imports it. Figures
that are measured, assumed (the prior eviction rate) and estimated by the model are told apart,
and the overhead, the suggested interval and the goodput estimate are shown only from
`MIN_SAVES_FOR_FIGURES` saves over `MIN_TRAINING_S_FOR_FIGURES` of training. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from spotckpt.cost import (
    DEFAULT_PRICES,
    GB,
    PriceTable,
    egress_cost,
    egress_per_gb,
    provider,
    provider_egress_per_gb,
)
from spotckpt.deadline import EmergencyEstimate, estimate
from spotckpt.goodput import MIRROR_BYTES_TO, PER_SAVE_FIELDS, REQUEST_FIELDS, EventLog, Totals
from spotckpt.interval import (
    PRIOR_EVICTIONS_PER_HOUR,
    PRIOR_WEIGHT_HOURS,
    eviction_rate,
    expected_goodput,
    interval_steps_for,
    median,
    possible_figures,
    seconds_text,
)
from spotckpt.policy import SaveDecisionPolicy
from spotckpt.preemption import NoticeWindow
from spotckpt.storage.base import ObjectStore
from spotckpt.storage.requests import RequestTally
from spotckpt.units import human_size

MIN_SAVES_FOR_FIGURES = 3
MIN_TRAINING_S_FOR_FIGURES = 600.0
"""``spotckpt stats`` shows the overhead, the suggested interval and the goodput estimate only
from this many saves over this much training; below, it says "too little data": in a short run
the first save, a restore and start-up weigh as much as hours of training."""


def p95(values: Iterable[float]) -> float | None:
    """The 95th percentile (nearest rank), or None for no values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)] if ordered else None


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
    emergency_estimate_s: float | None = None
    """The last save's emergency estimate (`spotckpt.deadline`): seconds, route and window."""
    emergency_route: str | None = None
    emergency_window_s: float | None = None
    emergency_window_source: str | None = None
    mirror_catch_ups: int = 0
    """``mirror`` events over the whole run (catch-ups that copied or failed something)."""
    mirror_bytes: int = 0
    """Bytes copied to mirrors over the whole run: egress out of the root's region."""
    cost_mirror_egress: float | None = None
    """`mirror_bytes` priced per provider pair (`spotckpt.cost.egress_per_gb`)."""
    mirrors: list[dict[str, Any]] | None = None
    """Per mirror, from the events not yet compacted: ``mirror``, ``catch_ups``, ``bytes``,
    ``cost_egress``, ``egress_per_gb`` and the latest ``step``, ``steps_behind``,
    ``seconds_behind``, ``failed_steps``, ``time``."""

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
            ("events", self._events_row()),
            *self._rejected_rows(),
            ("evictions", str(self.evictions)),
            ("steps lost", str(self.steps_lost)),
            ("training time", _duration(self.training_s)),
            ("save stall", _spread(self.stall_median_s, self.stall_p95_s)),
            ("save upload", _spread(self.upload_median_s, self.upload_p95_s)),
            ("save bytes", _written_and_referenced(self.saved_bytes, self.referenced_bytes)),
            ("restore", f"median {seconds_text(self.restore_median_s)}"),
            ("eviction rate", self._rate_row()),
            ("step time", seconds_text(self.step_time_s)),
            ("interval", f"{_or_dash(self.interval_steps)} steps (last recorded)"),
            ("emergency save", self._emergency_row()),
            *self._model_rows(),
            *self._cost_rows(),
            *self._mirror_rows(),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join([f"goodput at {self.uri}"] + [f"  {n.ljust(width)}  {v}" for n, v in rows])

    def _events_row(self) -> str:
        kinds = [_count(self.saves, "save"), _count(self.restores, "restore")]
        if self.mirror_catch_ups:
            kinds.append(_count(self.mirror_catch_ups, "mirror catch-up"))
        return f"{self.events} ({', '.join(kinds)})"

    def emergency(self) -> EmergencyEstimate | None:
        """The last recorded emergency estimate, judged again (None: no save recorded one)."""
        if self.emergency_window_s is None or self.emergency_window_source is None:
            return None
        window = NoticeWindow(self.emergency_window_s, self.emergency_window_source)
        route = self.emergency_route or "bucket"
        return estimate(SaveDecisionPolicy(), self.emergency_estimate_s, route, window)

    def _emergency_row(self) -> str:
        now = self.emergency()
        return "-" if now is None else now.describe()

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

    def _mirror_rows(self) -> list[tuple[str, str]]:
        """The run's mirror egress, and each mirror's lag (from its latest event)."""
        if not self.mirror_catch_ups:
            return []
        rows = [
            (
                "mirrored",
                f"{human_size(self.mirror_bytes)} in {_count(self.mirror_catch_ups, 'catch-up')}"
                f": egress {self._money(self.cost_mirror_egress)}",
            )
        ]
        for mirror in self.mirrors or []:
            behind = mirror.get("steps_behind")
            seconds = mirror.get("seconds_behind")
            lag = (
                "lag -"
                if behind is None
                else f"{_count(behind, 'step')} behind, "
                + ("time unknown" if seconds is None else f"{seconds:.0f} s")
            )
            failed = f", {mirror['failed_steps']} failed" if mirror.get("failed_steps") else ""
            rows.append(
                (
                    "mirror",
                    f"{mirror['mirror']}: step {_or_dash(mirror.get('step'))}, {lag}{failed} "
                    f"(latest event); {human_size(mirror['bytes'])} since the last compaction: "
                    f"{self._money(mirror['cost_egress'])}",
                )
            )
        return rows

    def _money(self, value: float | None) -> str:
        return "-" if value is None else f"{value:.4f} {self.currency} (estimated)"


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


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


def _spread(middle: float | None, high: float | None) -> str:
    return f"median {seconds_text(middle)}, p95 {seconds_text(high)}"


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
    interval = totals.last_number("interval_steps")
    stats.interval_steps = int(interval) if interval is not None and interval >= 1 else None
    stats.emergency_estimate_s = totals.last_number("emergency_estimate_s")
    stats.emergency_window_s = totals.last_number("emergency_window_s")
    stats.emergency_route = _text(totals.last.get("emergency_route"))
    stats.emergency_window_source = _text(totals.last.get("emergency_window_source"))
    _add_model_figures(stats)
    _add_cost_figures(stats, totals, prices, retained_bytes)
    _add_mirror_figures(stats, totals, prices)
    return stats


def _add_mirror_figures(stats: GoodputStats, totals: Totals, prices: PriceTable) -> None:
    """The run's mirror bytes and their egress price (by the sums per provider, so compacted
    events count), and each mirror's latest lag (from the events not yet compacted)."""
    stats.mirror_catch_ups = totals.counts.get("mirror", 0)
    if not stats.mirror_catch_ups:
        return
    stats.currency = prices.currency
    stats.mirror_bytes = int(totals.sums.get("mirror_bytes", 0))
    source = provider(stats.uri)
    stats.cost_mirror_egress = sum(
        totals.sums.get(name, 0.0) / GB * provider_egress_per_gb(prices, source, target)
        for target, name in MIRROR_BYTES_TO.items()
    )
    stats.mirrors = [
        {
            "mirror": uri,
            "catch_ups": row["events"],
            "bytes": row["bytes"],
            "egress_per_gb": egress_per_gb(prices, stats.uri, uri),
            "cost_egress": egress_cost(prices, stats.uri, uri, row["bytes"]),
            **{name: row.get(name) for name in _MIRROR_LATEST},
        }
        for uri, row in sorted(totals.mirrors.items())
    ]


_MIRROR_LATEST = ("step", "steps_behind", "seconds_behind", "failed_steps", "time")


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
    medians = {name: median(totals.recent.get(name, [])) for name in PER_SAVE_FIELDS}
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


__all__ = ["GoodputStats", "load_stats", "stats_from_totals"]
