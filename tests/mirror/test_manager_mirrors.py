"""The `mirrors` setting: a job's committed steps copied to other roots in the background, waited
for by `wait` and `close`, stopped by a preemption notice, and a job restarted at a mirror that
goes on there and mirrors back. Covers the set-up and restart blocks of docs/mirrors.md."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "seams") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "seams"))

import seam_run  # noqa: E402

from spotckpt import CheckpointManager  # noqa: E402
from spotckpt.catalog import Catalog  # noqa: E402
from spotckpt.config import Config  # noqa: E402
from spotckpt.errors import ConfigError  # noqa: E402
from spotckpt.goodput import EventLog, event_problem  # noqa: E402
from spotckpt.layout import manifest_key  # noqa: E402
from spotckpt.mirror_spec import MirrorTarget, parse_mirrors  # noqa: E402
from spotckpt.mirroring import Mirror  # noqa: E402
from spotckpt.preemption import PreemptionWatcher  # noqa: E402
from spotckpt.storage import open_store  # noqa: E402
from spotckpt.verify import verify_checkpoint  # noqa: E402


def _steps(uri: str) -> list[int]:
    return Catalog(open_store(uri)).steps()


def _restores(uri: str, step: int, **settings: Any) -> None:
    manager = CheckpointManager(uri, preemption=False, keep_last=None, **settings)
    try:
        target = seam_run.blank()
        assert manager.restore(target) == step
        assert seam_run.same(target, seam_run.state(step))
    finally:
        manager.close()


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_committed_steps_appear_at_every_mirror_under_its_retention(
    tmp_path: Path, async_save: bool
) -> None:
    source, first, second = (str(tmp_path / name) for name in ("source", "m1", "m2"))
    manager = CheckpointManager(
        source,
        preemption=False,
        keep_last=2,
        incremental=True,
        async_save=async_save,
        mirrors=[first, second],
    )
    with manager:
        for step in (1, 2, 3, 4):
            manager.save(step, seam_run.state(step))
            manager.wait()  # waits for the mirror copies too
            assert _steps(first)[-1] == step and _steps(second)[-1] == step
    events = EventLog(open_store(source))
    mirrored = [json.loads(open_store(source).get(k)) for k in events.event_keys() if "mirror" in k]
    assert {e["mirror"] for e in mirrored} == {Path(first).as_uri(), Path(second).as_uri()}
    assert all(event_problem(e) is None and e["steps_behind"] == 0 for e in mirrored)
    assert sorted(e["step"] for e in mirrored if e["mirror"] == Path(first).as_uri()) == [
        1,
        2,
        3,
        4,
    ]
    job = Catalog(open_store(source)).job()
    for mirror in (first, second):
        assert _steps(mirror) == [3, 4]
        catalog = Catalog(open_store(mirror))
        assert catalog.job() == job
        for step in (3, 4):
            assert verify_checkpoint(catalog.store, step).ok
        _restores(mirror, 4)


def test_each_mirror_may_keep_its_own_number_of_steps(tmp_path: Path) -> None:
    source, short, everything = (str(tmp_path / name) for name in ("source", "short", "all"))
    mirrors = {short: {"keep_last": 1}, everything: {"keep_last": None}}
    with CheckpointManager(source, preemption=False, keep_last=2, mirrors=mirrors) as job:
        for step in (1, 2, 3):
            job.save(step, seam_run.state(step))
            job.wait()
    assert _steps(source) == [2, 3] and _steps(short) == [3] and _steps(everything) == [1, 2, 3]
    _restores(short, 3)
    with pytest.raises(ConfigError, match=r"keep_last of mirror .* at least 1"):
        Config.load(uri=source, mirrors={short: {"keep_last": 0}})


def test_the_setting_from_the_environment_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTCKPT_MIRRORS", "gs://b/run, az://c/run")
    config = Config.load(uri=str(tmp_path / "source"))
    assert [t.uri for t in parse_mirrors(config.mirrors)] == ["gs://b/run", "az://c/run"]
    secret = "AccountKey=" + "k" * 40
    monkeypatch.setenv(
        "SPOTCKPT_MIRRORS", json.dumps({"az://c/run": {"connection_string": secret}})
    )
    config = Config.load(uri=str(tmp_path / "source"))
    assert parse_mirrors(config.mirrors) == (
        MirrorTarget("az://c/run", {"connection_string": secret}),
    )
    assert secret not in repr(config)
    monkeypatch.setenv("SPOTCKPT_MIRRORS", '["gs://b/run", "az://c/run"]')
    config = Config.load(uri=str(tmp_path / "source"))
    assert [t.uri for t in parse_mirrors(config.mirrors)] == ["gs://b/run", "az://c/run"]
    monkeypatch.setenv("SPOTCKPT_MIRRORS", '"gs://b/run"')
    with pytest.raises(ConfigError, match="quotes, brackets or spaces"):
        Config.load(uri=str(tmp_path / "source"))
    monkeypatch.delenv("SPOTCKPT_MIRRORS")
    (tmp_path / "spotckpt.toml").write_text('mirrors = ["s3://b/one", "s3://b/one"]\n')
    with pytest.raises(ConfigError, match="mirrors: names a mirror twice"):
        Config.load(cwd=tmp_path, uri=str(tmp_path / "source"))
    with pytest.raises(ConfigError, match=r"mirrors: .*a table of named options") as refused:
        Config.load(uri="s3://b/r", mirrors={"gs://b/m": "token=" + "t" * 40})
    assert "t" * 40 not in str(refused.value)
    with pytest.raises(ConfigError, match="names the job's own root"):
        CheckpointManager(
            str(tmp_path / "source"), preemption=False, mirrors=str(tmp_path / "source")
        )


def test_a_notice_stops_mirror_copies_at_once_and_leaves_no_half_step(tmp_path: Path) -> None:
    source, mirror = str(tmp_path / "source"), str(tmp_path / "mirror")
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, azure=False)
    manager = CheckpointManager(
        source,
        preemption=watcher,
        keep_last=None,
        mirrors=[mirror],
        mirror_bandwidth=256 << 10,  # about 10 s for the step's 2.7 MB
        mirror_wait_s=600,
    )
    manager.save(1, seam_run.state(1))
    deadline = time.monotonic() + 60
    while not (tmp_path / "mirror" / "job.json").is_file():  # adopted as the copy starts
        assert time.monotonic() < deadline, "the mirror copy never started"
        time.sleep(0.05)
    watcher.trigger("test")
    started = time.monotonic()
    manager.close()
    assert time.monotonic() - started < 60, "close waited for mirror copies after a notice"
    assert not open_store(mirror).exists(manifest_key(1))
    # The next run (no notice) catches up as it starts, reusing what is there.
    CheckpointManager(source, preemption=False, keep_last=None, mirrors=[mirror]).close()
    assert _steps(mirror) == [1]
    with CheckpointManager(source, preemption=False, keep_last=None, mirrors=[mirror]) as again:
        again.save(2, seam_run.state(2))
    assert _steps(mirror) == [1, 2]
    _restores(mirror, 2)


def test_a_failing_mirror_is_a_warning_and_the_job_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = str(tmp_path / "other")
    with CheckpointManager(other, preemption=False, keep_last=None) as foreign:  # another job's
        for step in (3, 4, 5, 6, 7):
            foreign.save(step, seam_run.state(step))
    source = str(tmp_path / "source")
    with (
        caplog.at_level(logging.WARNING, logger="spotckpt"),
        CheckpointManager(source, preemption=False, mirrors=[other]) as manager,
    ):
        manager.save(1, seam_run.state(1))
        manager.wait()
        assert manager._mirrors is not None
        assert "belongs to job" in manager._mirrors.errors[Path(other).as_uri()]
    assert _steps(source) == [1] and _steps(other) == [3, 4, 5, 6, 7], "never retired there"
    assert any("mirroring to" in r.getMessage() for r in caplog.records)


def test_a_job_restarted_at_its_mirror_goes_on_and_mirrors_back(tmp_path: Path) -> None:
    primary, mirror = str(tmp_path / "primary"), str(tmp_path / "mirror")
    with CheckpointManager(primary, preemption=False, keep_last=None, mirrors=[mirror]) as job:
        for step in (1, 2):
            job.save(step, seam_run.state(step))
    # The primary's region is gone: the job restarts with the mirror as its root.
    with CheckpointManager(mirror, preemption=False, keep_last=None, mirrors=[primary]) as job:
        state = seam_run.blank()
        assert job.restore(state) == 2
        assert seam_run.same(state, seam_run.state(2))
        job.save(3, seam_run.state(3))
    assert _steps(primary) == [1, 2, 3]
    _restores(primary, 3)


def test_a_restore_does_not_wait_for_the_catch_up_at_start(tmp_path: Path) -> None:
    source, mirror = str(tmp_path / "source"), str(tmp_path / "mirror")
    with CheckpointManager(source, preemption=False, keep_last=None) as job:
        job.save(1, seam_run.state(1))
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, azure=False)
    job = CheckpointManager(
        source,
        preemption=watcher,
        keep_last=None,
        mirrors=[mirror],
        mirror_bandwidth=64 << 10,  # the catch-up of step 1 takes about 40 s
        mirror_wait_s=600,
    )
    try:
        state = seam_run.blank()
        assert job.restore(state) == 1
        assert job._mirrors is not None and not job._mirrors.wait(0), "restore waited"
    finally:
        watcher.trigger("test")  # stops the copy: close need not wait for it
        job.close()
    assert _steps(mirror) == []


def test_an_unexpected_failure_in_the_mirror_thread_is_loud_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    source, mirror = str(tmp_path / "source"), str(tmp_path / "mirror")
    real = Mirror.catch_up
    calls: list[int] = []

    def failing_once(self: Mirror, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Mirror, "catch_up", failing_once)
    with (
        caplog.at_level(logging.ERROR, logger="spotckpt"),
        CheckpointManager(source, preemption=False, keep_last=None, mirrors=[mirror]) as job,
    ):
        assert job._mirrors is not None
        job._mirrors.wait(60)
        assert "RuntimeError: a bug" in job._mirrors.errors[Path(mirror).as_uri()]
        job.save(1, seam_run.state(1))
        job.wait()
        assert Path(mirror).as_uri() not in job._mirrors.errors
    assert _steps(mirror) == [1]
    assert any("failed unexpectedly" in r.getMessage() for r in caplog.records)
