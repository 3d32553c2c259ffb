"""`SaveDecisionPolicy`: the one home of when `maybe_save` saves, as a value over figures."""

from __future__ import annotations

import pytest

from spotckpt.policy import (
    HINTED_INTERVAL_FACTOR,
    SAVE_TIME_MARGIN,
    SaveDecisionPolicy,
    SaveKind,
)


def test_a_fixed_interval_saves_on_its_multiples_only() -> None:
    policy = SaveDecisionPolicy(5)
    kinds = [policy.decide(step, preempted=False) for step in range(11)]
    saved = [step for step, kind in enumerate(kinds) if kind is SaveKind.DURABLE]
    assert saved == [0, 5, 10]
    assert {kind for kind in kinds if kind is not SaveKind.DURABLE} == {SaveKind.NONE}


def test_no_interval_never_saves_unless_preempted() -> None:
    policy = SaveDecisionPolicy(None)
    assert all(policy.decide(step, preempted=False) is SaveKind.NONE for step in range(20))
    assert policy.decide(3, preempted=True) is SaveKind.EMERGENCY


def test_the_auto_interval_counts_from_the_last_save_with_the_models_figure() -> None:
    policy = SaveDecisionPolicy("auto")
    assert policy.auto
    assert policy.due(17, auto_interval_steps=10, last_started_step=7)
    assert not policy.due(16, auto_interval_steps=10, last_started_step=7)
    assert not policy.due(100, auto_interval_steps=None, last_started_step=0)  # no choice yet
    decided = policy.decide(30, preempted=False, auto_interval_steps=8, last_started_step=22)
    assert decided is SaveKind.DURABLE


@pytest.mark.parametrize(("model", "shortened"), [(10, 5), (7, 3), (1, 1)])
def test_an_active_hint_shortens_the_auto_interval(model: int, shortened: int) -> None:
    """A rebalance recommendation makes an eviction likely soon: save more often meanwhile."""
    policy = SaveDecisionPolicy("auto")
    assert shortened == max(1, int(model * HINTED_INTERVAL_FACTOR))
    due = [s for s in range(1, 30) if policy.due(s, auto_interval_steps=model, last_started_step=0)]
    hinted = [
        s
        for s in range(1, 30)
        if policy.due(s, auto_interval_steps=model, last_started_step=0, hint_active=True)
    ]
    assert min(due) == model and min(hinted) == shortened
    decided = policy.decide(
        shortened, preempted=False, auto_interval_steps=model, last_started_step=0, hint_active=True
    )
    assert decided is SaveKind.DURABLE
    assert not SaveDecisionPolicy(50).due(
        25, auto_interval_steps=model, last_started_step=0, hint_active=True
    )  # a fixed interval is the user's: a hint answers with one save of its own instead


def test_a_fixed_interval_ignores_the_models_figure() -> None:
    policy = SaveDecisionPolicy(4)
    assert not policy.auto
    assert policy.due(8, auto_interval_steps=1000, last_started_step=7)
    assert not policy.due(9, auto_interval_steps=1, last_started_step=0)


def test_preemption_comes_first_and_the_fast_cadence_last() -> None:
    policy = SaveDecisionPolicy(4, fast_interval_steps=2)
    assert policy.decide(4, preempted=True) is SaveKind.EMERGENCY
    assert policy.decide(4, preempted=False) is SaveKind.DURABLE  # both due: the durable one
    assert policy.decide(6, preempted=False) is SaveKind.FAST
    assert policy.decide(7, preempted=False) is SaveKind.NONE
    assert SaveDecisionPolicy(None).decide(6, preempted=False) is SaveKind.NONE  # no tier


def test_ranks_agree_on_the_preemption_flag_every_agree_every_steps() -> None:
    policy = SaveDecisionPolicy(None, agree_every=4)
    assert [step for step in range(10) if policy.agrees_at(step)] == [0, 4, 8]
    assert all(SaveDecisionPolicy(None).agrees_at(step) for step in range(5))


@pytest.mark.parametrize(
    ("seconds", "now", "deadline", "fits"),
    [
        (10.0, 100.0, 112.5, True),  # 100 + 1.2 * 10 = 112 < 112.5
        (10.0, 100.0, 112.0, False),  # not strictly before the deadline
        (10.0, 100.0, 111.0, False),  # fits without the margin, not with it
        (None, 100.0, 100.5, True),  # no prediction yet: try
        (1e9, 100.0, None, True),  # no deadline known: try
    ],
)
def test_a_save_fits_before_a_deadline_only_with_its_margin(
    seconds: float | None, now: float, deadline: float | None, fits: bool
) -> None:
    assert SAVE_TIME_MARGIN == 1.2
    assert SaveDecisionPolicy(None).fits(seconds, now=now, deadline=deadline) is fits
