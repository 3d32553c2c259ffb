"""The checkpoint interval of ``interval_steps="auto"``: Daly's model and the figures it reads.

A module of its own because choosing the interval is arithmetic over three figures (the mean step
time, the save cost: the seconds the training loop was blocked, not the background upload, and the
eviction rate), not storage: it imports neither the event log (`spotckpt.goodput`) nor the stats
display (`spotckpt.stats`), only reads a run's recorded events through `RunHistory` (the event
log's `Totals` is one), and never imports torch. `IntervalModel` measures and chooses;
`daly_interval_s`, `interval_steps_for`, `expected_goodput` and `eviction_rate` are the model's
formulas, which ``spotckpt stats`` uses too.

The interval is always within ``[max(1, min_interval_steps), max_interval_steps]`` (the ceiling
defaults to `spotckpt.config.DEFAULT_MAX_INTERVAL_STEPS`), and figures that cannot be true are
not used: a mean time between evictions below the step time or the save stall
(`possible_figures`).

The model of `expected_goodput` and `daly_interval_s` (J. T. Daly, "A higher order estimate of
the optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22, 2006)
assumes failures without notice. A spot eviction usually comes with one, and spotckpt then saves
the current step, so it loses less than the model says: the estimate is conservative.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from spotckpt.config import DEFAULT_MAX_INTERVAL_STEPS

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
STARTING_INTERVAL_STEPS = 100
"""The ``"auto"`` interval until a step time and a save cost are measured (clamped to bounds)."""
MIN_STEP_SAMPLES = 3
"""Step durations measured before the session's own step time replaces a recorded one."""
_STEP_WINDOW = 64
_SAVE_WINDOW = 16


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


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values."""
    ordered = sorted(values)
    return statistics.median(ordered) if ordered else None


def seconds_text(value: float | None) -> str:
    """Seconds for a message or a report; ``-`` for a figure not measured."""
    return "-" if value is None else f"{value:.3f} s"


class RunHistory(Protocol):
    """What the model reads of a run's recorded events (`spotckpt.goodput.Totals` is one)."""

    @property
    def counts(self) -> Mapping[str, int]:
        """Events by kind."""
        ...

    @property
    def sums(self) -> Mapping[str, float]:
        """Summed figures (``train_s``: the run's training time)."""
        ...

    @property
    def recent(self) -> Mapping[str, Sequence[float]]:
        """Recent values of a figure (``stall_s``: the save stalls)."""
        ...

    def last_number(self, name: str) -> float | None:
        """A latest figure if it is a positive number."""
        ...


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
    the loop was blocked, `seed` with a run's recorded events, and `update` to recompute. The
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
        self.history: RunHistory | None = None
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

    def seed(self, history: RunHistory) -> None:
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
        return None if self.history is None else self.history.last_number("step_time_s")

    @property
    def save_cost_s(self) -> float | None:
        """Mean recent stall of this session's periodic saves, else the recorded median."""
        if self._stalls:
            return statistics.fmean(self._stalls)
        return None if self.history is None else median(self.history.recent.get("stall_s", []))

    def figures(self) -> Figures:
        """The current figures; an observed eviction rate that cannot be true (see
        `possible_figures`) gives way to the prior."""
        step_time_s, save_cost_s = self.step_time_s, self.save_cost_s
        return Figures(step_time_s, save_cost_s, self._eviction_rate(step_time_s, save_cost_s))

    def _eviction_rate(self, step_time_s: float | None, save_cost_s: float | None) -> float:
        if self.configured_rate is not None:
            return self.configured_rate
        history = self.history
        recorded_s = 0.0 if history is None else history.sums.get("train_s", 0.0)
        evictions = 0 if history is None else history.counts.get("preemption", 0)
        observed = eviction_rate(evictions, recorded_s + (self.clock() - self._started))
        if possible_figures(3600 / observed, step_time_s, save_cost_s):
            return observed
        self._warn_once(
            "rate",
            "the run's events give a mean time between evictions of %.3g s, below the step time "
            "(%s) or the save stall (%s): that cannot be true, so the prior rate of %s per hour "
            "is used instead",
            3600 / observed,
            seconds_text(step_time_s),
            seconds_text(save_cost_s),
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


__all__ = [
    "PRIOR_EVICTIONS_PER_HOUR",
    "STARTING_INTERVAL_STEPS",
    "Figures",
    "IntervalModel",
    "RunHistory",
    "daly_interval_s",
    "eviction_rate",
    "expected_goodput",
    "interval_steps_for",
]
