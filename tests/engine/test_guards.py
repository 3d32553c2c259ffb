"""Replica agreement and the health gate (`spotckpt.engine.guards`), with real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.config import Settings
from spotckpt.engine.guards import Guard, check_replicas
from spotckpt.errors import ConfigError, HealthCheckError, ReplicaMismatchError

from integrity_worker import launch

NAME = "model.2.weight"


def _results(out: Path, prefix: str, world: int) -> list[dict]:
    return [json.loads((out / f"{prefix}-{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.process
@pytest.mark.parametrize("mode", ["all", "sample"])
def test_one_ranks_altered_replica_is_caught_and_nothing_is_committed(
    tmp_path: Path, mode: str
) -> None:
    # "sample": the altered tensor is saved at a step whose sample holds it
    bad_step = next(
        s for s in range(2, 10) if mode == "all" or Guard(s, "sample", None, 3).selects(NAME)
    )
    args = {"uri": str(tmp_path / "ck"), "out": str(tmp_path), "mode": mode, "bad_rank": 2}
    args["bad_step"] = bad_step
    for rank, result in enumerate(launch(3, "replica_flip", args)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    results = _results(tmp_path, "replica", 3)
    for result in results:
        assert "'model.2.weight'" in result["refused"]
        assert "rank(s) [2] hold one copy" in result["refused"]
        assert "rank(s) [0, 1] hold one copy" in result["refused"]
        assert result["after_refusal"] == [1]  # the previous checkpoint stays the newest
        assert result["end"] == [1, bad_step + 1]
    (event,) = results[0]["events"]
    assert event["step"] == bad_step and event["check"] == "replicas" and not event["emergency"]
    assert "model.2.weight" in event["reason"]


@pytest.mark.process
def test_healthy_ddp_batchnorm_commits_by_default_and_all_refuses_it(tmp_path: Path) -> None:
    """Why `replica_check` is off by default: BatchNorm's running statistics differ by rank in
    a healthy DDP job, so "all" refuses its saves."""
    args = {"uri": str(tmp_path / "ck"), "out": str(tmp_path)}
    for rank, result in enumerate(launch(2, "ddp_batchnorm", args)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    for result in _results(tmp_path, "batchnorm", 2):
        assert result["default_steps"] == [1]
        assert "running_mean" in result["refused"] or "running_var" in result["refused"]
        assert result["steps"] == [1]


@pytest.mark.process
def test_nan_gate_refuses_on_every_rank_and_the_next_clean_save_commits(tmp_path: Path) -> None:
    args = {"uri": str(tmp_path / "ck"), "out": str(tmp_path)}
    for rank, result in enumerate(launch(2, "nan_gate", args)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    for result in _results(tmp_path, "nan", 2):
        assert "refused on rank 1" in result["refused"]
        assert "'model.0.bias'" in result["refused"]
        assert result["after_refusal"] == [1]
        assert result["end"] == [1, 3]


@pytest.mark.process
def test_an_emergency_save_refused_by_the_gate_exits_75_and_says_so(tmp_path: Path) -> None:
    args = {"uri": str(tmp_path / "ck"), "out": str(tmp_path)}
    (result,) = launch(1, "emergency_refused", args)
    assert result.returncode == 75, result.stdout[-4000:]
    (outcome,) = _results(tmp_path, "emergency", 1)
    assert outcome["steps"] == [2]  # the periodic save of step 2 stays the newest
    preemption = [e for e in outcome["events"] if e["kind"] == "preemption"]
    refused = [e for e in outcome["events"] if e["kind"] == "refused"]
    assert len(preemption) == 1 and len(refused) == 1
    assert preemption[0]["step_saved"] == 2 and preemption[0]["steps_lost"] == 1
    assert "NaN or infinite" in preemption[0]["emergency_save_refused"]
    assert refused[0]["emergency"] is True and refused[0]["check"] == "health"


def test_a_callable_gate_refuses_with_its_reason(tmp_path: Path) -> None:
    def no_negative_step(state: dict) -> bool:
        return bool(state["step"].item() >= 0)

    with CheckpointManager(
        str(tmp_path), preemption=False, health_check=no_negative_step
    ) as manager:
        manager.save(1, {"step": torch.tensor(1)})
        with pytest.raises(HealthCheckError, match="no_negative_step returned False"):
            manager.save(2, {"step": torch.tensor(-1)})
        assert manager.steps() == [1]


def test_the_finite_gate_passes_integers_and_empty_tensors(tmp_path: Path) -> None:
    state = {"ids": torch.arange(5), "empty": torch.zeros(0), "half": torch.full((4,), 6e4).half()}
    with CheckpointManager(str(tmp_path), preemption=False, health_check="finite") as manager:
        manager.save(1, state)  # a half tensor whose sum overflows is still finite
        assert manager.steps() == [1]


def test_check_replicas_names_the_rarest_copy_first() -> None:
    reports = [{"a": 1, "b": 5}, {"a": 1, "b": 5}, {"a": 2, "b": 5}, {"a": 1}]
    with pytest.raises(ReplicaMismatchError, match=r"rank\(s\) \[2\] hold one copy; rank\(s\) "):
        check_replicas(7, reports)
    check_replicas(7, [{"a": 1}, {"a": 1}, None])


def test_sample_mode_checks_every_item_once_in_eight_saves() -> None:
    names = [f"layer.{i}.weight" for i in range(50)]
    seen = {n for step in range(8) for n in names if Guard(step, "sample", world_size=2).selects(n)}
    per_save = [sum(Guard(s, "sample", world_size=2).selects(n) for n in names) for s in range(8)]
    assert seen == set(names) and sum(per_save) == len(names)


def test_settings_take_the_checks_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from spotckpt.config import Config

    monkeypatch.setenv("SPOTCKPT_REPLICA_CHECK", "sample")
    monkeypatch.setenv("SPOTCKPT_HEALTH_CHECK", "finite")
    config = Config.load(uri="file:///tmp/x")
    assert (config.replica_check, config.health_check) == ("sample", "finite")
    monkeypatch.setenv("SPOTCKPT_HEALTH_CHECK", "positive")
    with pytest.raises(ConfigError, match="SPOTCKPT_HEALTH_CHECK"):
        Config.load(uri="file:///tmp/x")
    with pytest.raises(ConfigError, match="replica_check"):
        Settings(replica_check="some")
    assert Settings().replica_check == "off"  # healthy DDP jobs differ in BatchNorm buffers


def test_an_async_save_is_gated_in_the_background_and_refused_at_wait(tmp_path: Path) -> None:
    state = {"w": torch.ones(1000)}
    with CheckpointManager(
        str(tmp_path), preemption=False, health_check="finite", async_save=True
    ) as manager:
        manager.save(1, state)
        manager.wait()
        state["w"][5] = float("-inf")
        manager.save(2, state)  # staged: the gate runs on the staged copy, in the background
        with pytest.raises(HealthCheckError, match="'w'"):
            manager.wait()
        assert manager.steps() == [1]
