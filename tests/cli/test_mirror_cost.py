"""Mirror cost and lag (docs/mirrors.md "Costs", docs/cost.md, docs/cli.md): egress rates per
provider pair, overridable by a price file; ``spotckpt mirror`` prints its plan and the egress
price before copying and the bytes moved after; ``spotckpt ls --mirrors`` shows each mirror's lag
(and a mirror that cannot be read); ``spotckpt stats`` shows the run's mirror egress and each
mirror's latest lag from the ``mirror`` events a job's saves write, across a compaction."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.cli import main
from spotckpt.cost import (
    DEFAULT_EGRESS_PER_GB,
    DEFAULT_PRICES,
    PriceTable,
    egress_per_gb,
    load_prices,
    provider,
)
from spotckpt.errors import InvalidArgumentError
from spotckpt.goodput import EventLog, Totals, summary_problem
from spotckpt.layout import EVENTS_PREFIX, manifest_key
from spotckpt.storage import open_store

NUMEL = 1 << 12
"""Elements of a small state (16 KiB of float32)."""


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(NUMEL, generator=torch.Generator().manual_seed(step))}


def _save(uri: str, steps: tuple[int, ...], mirrors: list[str] | None = None) -> None:
    """Real saves; with `mirrors`, each committed step is mirrored (and a mirror event written)."""
    with CheckpointManager(uri, preemption=False, keep_last=None, mirrors=mirrors) as manager:
        for step in steps:
            manager.save(step, _state(step))
            manager.wait()


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``spotckpt ARGS`` in this process: exit status, stdout, stderr."""
    with pytest.raises(SystemExit) as done:
        main(list(args))
    captured = capsys.readouterr()
    code = done.value.code
    assert isinstance(code, int), code
    return code, captured.out, captured.err


def _step_bytes(uri: str, steps: list[int]) -> int:
    """The bytes of the objects the manifests of `steps` name (what a mirror copies)."""
    catalog = Catalog(open_store(uri))
    return sum(
        expected.size
        for step in steps
        for expected in catalog.stored_objects(step, catalog.manifest_bytes(step)).values()
    )


def _prices(tmp_path: Path, document: dict[str, object]) -> str:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(document))
    return str(path)


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # no spotckpt.toml of the project's
    monkeypatch.delenv("SPOTCKPT_MIRRORS", raising=False)
    return tmp_path


# The rates --------------------------------------------------------------------------------------


def test_egress_rates_per_provider_pair_and_their_override(here: Path) -> None:
    assert [provider(u) for u in ("s3://b/r", "gs://b/r", "az://c/r", "/tmp/r", "memory://x")] == [
        "s3",
        "gs",
        "az",
        "local",
        "local",
    ]
    rate = lambda source, target: egress_per_gb(DEFAULT_PRICES, source, target)  # noqa: E731
    assert rate("s3://a/r", "s3://b/r") == 0.02  # one provider: priced as another region
    assert rate("gs://a/r", "gs://b/r") == 0.02 and rate("az://a/r", "az://b/r") == 0.02
    assert rate("s3://a/r", "gs://b/r") == 0.09 and rate("s3://a/r", "/mnt/r") == 0.09
    assert rate("gs://a/r", "az://b/r") == 0.12 and rate("az://a/r", "s3://b/r") == 0.087
    assert rate("/data/r", "s3://b/r") == 0.0 and rate("/data/r", "/other/r") == 0.0
    assert len(DEFAULT_EGRESS_PER_GB) == 16

    table = load_prices(_prices(here, {"egress_per_gb_between": {"s3->gs": 0.05}}))
    assert egress_per_gb(table, "s3://a/r", "gs://b/r") == 0.05
    assert egress_per_gb(table, "s3://a/r", "az://b/r") == 0.09  # the others keep the defaults
    assert table.write_per_1000 == DEFAULT_PRICES.write_per_1000
    assert load_prices(_prices(here, {"write_per_1000": 1.0})) == PriceTable(write_per_1000=1.0)
    for wrong in ({"s3->mars": 1.0}, {"s3->gs": -1}, {"s3->gs": "cheap"}, ["s3->gs"]):
        with pytest.raises(InvalidArgumentError, match="egress_per_gb_between"):
            load_prices(_prices(here, {"egress_per_gb_between": wrong}))


# spotckpt mirror --------------------------------------------------------------------------------


def test_mirror_prints_its_plan_and_egress_before_and_after_copying(
    s3_uri: str, gcs_uri: str, here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(s3_uri, (1, 2))
    size = _step_bytes(s3_uri, [1, 2])
    code, out, err = _cli(capsys, "mirror", s3_uri, gcs_uri, "--step", "1")
    assert code == 0, (out, err)
    lines = out.splitlines()
    one = _step_bytes(s3_uri, [1])
    assert lines[0].startswith("plan: step 1: 1 object, "), lines
    assert lines[0].endswith(f"egress {one / 1e9 * 0.09:.6f} USD (estimated) at 0.09 USD/GB")
    assert lines[-1].endswith(f": egress {one / 1e9 * 0.09:.6f} USD (estimated)"), lines

    prices = _prices(here, {"egress_per_gb_between": {"s3->gs": 2000.0}, "currency": "EUR"})
    code, out, err = _cli(capsys, "mirror", s3_uri, gcs_uri, "--json", "--prices", prices)
    assert code == 0, (out, err)
    document = json.loads(out)
    two = size - one
    assert document["plan"] == {
        "steps": [2],
        "objects": 1,
        "bytes": two,
        "egress_per_gb": 2000.0,
        "egress_cost": pytest.approx(two / 1e9 * 2000.0),
        "currency": "EUR",
    }
    assert document["copied_bytes"] == two and [c["step"] for c in document["copied"]] == [2]
    assert document["egress_cost"] == pytest.approx(two / 1e9 * 2000.0)
    assert document["steps_behind"] == 0  # the fields that were there stay

    code, out, err = _cli(capsys, "mirror", s3_uri, gcs_uri, "--json")
    document = json.loads(out)
    assert code == 0 and document["plan"]["bytes"] == 0 and document["egress_cost"] == 0.0


def test_follow_prints_the_plan_once_at_start(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = here / "source", here / "mirror"
    _save(str(source), (1,))
    prices = _prices(here, {"egress_per_gb_between": {"local->local": 1000.0}})

    def interrupt_once_mirrored() -> None:
        deadline = time.monotonic() + 60
        while not (target / manifest_key(1)).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a second round, which copies nothing and prints nothing
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_mirrored, daemon=True).start()
    code, out, err = _cli(
        capsys, "mirror", str(source), str(target), "--follow", "--every", "0.1", "--json",
        "--prices", prices,
    )  # fmt: skip
    assert code == 0, (out, err)
    documents = [json.loads(line) for line in out.splitlines()]
    size = _step_bytes(str(source), [1])
    assert [("plan" in d, "copied" in d) for d in documents] == [(True, False), (False, True)]
    assert documents[0]["plan"]["steps"] == [1] and documents[0]["plan"]["bytes"] == size
    assert documents[1]["egress_cost"] == pytest.approx(size / 1e9 * 1000.0)


# spotckpt ls --mirrors --------------------------------------------------------------------------


def test_ls_mirrors_shows_each_mirror_s_lag_and_one_that_cannot_be_read(
    here: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, kept, behind = here / "source", here / "kept", here / "behind"
    missing = here / "missing"
    _save(str(source), (1, 2), mirrors=[str(kept)])
    code, out, err = _cli(capsys, "mirror", str(source), str(behind), "--step", "1")
    assert code == 0, (out, err)
    monkeypatch.setenv("SPOTCKPT_MIRRORS", f"{kept},{behind},{missing}")

    code, out, err = _cli(capsys, "ls", str(source), "--mirrors", "--json")
    assert code == 0, (out, err)
    rows = json.loads(out)["mirrors"]
    assert [row["mirror"] for row in rows] == [str(kept), str(behind), str(missing)]
    assert (rows[0]["step"], rows[0]["steps_behind"], rows[0]["seconds_behind"]) == (2, 0, 0.0)
    assert (rows[1]["step"], rows[1]["steps_behind"]) == (1, 1)
    assert rows[1]["seconds_behind"] >= 0 and "error" not in rows[1]
    assert rows[2]["step"] is None and "does not exist" in rows[2]["error"]

    code, out, err = _cli(capsys, "ls", str(source), "--mirrors")
    assert code == 0, (out, err)
    table = out.split("\n\n")[1].splitlines()
    assert table[0].split() == ["MIRROR", "NEWEST", "STEP", "BEHIND"]
    assert table[1].split()[1:] == ["2", "up", "to", "date"]
    assert table[2].split()[1:4] == ["1", "1", "step,"]
    assert table[3].split()[1:4] == ["-", "cannot", "be"] and "RootMissingError" in table[3]

    code, out, err = _cli(capsys, "ls", str(source), "--mirrors", "--mirror", "nosuch://x/y")
    assert code == 0, (out, err)
    assert "cannot be read" in out and str(kept) not in out  # --mirror replaces the config's
    code, out, err = _cli(capsys, "ls", str(source), "--json")
    assert code == 0 and "mirrors" not in json.loads(out)


# spotckpt stats ---------------------------------------------------------------------------------


def test_stats_shows_mirror_egress_and_lag_from_the_events(
    s3_uri: str, gcs_uri: str, here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(s3_uri, (1, 2), mirrors=[gcs_uri])
    size = _step_bytes(s3_uri, [1, 2])
    code, out, err = _cli(capsys, "stats", s3_uri, "--json")
    assert code == 0, (out, err)
    stats = json.loads(out)
    assert stats["mirror_catch_ups"] == 2 and stats["mirror_bytes"] == size
    assert stats["cost_mirror_egress"] == pytest.approx(size / 1e9 * 0.09)
    (mirror,) = stats["mirrors"]
    assert mirror["mirror"] == gcs_uri and mirror["bytes"] == size
    assert (mirror["step"], mirror["steps_behind"], mirror["failed_steps"]) == (2, 0, 0)
    assert mirror["egress_per_gb"] == 0.09 and stats["saves"] == 2

    prices = _prices(here, {"egress_per_gb_between": {"s3->gs": 10.0}})
    code, out, err = _cli(capsys, "stats", s3_uri, "--prices", prices)
    assert code == 0, (out, err)
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert f"2 catch-ups: egress {size / 1e9 * 10:.4f} USD (estimated)" in rows["mirrored"]
    assert f"{gcs_uri}: step 2, 0 steps behind, 0 s (latest event)" in rows["mirror"]
    assert rows["events"].endswith("(2 saves, 0 restores, 2 mirror catch-ups)"), rows["events"]


def test_mirror_egress_survives_compaction_and_older_summaries_read(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = here / "source", here / "mirror"
    _save(str(source), (1, 2, 3), mirrors=[str(target)])
    size = _step_bytes(str(source), [1, 2, 3])
    log = EventLog(open_store(str(source)), max_events=4)
    assert log.compact() > 0  # the oldest events, mirror events among them, in the summary
    summary = json.loads((source / EVENTS_PREFIX / "summary.json").read_text())
    assert summary["counts"]["mirror"] >= 1 and summary_problem(summary) is None
    prices = _prices(here, {"egress_per_gb_between": {"local->local": 1000.0}})
    code, out, err = _cli(capsys, "stats", str(source), "--json", "--prices", prices)
    assert code == 0, (out, err)
    stats = json.loads(out)
    assert stats["mirror_catch_ups"] == 3 and stats["mirror_bytes"] == size
    assert stats["cost_mirror_egress"] == pytest.approx(size / 1e9 * 1000.0)
    (mirror,) = stats["mirrors"]  # the events not compacted yet: the newest
    assert mirror["bytes"] < size and mirror["step"] == 3 and mirror["steps_behind"] == 0
    assert stats["saves"] == 3  # a mirror's step is not the run's

    older = {k: v for k, v in summary.items() if k != "sums"} | {
        "sums": {k: v for k, v in summary["sums"].items() if not k.startswith("mirror")},
        "counts": {k: v for k, v in summary["counts"].items() if k != "mirror"},
    }
    assert summary_problem(older) is None and "mirror" not in Totals.from_dict(older).counts
    forged = summary | {"sums": summary["sums"] | {"mirror_bytes": 1e18}}
    assert "bytes in" in (summary_problem(forged) or "")
