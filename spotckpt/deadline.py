"""The emergency save against the notice window: how long a save started at a preemption notice
would take now, by which route, and whether that fits the shortest window this machine can get.

A module of its own because it is the one answer to "would a notice now cost only the step in
flight?", given before an eviction rather than found out at one. The figures are the job's own: the
last save's time to the first place an emergency save goes (the fast tier when there is one, whose
copy on the peers is what a restart reads if the bucket copy does not follow in time; else the
bucket), which is job-wide (a save commits once every rank wrote) and follows the state's size from
one save to the next (plus, in ``async_mode="process"``, what an upload in flight still needs: an
upload process cannot be stopped, so it commits first; in a thread an upload in flight gets only the
time the plan at the notice leaves it, `in_flight_allowance`, and is cancelled otherwise). The
window is the shortest of the notice sources active here: signals are always watched, so
`save_budget_s` always counts (the deploy kit pairs it with the launcher's and Kubernetes' grace
period); a cloud's notice (AWS 120 s, GCE and Azure 30 s) counts on that cloud. An estimate fits
when `SaveDecisionPolicy.fits` says so: the same rule the emergency save applies at the notice, so a
state reported as not fitting is exactly one whose emergency save would be skipped. The emergency
save's writes to the bucket also adapt to what the job saw (`NoticeAdaptation`, agreed by every
rank): prefixes spread once the bucket throttled, objects compressed where the measured link makes
it pay. No torch, no store I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from spotckpt.policy import SaveDecisionPolicy
from spotckpt.preemption import NoticeWindow

FIXES = (
    "a fast tier (local_dir=..., with redundancy= across nodes), "
    "prefix_spread=True against throttling, compression='auto' or incremental=True for fewer "
    "bytes, or a larger save_budget_s with a grace period to match"
)
"""What shortens an emergency save, or lengthens its window."""

CANCEL_RESERVE_S = 1.0
"""Time kept, at a notice, for an upload in flight to stop on every rank once cancelled."""


@dataclass(frozen=True)
class NoticeAdaptation:
    """How an emergency save's writes to the bucket differ from the settings', decided at the
    notice from what every rank saw (`adapt_at_notice`): the save that matters most should not
    take a route the job already found slow, nor wait for a setting to be changed.

    `spread`: rank objects spread over key prefixes (the bucket throttled `throttled` times so
    far, and a throttled bucket partitions its request rate by prefix). `compress`: each object
    compressed where a sample of it says that pays off on the link rate earlier raw uploads
    measured (``compression="auto"``'s rule, `spotckpt.format.compression.Compression.at_notice`;
    data that does not compress stays raw). Readers need nothing: the manifest names each
    object's key and encoding."""

    spread: bool = False
    compress: bool = False
    throttled: int = 0

    def describe(self) -> str | None:
        """What the log says of it (None: nothing adapted)."""
        parts = []
        if self.spread:
            plural = "" if self.throttled == 1 else "s"
            parts.append(f"prefixes spread (the bucket throttled {self.throttled} request{plural})")
        if self.compress:
            parts.append("objects compressed where the measured link makes it pay")
        return "; ".join(parts) or None


UNADAPTED = NoticeAdaptation()
"""The settings' keys and encodings as they are: every save but an emergency one that adapts."""


def adapt_at_notice(
    reports: Sequence[tuple[int, bool]], *, prefix_spread: bool, compression: str
) -> NoticeAdaptation:
    """The adaptation of an emergency save, from each rank's report (the throttled answers its
    bucket store got so far in this job, whether its link rate is measured) and the settings:
    spread when any rank was throttled and `prefix_spread` is off (else it is on already);
    compress when `compression` is ``"off"`` and any rank's link is measured (``"on"`` and
    ``"auto"`` already decide by themselves). Every rank gets the same reports, so the same
    answer."""
    throttled = sum(count for count, _ in reports)
    return NoticeAdaptation(
        spread=not prefix_spread and throttled > 0,
        compress=compression == "off" and any(measured for _, measured in reports),
        throttled=throttled,
    )


@dataclass(frozen=True)
class EmergencyEstimate:
    """An emergency save now: about `seconds` by `route` (``bucket`` or ``fast tier``), against
    `window`. `seconds` is None before the first save measured one (it fits until then).

    Unpacks as ``seconds, route = manager.emergency_estimate()``."""

    seconds: float | None
    route: str
    window: NoticeWindow
    fits: bool

    def __iter__(self) -> Iterator[float | str | None]:
        yield self.seconds
        yield self.route

    def describe(self) -> str:
        """One line: ``about 41.3 s by the bucket route, against save_budget_s (25 s): does not
        fit``."""
        if self.seconds is None:
            return f"not measured yet (no save so far), against {self.window.named()}"
        verdict = "fits" if self.fits else "does not fit"
        return (
            f"about {self.seconds:.1f} s by the {self.route} route, against "
            f"{self.window.named()}: {verdict}"
        )

    def warning(self) -> str:
        """What a state that does not fit is told: the figures, the window's name and the fixes."""
        return (
            f"an emergency save would now take about {self.seconds or 0.0:.1f} s by the "
            f"{self.route} route, which does not fit {self.window.named()} with its margin: a "
            f"preemption notice now would lose every step since the last committed one. "
            f"To fix it: {FIXES}"
        )

    def to_event(self) -> dict[str, float | str | None]:
        """The figures a goodput event carries (`spotckpt stats` shows the latest)."""
        return {
            "emergency_estimate_s": self.seconds,
            "emergency_route": self.route,
            "emergency_window_s": self.window.seconds,
            "emergency_window_source": self.window.source,
        }


def estimate(
    policy: SaveDecisionPolicy, seconds: float | None, route: str, window: NoticeWindow
) -> EmergencyEstimate:
    """An emergency save by `route` predicted to take `seconds` (None: not measured yet, which
    fits), judged against `window` by the rule the notice applies (`SaveDecisionPolicy.fits`)."""
    fits = policy.fits(seconds, now=0.0, deadline=window.seconds)
    return EmergencyEstimate(seconds, route, window, fits)


def first_measured(
    policy: SaveDecisionPolicy,
    routes: Sequence[tuple[str, float | None]],
    in_flight_s: float,
    window: NoticeWindow,
) -> EmergencyEstimate:
    """The estimate by the first of `routes` (in the order an emergency save tries them, each
    with its last save's seconds) that measured one, plus `in_flight_s` that an upload in
    flight still needs; unmeasured (None seconds) by the first route when none did."""
    for route, seconds in routes:
        if seconds is not None:
            return estimate(policy, seconds + in_flight_s, route, window)
    return estimate(policy, None, routes[0][0], window)


def in_flight_allowance(
    policy: SaveDecisionPolicy,
    *,
    in_flight_s: float,
    save_s: float | None,
    left_s: float | None,
    newer: bool,
) -> float | None:
    """At a notice with `left_s` seconds left (None: unknown), how long an upload in flight,
    predicted to need `in_flight_s` more, may still run before it is cancelled; None: to its end.

    With a `newer` step to save (predicted `save_s` by its route) that fits with a reserve for
    stopping the upload on every rank (`CANCEL_RESERVE_S`, or the margin's share of the save when
    longer): the upload runs until that save must start when it fits before then, else it is
    cancelled at once (the newer step is worth more, and the upload would take its time).
    Otherwise the upload, the only step still within reach, runs until the deadline less
    `CANCEL_RESERVE_S` (a commit the deadline cuts off is invisible, never half-written).
    """
    if left_s is None:
        return None
    predicted = save_s or 0.0
    reserve = max(CANCEL_RESERVE_S, (policy.margin - 1.0) * predicted)
    save_start = left_s - policy.margin * predicted - reserve
    if not newer or save_start <= 0:
        return max(0.0, left_s - CANCEL_RESERVE_S)
    if policy.fits(in_flight_s, now=0.0, deadline=save_start):
        return save_start
    return 0.0
