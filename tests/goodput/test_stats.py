"""``spotckpt stats``: what it says is measured, assumed or too little data (issue 44: a short
demo run read as "this library costs 70 %"), and figures that once broke it.
"""

from __future__ import annotations

import json
from pathlib import Path

from spotckpt.stats import (
    MIN_SAVES_FOR_FIGURES,
    MIN_TRAINING_S_FOR_FIGURES,
    GoodputStats,
    load_stats,
)
from spotckpt.storage import open_store

from tests_support import forged_event_key


def _short_run() -> GoodputStats:
    """The figures of a 40-second demo without an eviction, as issue 44 quotes them."""
    return GoodputStats(
        uri="s3://demo/spot",
        events=4,
        saves=2,
        restores=1,
        training_s=40.0,
        stall_median_s=0.25,
        stall_p95_s=0.3,
        overhead_share=0.7271,
        evictions_per_hour=0.5 * 2 / (2 + 40 / 3600),
        step_time_s=0.05,
        interval_steps=25,
        suggested_interval_steps=1900,
        estimated_goodput=0.313,
    )


def test_a_short_run_says_too_little_data_instead_of_figures() -> None:
    text = _short_run().text()
    assert "72.71" not in text and "31.3" not in text and "1900" not in text
    assert "too little data" in text
    overhead = next(line for line in text.splitlines() if line.strip().startswith("overhead"))
    assert "too little data" in overhead and "2 saves" in overhead and "40.0 s" in overhead
    rate = next(line for line in text.splitlines() if "eviction rate" in line)
    assert "assumed" in rate and "observed" not in rate.split("assumed")[0]
    line = _short_run().one_line()
    assert "72.7" not in line and "31.3" not in line and "too little data" in line


def test_enough_data_shows_measured_and_assumed_figures_labelled() -> None:
    stats = _short_run()
    stats.saves = MIN_SAVES_FOR_FIGURES
    stats.training_s = MIN_TRAINING_S_FOR_FIGURES
    text = stats.text()
    assert "72.71 %" in text and "31.3 %" in text and "1900 steps" in text
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "measured" in lines["overhead"]
    assert "assumed" in lines["eviction"] and "no eviction observed" in lines["eviction"]
    assert "assumed eviction rate" in lines["goodput"]
    stats.evictions, stats.training_s = 3, 6 * 3600.0
    stats.evictions_per_hour = (3 + 0.5 * 2) / (6 + 2)
    rate = next(line for line in stats.text().splitlines() if "eviction rate" in line)
    assert "3 evictions observed in 6.00 h" in rate and "assumed" not in rate.split("(")[0]


def test_stats_survive_a_vanishing_step_time(tmp_path: Path) -> None:
    """A recorded step time of 5e-324 s (the smallest float: within an event's range) and a zero
    stall made the goodput estimate divide by a wall time that underflowed to zero."""
    store = open_store(str(tmp_path))
    event = {"kind": "save", "stall_s": 0.0, "train_s": 1.0, "step_time_s": 5e-324}
    store.put(forged_event_key(1), json.dumps({**event, "interval_steps": 1}).encode())
    stats = load_stats(store)
    assert (stats.suggested_interval_steps, stats.estimated_goodput) == (1, 1.0)
