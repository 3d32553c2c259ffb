"""The interval model: Daly's interval, the ``"auto"`` interval model, and managers with ``"auto"``.

The interval model is driven with a fake clock (no sleeping); the managers save to a local folder
and to the moto S3 server, with forged figures in their events where a test says so.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from goodput_support import small_model

from spotckpt import CheckpointManager, Config, ConfigError, TrainState
from spotckpt.config import DEFAULT_MAX_INTERVAL_STEPS, Settings
from spotckpt.goodput import SUMMARY_FORMAT, Totals
from spotckpt.interval import (
    MIN_STEP_SAMPLES,
    PRIOR_EVICTIONS_PER_HOUR,
    STARTING_INTERVAL_STEPS,
    IntervalModel,
    daly_interval_s,
    eviction_rate,
    expected_goodput,
    interval_steps_for,
)
from spotckpt.layout import EVENT_SUMMARY_KEY
from spotckpt.storage import ObjectStore, open_store

from tests_support import free_port


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def daly(delta: float, mtbf: float) -> float:
    """Daly (2006), eq. for the higher-order optimum, written out independently."""
    if delta >= 2 * mtbf:
        return mtbf
    return (
        math.sqrt(2 * delta * mtbf)
        * (1 + (1 / 3) * math.sqrt(delta / (2 * mtbf)) + (1 / 9) * (delta / (2 * mtbf)))
        - delta
    )


# Daly's formula -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("delta", "mtbf"), [(10.0, 3600.0), (60.0, 1800.0), (0.5, 86400.0), (300.0, 7200.0)]
)
def test_daly_interval_matches_the_closed_form(delta: float, mtbf: float) -> None:
    assert daly_interval_s(delta, mtbf) == pytest.approx(daly(delta, mtbf), rel=1e-12)
    # the first-order term dominates: close to Young's sqrt(2δM) - δ, and above it
    assert daly_interval_s(delta, mtbf) > math.sqrt(2 * delta * mtbf) - delta


@pytest.mark.parametrize(("delta", "mtbf"), [(100.0, 50.0), (100.0, 10.0), (7200.0, 3600.0)])
def test_daly_interval_is_mtbf_once_the_cost_reaches_twice_the_mtbf(
    delta: float, mtbf: float
) -> None:
    assert daly_interval_s(delta, mtbf) == mtbf


def test_interval_in_steps_rounds_and_clamps() -> None:
    tau = daly(60.0, 1800.0)  # about 425.6 s
    assert interval_steps_for(60.0, 1800.0, 10.0) == round(tau / 10.0) == 43
    assert interval_steps_for(60.0, 1800.0, 10.0, minimum=50) == 50
    assert interval_steps_for(60.0, 1800.0, 10.0, maximum=20) == 20
    assert interval_steps_for(60.0, 1800.0, 1e6) == 1  # never below one step
    assert interval_steps_for(100.0, 10.0, 2.0) == 5  # δ >= 2M: τ = M


def test_expected_goodput_follows_dalys_model() -> None:
    assert expected_goodput(10.0, math.inf, 90.0) == pytest.approx(0.9)
    delta, mtbf, restart = 60.0, 1800.0, 30.0
    tau = daly(delta, mtbf)
    value = expected_goodput(delta, mtbf, tau, restart)
    wall = mtbf * math.exp(restart / mtbf) * (math.exp((tau + delta) / mtbf) - 1)
    assert value == pytest.approx(tau / wall)
    assert 0 < value < 1
    for other in (tau / 3, tau * 3):  # the optimum is (near) the best interval
        assert expected_goodput(delta, mtbf, other, restart) < value
    assert expected_goodput(delta, mtbf, 0.0) == 0.0


def test_eviction_rate_starts_at_the_prior_and_tends_to_the_observed_rate() -> None:
    assert eviction_rate(0, 0.0) == pytest.approx(PRIOR_EVICTIONS_PER_HOUR)
    assert eviction_rate(0, 0.0, configured=3.0) == 3.0
    assert eviction_rate(1000, 500 * 3600.0) == pytest.approx(2.0, rel=0.01)
    assert eviction_rate(0, 1000 * 3600.0) < 0.002


# The interval model -------------------------------------------------------------------------------


def test_auto_keeps_the_starting_interval_until_step_time_and_cost_are_measured() -> None:
    clock = FakeClock()
    model = IntervalModel(eviction_rate_per_hour=2.0, clock=clock)
    assert model.update() == STARTING_INTERVAL_STEPS
    model.record_stall(60.0)  # a cost, but no step time yet
    assert model.update() == STARTING_INTERVAL_STEPS
    for step in range(1, MIN_STEP_SAMPLES + 1):  # MIN_STEP_SAMPLES calls: one sample short
        clock.now += 10.0
        model.observe_step(step)
    assert model.step_time_s is None
    assert model.update() == STARTING_INTERVAL_STEPS
    clock.now += 10.0
    model.observe_step(MIN_STEP_SAMPLES + 1)
    assert model.step_time_s == pytest.approx(10.0)
    assert model.update() == round(daly(60.0, 1800.0) / 10.0)


def test_starting_interval_respects_the_bounds() -> None:
    assert IntervalModel(max_interval_steps=20).interval_steps == 20
    assert IntervalModel(min_interval_steps=500).interval_steps == 500


def test_step_time_ignores_the_first_call_and_time_spent_saving() -> None:
    clock = FakeClock()
    model = IntervalModel(eviction_rate_per_hour=1.0, clock=clock)
    clock.now += 500.0  # start-up and the first step: not a step time
    model.observe_step(1)
    for step in range(2, 12):
        clock.now += 2.0
        if step % 4 == 0:
            clock.now += 30.0  # a blocking save between two calls...
            model.record_stall(30.0)  # ...that the manager reports
        model.observe_step(step)
    assert model.step_time_s == pytest.approx(2.0)
    model.restart_measurement()  # after a restore: the next call starts anew
    clock.now += 400.0
    model.observe_step(50)
    assert model.step_time_s == pytest.approx(2.0)


def test_interval_changes_are_logged_with_the_figures(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    model = IntervalModel(eviction_rate_per_hour=2.0, max_interval_steps=1000, clock=clock)
    for step in range(1, 6):
        clock.now += 10.0
        model.observe_step(step)
    model.record_stall(60.0)
    with caplog.at_level(logging.INFO, logger="spotckpt"):
        model.update()
        model.update()  # unchanged: no second line
    lines = [r.getMessage() for r in caplog.records if "auto checkpoint interval" in r.message]
    assert lines == [
        "auto checkpoint interval: 100 -> 43 steps (save cost δ=60.000 s, mean time between "
        "evictions M=1800 s, step time 10.0000 s)"
    ]


def test_seeded_history_gives_an_interval_before_the_first_save() -> None:
    history = Totals()
    for _ in range(3):
        history.add({"kind": "save", "stall_s": 20.0, "train_s": 1200.0, "step_time_s": 5.0})
    history.add({"kind": "preemption", "train_s": 10.0, "steps_lost": 0})
    model = IntervalModel(clock=FakeClock())
    model.seed(history)
    figures = model.figures()
    assert figures.step_time_s == 5.0 and figures.save_cost_s == 20.0
    assert figures.evictions_per_hour == pytest.approx(eviction_rate(1, 3610.0))
    assert model.update() == round(daly(20.0, figures.mtbf_s) / 5.0)


def test_simulated_run_with_evictions_converges_near_dalys_optimum() -> None:
    """Evictions at a known rate (Poisson), fixed step time and save cost, restarts that seed a
    new model from the recorded events: the interval ends within 8 % of Daly's for the true
    rate (the estimated rate's own error, 1/sqrt(evictions), is about 5 %, and τ varies as
    its square root)."""
    rng = random.Random(1234)
    step_time, cost, rate = 10.0, 60.0, 2.0  # s, s, per hour: M = 1800 s
    optimum = round(daly(cost, 3600 / rate) / step_time)  # 43 steps
    clock = FakeClock(0.0)
    history = Totals()
    chosen: list[int] = []
    step = 0
    while clock.now < 200 * 3600:  # about 400 evictions
        eviction = clock.now + rng.expovariate(rate / 3600)
        model = IntervalModel(clock=clock)
        model.seed(history)
        interval = model.update()
        chosen.append(interval)  # what a (re)started session begins with, from the events
        last_saved = step
        while True:
            clock.now += step_time
            step += 1
            if clock.now >= eviction:
                history.add({"kind": "preemption", "train_s": model.take_training_s()})
                break
            model.observe_step(step)
            if step - last_saved >= interval:
                clock.now += cost
                model.record_stall(cost)
                interval = model.update()
                history.add(
                    {
                        "kind": "save",
                        "stall_s": cost,
                        "train_s": model.take_training_s(),
                        "step_time_s": model.step_time_s,
                        "interval_steps": interval,
                    }
                )
                last_saved = step
    assert chosen[0] == STARTING_INTERVAL_STEPS
    assert history.counts["preemption"] > 300
    late = chosen[len(chosen) // 2 :]
    assert all(abs(value - optimum) <= 0.08 * optimum for value in late), (optimum, late)


# The manager with "auto" --------------------------------------------------------------------------


def test_manager_auto_interval_saves_when_enough_steps_passed(tmp_path: Path) -> None:
    """A fake clock (real time plus an injected step time) in the manager's model: the first
    save comes at the starting interval, then every save comes `interval` steps after the
    previous one, `interval` being Daly's for the figures measured at that save."""
    offset = [0.0]
    records: list[dict[str, Any]] = []
    state = TrainState(model=small_model(), rng=False)
    manager = CheckpointManager(
        str(tmp_path / "ck"),
        preemption=False,
        interval_steps="auto",
        eviction_rate_per_hour=2.0,
        min_interval_steps=3,
        max_interval_steps=150,
        metrics=records.append,
    )
    manager.goodput.model.clock = lambda: time.monotonic() + offset[0]
    expected: list[int] = []
    with manager:
        assert manager.restore(state) is None
        assert manager.interval_steps == STARTING_INTERVAL_STEPS == 100
        for step in range(1, 2000):
            offset[0] += 0.5
            if len(expected) == 5:
                break
            if manager.maybe_save(step, state):
                figures = manager.goodput.model.figures()
                assert figures.step_time_s is not None and figures.save_cost_s is not None
                expected.append(
                    interval_steps_for(figures.save_cost_s, 1800.0, figures.step_time_s, 3, 150)
                )
                assert manager.interval_steps == expected[-1]
    saves = [r for r in records if r["kind"] == "save"]
    assert saves[0]["step"] == 100
    for previous, current in itertools.pairwise(saves):
        assert current["step"] - previous["step"] == previous["interval_steps"]
    assert [r["interval_steps"] for r in saves] == expected
    assert len(saves) == 5
    assert all(0.5 <= r["step_time_s"] < 5 for r in saves)


def test_auto_from_the_environment_and_a_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("SPOTCKPT_"):
            monkeypatch.delenv(name)
    (tmp_path / "spotckpt.toml").write_text(
        'uri = "memory://g"\ninterval_steps = "auto"\neviction_rate_per_hour = 1.5\n'
        "min_interval_steps = 10\n"
    )
    config = Config.load(tmp_path)
    assert (config.interval_steps, config.eviction_rate_per_hour) == ("auto", 1.5)
    assert config.min_interval_steps == 10
    assert config.max_interval_steps == DEFAULT_MAX_INTERVAL_STEPS
    monkeypatch.setenv("SPOTCKPT_INTERVAL_STEPS", "250")
    monkeypatch.setenv("SPOTCKPT_MAX_INTERVAL_STEPS", "400")
    config = Config.load(tmp_path)
    assert (config.interval_steps, config.max_interval_steps) == (250, 400)
    monkeypatch.setenv("SPOTCKPT_INTERVAL_STEPS", "auto")
    assert Config.load(tmp_path).interval_steps == "auto"
    monkeypatch.setenv("SPOTCKPT_INTERVAL_STEPS", "sometimes")
    with pytest.raises(ConfigError, match='SPOTCKPT_INTERVAL_STEPS: must be int, None or "auto"'):
        Config.load(tmp_path)


def test_settings_validate_the_goodput_fields(tmp_path: Path) -> None:
    assert Settings(interval_steps="auto").interval_steps == "auto"
    for bad, match in [
        ({"interval_steps": "often"}, 'must be int, None or "auto"'),
        ({"eviction_rate_per_hour": -1.0}, "must be a positive number"),
        ({"min_interval_steps": 0}, "must be at least 1"),
        ({"min_interval_steps": 10, "max_interval_steps": 5}, "at least min_interval_steps"),
        ({"max_events": 1}, "must be at least 4"),
    ]:
        with pytest.raises(ConfigError, match=match):
            CheckpointManager(str(tmp_path), preemption=False, **bad)


_TWO_RANKS = """
import json, os, sys, time
import torch.distributed as dist
from torch import nn
from spotckpt import CheckpointManager, TrainState

dist.init_process_group("gloo")
rank, root, out, async_save = dist.get_rank(), sys.argv[1], sys.argv[2], sys.argv[3] == "async"
offset = [0.0]
state = TrainState(model=nn.Linear(4, 2), rng=False)
manager = CheckpointManager(
    root, preemption=False, interval_steps="auto", eviction_rate_per_hour=2.0,
    min_interval_steps=3, max_interval_steps=150, async_save=async_save,
)
manager.goodput.model.clock = lambda: time.monotonic() + offset[0]
manager.restore(state)
saved = []
for step in range(1, 400):
    offset[0] += 0.25 * (rank + 1)  # each rank alone would choose another interval
    if manager.maybe_save(step, state):
        saved.append([step, manager.interval_steps])
manager.close()
with open(out, "w") as f:
    json.dump(saved, f)
dist.destroy_process_group()
"""


@pytest.mark.process
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_two_ranks_agree_on_the_auto_interval(tmp_path: Path, mode: str) -> None:
    """Each rank measures its own step time (a different one); all save the same steps, on the
    coordinator's interval."""
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(_TWO_RANKS)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["WORLD_SIZE"] = "2"
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(tmp_path / "ck"),
                str(tmp_path / f"{r}.json"),
                mode,
            ],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    zero, one = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    assert zero == one  # the same steps saved, with the same interval after each
    assert zero[0][0] == STARTING_INTERVAL_STEPS and len(zero) >= 3
    assert len({interval for _, interval in zero}) >= 2  # it did leave the starting interval


# Forged figures and the bounds of the auto interval -----------------------------------------------


def _forge_history(store: ObjectStore, summary: dict[str, Any]) -> None:
    """A summary that passes every field check but claims figures chosen by an adversary."""
    document = {"format": SUMMARY_FORMAT, **summary}
    store.put(EVENT_SUMMARY_KEY, json.dumps(document).encode())


def _restored_interval(root: str, **settings: Any) -> int | None:
    state = TrainState(model=small_model(), rng=False)
    with CheckpointManager(root, preemption=False, interval_steps="auto", **settings) as manager:
        manager.restore(state)
        return manager.interval_steps


@pytest.mark.process
def test_forged_figures_cannot_push_the_auto_interval_past_the_ceiling(root: str) -> None:
    """A recorded step time of 1e-155 s made Daly's interval about 1e157 steps: no periodic save
    for the rest of the run. The default ceiling bounds it, and so does a configured one."""
    store = open_store(root)
    _forge_history(
        store, {"events": 1, "counts": {"save": 1}, "recent": {"stall_s": [1.0]},
                "last": {"step_time_s": 1e-155}}
    )  # fmt: skip
    assert _restored_interval(root) == DEFAULT_MAX_INTERVAL_STEPS
    assert _restored_interval(root, max_interval_steps=None) == DEFAULT_MAX_INTERVAL_STEPS
    assert _restored_interval(root, max_interval_steps=250) == 250


def test_forged_figures_cannot_push_the_auto_interval_below_one(tmp_path: Path) -> None:
    """An hour per step and a millisecond per save: Daly's τ is 4 s, a thousandth of a step."""
    store = open_store(str(tmp_path))
    _forge_history(
        store, {"events": 1, "counts": {"save": 1}, "recent": {"stall_s": [0.001]},
                "last": {"step_time_s": 3600.0}}
    )  # fmt: skip
    assert _restored_interval(str(tmp_path)) == 1


@pytest.mark.process
def test_an_impossible_eviction_rate_gives_way_to_the_prior(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    """10**15 evictions in one second of training (a mean time between evictions far below the
    step time) made the interval 1 step: a save at every step. The prior is used instead."""
    store = open_store(root)
    _forge_history(
        store,
        {
            "events": 2,
            "counts": {"save": 1, "preemption": 10**15},
            "sums": {"train_s": 1.0},
            "recent": {"stall_s": [20.0]},
            "last": {"step_time_s": 5.0},
        },
    )
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        interval = _restored_interval(root)
    assert interval == round(daly(20.0, 3600 / PRIOR_EVICTIONS_PER_HOUR) / 5.0)
    assert any("the prior rate" in r.getMessage() for r in caplog.records)


def test_a_stall_longer_than_the_time_between_evictions_leaves_the_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A recorded save stall of 30 days (within an event's range, but far beyond the prior's 2 h
    between evictions) is impossible: the interval stays where it was instead of Daly's τ = M."""
    store = open_store(str(tmp_path))
    _forge_history(
        store, {"events": 1, "counts": {"save": 1}, "recent": {"stall_s": [30 * 86400.0]},
                "last": {"step_time_s": 5.0}}
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        assert _restored_interval(str(tmp_path)) == STARTING_INTERVAL_STEPS
    assert any("auto checkpoint interval kept at 100" in r.getMessage() for r in caplog.records)


def test_the_model_ignores_figures_that_cannot_be_true() -> None:
    """With a configured rate the figures are the user's: when they still contradict each other
    (evictions more often than steps), the interval is left as it is, never 0 or huge."""
    clock = FakeClock()
    model = IntervalModel(eviction_rate_per_hour=3600.0, clock=clock)  # M = 1 s
    for step in range(1, 6):
        clock.now += 10.0  # 10-s steps: more than M
        model.observe_step(step)
    model.record_stall(0.5)
    assert model.update() == STARTING_INTERVAL_STEPS
    assert interval_steps_for(60.0, 1800.0, 1e-300) == DEFAULT_MAX_INTERVAL_STEPS
    assert interval_steps_for(60.0, 1800.0, 1e-300, maximum=None) == DEFAULT_MAX_INTERVAL_STEPS
    assert interval_steps_for(math.nan, 1800.0, 10.0) == 1
