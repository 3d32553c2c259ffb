"""Policies as small values, with no store I/O and no torch, so that every layer that carries one
out (the catalog, gc, the fast tier, the manager) can import them without reaching upward.

**Saves** (`SaveDecisionPolicy`): when `CheckpointManager.maybe_save` saves, and where to (the
fixed or ``"auto"`` interval, a preemption notice, the fast tier's cadence), and whether a save
still fits before a preemption deadline. The figures (the interval model's choice, the predicted
save time, the clock) are arguments; `spotckpt.save` carries the decisions out.

**Retention** (`RetentionPolicy`): which committed steps stay, which go, and which attempt
folders may be deleted. One rule, shared by the job's retention after each commit
(`Catalog.retire`), `gc` (`spotckpt.gc`) and the fast tier's pruning (`spotckpt.tiers.fast_tier`).

1. **Only readable steps count.** A step is readable when its manifest (an indexed step's root,
   which names every object the step holds) validates, is signed where a keyring enforces
   signing, and every object it names is there at its size (a manifest copied without its
   objects cannot be restored); a damaged index part or bad bytes are found by restore (which
   quarantines the step) and `verify`. The newest `RetentionPolicy.count` readable steps are kept;
   older readable steps retire. The newest readable step is never retired.
2. **An unreadable step is left alone.** A damaged manifest, a format this version does not
   know, a manifest unsigned under a key: such a step takes no slot from readable steps, is
   never retired, and keeps its objects. What it references is unknown, so every folder of an
   older step stays too (its manifest may still retire). Such steps are reported (`ls`,
   `verify`, gc's report) and removed only on request (`RetentionPolicy.delete_unreadable`, the
   CLI's ``gc --delete-unreadable``), and then only the objects that no readable kept step needs;
   the fast tier, a cache, always removes its own (`spotckpt.tiers.retention`).
3. **An attempt folder goes only with proof.** A folder (``step-N/a-<id>``) may be deleted only
   when no kept step needs it (its own attempt, or one its references point into), as read from
   a listing taken after the deletion candidates were chosen, in which every manifest was read
   (`spotckpt.catalog.Catalog.read_steps`). A step that commits later references only what a
   step of that listing needed, or its own new attempt, which gc's safety age protects.

The decision is a small value (`RetentionDecision`) computed from `StepReading`s by a policy
value (`RetentionPolicy`), so that callers only carry it out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from spotckpt.errors import InvalidArgumentError


@dataclass(frozen=True)
class StepReading:
    """What retention knows of one committed step: the attempt folders its manifest needs
    (``step-N/a-<id>``, relative to the root: its own attempt and those its references point
    into), or None with the `problem` when the manifest cannot be read."""

    step: int
    needs: frozenset[str] | None
    problem: str = ""

    @property
    def readable(self) -> bool:
        """Whether the manifest was read (see the module docstring, rule 1)."""
        return self.needs is not None


@dataclass(frozen=True)
class RetentionDecision:
    """The outcome of a `RetentionPolicy` policy over a set of `StepReading`s."""

    kept: tuple[int, ...]
    retired: tuple[int, ...]
    unreadable: tuple[int, ...]
    """Unreadable steps that stay (rule 2)."""
    needed: frozenset[str]
    """Attempt folders that a kept step needs."""

    @property
    def shield(self) -> int | None:
        """The newest unreadable step that stays: every folder of an older step stays too."""
        return max(self.unreadable) if self.unreadable else None

    def may_delete(self, folder: str, step: int) -> bool:
        """Whether attempt folder `folder` (``step-N/a-<id>``) of `step` may be deleted under
        rules 2 and 3 (a caller still applies its own checks: gc's safety age)."""
        if folder in self.needed or step in self.unreadable:
            return False
        shield = self.shield
        return shield is None or step > shield

    def holds_back(self, step: int) -> str | None:
        """Why the objects of `step` stay though its manifest may go, or None."""
        shield = self.shield
        if step in self.unreadable:
            return f"step {step}'s manifest cannot be read"
        if shield is not None and step < shield:
            return (
                f"step {shield}'s manifest cannot be read, so what it references is unknown "
                "(spotckpt gc --delete-unreadable removes such steps)"
            )
        return None


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest `count` readable steps (every one when None); see the module docstring.

    `delete_unreadable` retires unreadable steps too (never automatic: gc's explicit option).
    """

    count: int | None
    delete_unreadable: bool = False

    def __post_init__(self) -> None:
        if self.count is not None and self.count < 1:
            raise InvalidArgumentError(
                "keep_last must be at least 1: the newest checkpoint is never deleted"
            )

    def decide(self, readings: Iterable[StepReading]) -> RetentionDecision:
        """Which steps stay and go, and which folders the kept ones need."""
        ordered = sorted(readings, key=lambda r: r.step)
        readable = [r for r in ordered if r.readable]
        unreadable = tuple(r.step for r in ordered if not r.readable)
        cut = 0 if self.count is None else max(0, len(readable) - self.count)
        kept = readable[cut:]
        retired = tuple(r.step for r in readable[:cut])
        if self.delete_unreadable:
            retired, unreadable = tuple(sorted(retired + unreadable)), ()
        needed = frozenset(folder for r in kept for folder in r.needs or ())
        return RetentionDecision(tuple(r.step for r in kept), retired, unreadable, needed)


SAVE_TIME_MARGIN = 1.2
"""A save predicted to take ``t`` seconds is started before a deadline only if ``1.2 * t`` fit."""

HINTED_INTERVAL_FACTOR = 0.5
"""While an early hint is active the eviction is far likelier than the model's rate assumes, so
the ``"auto"`` interval saves this fraction as many steps apart (at least one)."""


class SaveKind(Enum):
    """What `SaveDecisionPolicy.decide` asks `maybe_save` to do at a step."""

    NONE = "none"
    EMERGENCY = "emergency"
    """A preemption notice: save at once (blocking) if it fits before the deadline, then stop."""
    DURABLE = "durable"
    """The interval, or an early hint: a save committed in the bucket (through the fast tier
    when it has room)."""
    FAST = "fast"
    """The fast tier's cadence: a save to the fast tier only."""


@dataclass(frozen=True)
class SaveDecisionPolicy:
    """When to save: the one home of the decision `maybe_save` carries out (**saves**).

    `interval_steps` is the fixed interval (``step % interval_steps == 0``; None: never), or
    ``"auto"``: a save once the interval model's current choice of steps passed since the last
    save started (the model, `spotckpt.interval`, gives that figure to `decide`). A preemption
    notice comes first; the fast tier's cadence (`fast_interval_steps`, None without a tier)
    last. With several ranks the preemption flag is agreed on every `agree_every` steps. Before a
    deadline, a save is started only when its predicted time, times `margin`, fits (`fits`).
    """

    interval_steps: int | Literal["auto"] | None = None
    fast_interval_steps: int | None = None
    agree_every: int = 1
    margin: float = SAVE_TIME_MARGIN
    hinted_interval_factor: float = HINTED_INTERVAL_FACTOR

    @property
    def auto(self) -> bool:
        """Whether the interval is the interval model's choice."""
        return self.interval_steps == "auto"

    def agrees_at(self, step: int) -> bool:
        """Whether the ranks agree on the preemption flag at `step`."""
        return step % self.agree_every == 0

    def due(
        self,
        step: int,
        *,
        auto_interval_steps: int | None,
        last_started_step: int,
        hint_active: bool = False,
    ) -> bool:
        """Whether the interval saves `step` (`auto_interval_steps`: the model's current choice,
        used for ``"auto"`` only, shortened by `hinted_interval_factor` while `hint_active`;
        `last_started_step`: the step of the last save, or the restored one)."""
        if self.interval_steps == "auto":
            if auto_interval_steps is None:
                return False
            if hint_active:
                auto_interval_steps = max(1, int(auto_interval_steps * self.hinted_interval_factor))
            return step - last_started_step >= auto_interval_steps
        if self.interval_steps is None:
            return False
        return step % self.interval_steps == 0

    def decide(
        self,
        step: int,
        *,
        preempted: bool,
        hinted: bool = False,
        auto_interval_steps: int | None = None,
        last_started_step: int = 0,
        hint_active: bool = False,
    ) -> SaveKind:
        """What to do at `step`: `preempted` is the notice every rank agreed on, `hinted` an
        early hint (AWS's rebalance recommendation) not yet answered with a save of its own,
        `hint_active` one that any rank still sees (the ``"auto"`` interval shortens)."""
        if preempted:
            return SaveKind.EMERGENCY
        if hinted or self.due(
            step,
            auto_interval_steps=auto_interval_steps,
            last_started_step=last_started_step,
            hint_active=hint_active,
        ):
            return SaveKind.DURABLE
        fast = self.fast_interval_steps
        if fast is not None and step % fast == 0:
            return SaveKind.FAST
        return SaveKind.NONE

    def fits(self, seconds: float | None, *, now: float, deadline: float | None) -> bool:
        """Whether a save predicted to take `seconds`, times `margin`, ends before `deadline`
        (both `time.monotonic()` values); an unknown deadline or prediction: yes."""
        if deadline is None or seconds is None:
            return True
        return now + self.margin * seconds < deadline
