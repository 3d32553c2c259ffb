"""Metrics: the built-in writers after real saves, restores and a preemption, and a callable
that raises (training goes on)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from spotckpt import CheckpointManager, Config, ConfigError, PreemptionWatcher, TrainState
from spotckpt.metrics import JsonLinesMetrics, PrometheusTextfileMetrics

_SAMPLE = re.compile(r"^([a-z_]+) (\S+)$")


def _prometheus(path: Path) -> dict[str, float]:
    """Samples of a textfile, checking that every sample has HELP and TYPE lines before it."""
    samples: dict[str, float] = {}
    described: set[str] = set()
    for line in path.read_text().splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            described.add(line.split()[2])
            continue
        match = _SAMPLE.match(line)
        assert match is not None, line
        assert match.group(1) in described, line
        samples[match.group(1)] = float(match.group(2))
    return samples


def _run(root: Path, metrics: Any) -> None:
    """Two saves and a preemption in one session; a restore in the next."""
    state = TrainState(model=nn.Linear(4, 2), rng=False)
    watcher = PreemptionWatcher()
    with CheckpointManager(str(root), preemption=watcher, interval_steps=2, metrics=metrics) as m:
        for step in range(1, 6):
            if step == 5:
                watcher.trigger("SIGTERM", deadline=time.monotonic() + 60)
            m.maybe_save(step, state)
    with CheckpointManager(str(root), preemption=False, interval_steps=2, metrics=metrics) as m:
        assert m.restore(state) == 5


def test_json_lines_and_prometheus_textfile_after_saves(tmp_path: Path) -> None:
    lines = JsonLinesMetrics(tmp_path / "out" / "metrics.jsonl")
    textfile = PrometheusTextfileMetrics(tmp_path / "textfile" / "spotckpt.prom")

    def both(record: dict[str, Any]) -> None:
        lines(record)
        textfile(record)

    _run(tmp_path / "ck", both)
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r.get("step")) for r in records] == [
        ("save", 2),
        ("save", 4),
        ("save", 5),
        ("preemption", None),
        ("restore", 5),
    ]
    assert all(r["stall_s"] > 0 and r["bytes"] > 0 for r in records if r["kind"] == "save")
    assert records[3]["source"] == "SIGTERM" and records[3]["steps_lost"] == 0

    samples = _prometheus(tmp_path / "textfile" / "spotckpt.prom")
    assert samples["spotckpt_saves_total"] == 3
    assert samples["spotckpt_evictions_total"] == 1
    assert samples["spotckpt_restores_total"] == 1
    assert samples["spotckpt_steps_lost_total"] == 0
    assert samples["spotckpt_interval_steps"] == 2
    assert samples["spotckpt_last_save_step"] == 5
    assert samples["spotckpt_last_save_stall_seconds"] == records[2]["stall_s"]
    assert samples["spotckpt_last_restore_seconds"] == records[4]["restore_s"]
    assert os.listdir(tmp_path / "textfile") == ["spotckpt.prom"]  # no temporary file left
    assert (tmp_path / "textfile" / "spotckpt.prom").stat().st_mode & 0o044 == 0o044


def test_a_raising_metrics_callable_never_breaks_saving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []

    def broken(record: dict[str, Any]) -> None:
        calls.append(record["kind"])
        raise RuntimeError("metrics backend is down")

    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        _run(tmp_path / "ck", broken)
    assert calls == ["save", "save", "save", "preemption", "restore"]
    failures = [r for r in caplog.records if "metrics callable failed" in r.getMessage()]
    assert len(failures) == 2  # once per manager, not once per record
    assert "metrics backend is down" in failures[0].getMessage()


def test_metrics_is_code_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SPOTCKPT_"):
            monkeypatch.delenv(name)
    (tmp_path / "spotckpt.toml").write_text('uri = "memory://m"\nmetrics = "prometheus"\n')
    with pytest.raises(ConfigError, match=r"spotckpt.toml: metrics: can only be given in code"):
        Config.load(tmp_path)
    (tmp_path / "spotckpt.toml").write_text('uri = "memory://m"\n')
    monkeypatch.setenv("SPOTCKPT_METRICS", "x")
    with pytest.raises(ConfigError, match="SPOTCKPT_METRICS: metrics can only be given in code"):
        Config.load(tmp_path)
    monkeypatch.delenv("SPOTCKPT_METRICS")
    sink = JsonLinesMetrics(tmp_path / "m.jsonl")
    assert Config.load(tmp_path, metrics=sink).metrics is sink
    with pytest.raises(ConfigError, match="metrics: must be a callable"):
        CheckpointManager(str(tmp_path / "ck"), preemption=False, metrics="prometheus")
