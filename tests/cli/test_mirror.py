"""``spotckpt mirror SRC DST`` (docs/cli.md): the committed steps a mirror lacks are copied and
verify and restore there bit for bit; a killed run leaves a sound mirror that a rerun completes;
``--follow`` mirrors new steps until SIGTERM; a damaged step exits 1 with the others mirrored, a
mirror of another job exits 2; S3 mirrors to Azure and GCS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.cli import main
from spotckpt.layout import manifest_key, step_folder
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from tests_support import SCRIPT, write_signing_key

SMALL = 1 << 12
"""Elements of a small state (16 KiB of float32)."""
LARGE = 1 << 20
"""Elements of a state of 4 MiB: seconds to copy under a bandwidth of 1 MB/s."""


def _state(step: int, numel: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(numel, generator=generator), "b": torch.full((7,), float(step))}


def _save(uri: str, steps: tuple[int, ...], numel: int = SMALL) -> None:
    with CheckpointManager(uri, preemption=False, keep_last=None) as manager:
        for step in steps:
            manager.save(step, _state(step, numel))
            manager.wait()


def _assert_sound(uri: str, expected: list[int], numel: int = SMALL) -> None:
    """The mirror's committed steps are `expected`, each verifies and restores bit for bit."""
    steps = Catalog(open_store(uri)).steps()
    assert steps == expected
    for step in steps:
        report = verify_checkpoint(open_store(uri), step)
        assert report.ok, (step, report.to_dict())
    with CheckpointManager(uri, preemption=False, keep_last=None) as manager:
        for step in steps:
            target = {"w": torch.zeros(numel), "b": torch.zeros(7)}
            assert manager.restore(target, step) == step
            wanted = _state(step, numel)
            assert all(torch.equal(target[name], wanted[name]) for name in wanted), step


def _mirror(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``spotckpt mirror ARGS`` in this process: exit status, stdout, stderr."""
    with pytest.raises(SystemExit) as done:
        main(["mirror", *args])
    captured = capsys.readouterr()
    code = done.value.code
    assert isinstance(code, int), code
    return code, captured.out, captured.err


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` (a cheap look at a folder) until it holds; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)


def _committed(root: Path, step: int) -> bool:
    return (root / manifest_key(step)).is_file()


def _in_flight(root: Path, step: int) -> bool:
    """Some of `step`'s objects are (being) written at `root`, its manifest is not."""
    folder = root / step_folder(step)
    return folder.is_dir() and any(folder.rglob("*")) and not _committed(root, step)


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    return subprocess.Popen(
        [str(SCRIPT), "mirror", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.chdir(tmp_path)  # no spotckpt.toml of the project's
    return tmp_path / "source", tmp_path / "mirror"


def test_local_mirror_text_and_json_and_a_second_run_copies_nothing(
    roots: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = roots
    _save(str(source), (1, 2))
    code, out, err = _mirror(capsys, str(source), str(target))
    assert code == 0, (out, err)
    lines = out.splitlines()
    assert len(lines) == 5, out
    assert lines[0].startswith("plan: steps 1, 2: 2 objects, "), lines[0]
    for line, step in zip(lines[1:], (1, 2), strict=False):
        assert line.startswith(f"step {step}: copied 1 object, ") and line.endswith(" s"), line
    assert lines[3] == "up to date"
    assert lines[4].startswith("moved ") and lines[4].endswith(" USD (estimated)"), lines[4]
    _assert_sound(str(target), [1, 2])

    code, out, err = _mirror(capsys, str(source), str(target), "--json")
    assert code == 0, (out, err)
    document = json.loads(out)
    assert document["copied"] == [] and document["failed"] == {}
    assert document["copied_bytes"] == 0 and document["steps_behind"] == 0
    assert document["target"] == target.as_uri()
    code, out, _ = _mirror(capsys, str(source), str(target), "--step", "1")
    assert (code, out.splitlines()[:3]) == (
        0,
        ["plan: nothing to copy", "step 1: already mirrored", "up to date"],
    )

    _save(str(source), (3,))
    code, out, _ = _mirror(capsys, str(source), str(target), "--json", "--keep-last", "2")
    document = json.loads(out)
    assert code == 0 and [c["step"] for c in document["copied"]] == [3]
    assert document["retired"] == [1] and document["copied_bytes"] > 4 * SMALL
    _assert_sound(str(target), [2, 3])


def test_follow_in_process_stops_on_sigint_and_restores_the_handlers(
    roots: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = roots
    _save(str(source), (1,))
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    gave_up = threading.Event()

    def interrupt_once_mirrored() -> None:
        deadline = time.monotonic() + 60
        while not _committed(target, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _committed(target, 1):
            gave_up.set()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_mirrored, daemon=True).start()
    code, out, err = _mirror(capsys, str(source), str(target), "--follow", "--every", "0.1")
    assert not gave_up.is_set(), "step 1 was not mirrored within 60 s"
    assert code == 0, (out, err)
    assert out.count("mirrored step 1 ") == 1 and "up to date" in out, out
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    _assert_sound(str(target), [1])


@pytest.mark.timeout(120)
def test_a_killed_mirror_is_sound_and_a_rerun_completes_it(roots: tuple[Path, Path]) -> None:
    source, target = roots
    _save(str(source), (1, 2), LARGE)
    child = _spawn(str(source), str(target), "--bandwidth", "1MB")
    try:
        _wait_for(
            lambda: (_committed(target, 1) and _in_flight(target, 2)) or child.poll() is not None,
            60,
            "the mirror's step 2 in flight",
        )
        assert child.poll() is None, child.communicate()
        child.kill()
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    assert _in_flight(target, 2)
    _assert_sound(str(target), [1], LARGE)

    rerun = subprocess.run(
        [str(SCRIPT), "mirror", str(source), str(target)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert rerun.returncode == 0, (rerun.stdout, rerun.stderr)
    lines = rerun.stdout.splitlines()
    assert lines[0].startswith("plan: step 2: "), lines
    assert lines[1].startswith("step 2: copied 1 object") and lines[2] == "up to date", lines
    _assert_sound(str(target), [1, 2], LARGE)


@pytest.mark.timeout(150)
def test_follow_mirrors_new_steps_and_sigterm_ends_a_copy_in_flight(
    roots: tuple[Path, Path],
) -> None:
    source, target = roots
    _save(str(source), (1,))
    child = _spawn(str(source), str(target), "--follow", "--every", "0.2", "--bandwidth", "1MB")
    try:
        _wait_for(lambda: _committed(target, 1) or child.poll() is not None, 60, "step 1 mirrored")
        assert child.poll() is None, child.communicate()
        _save(str(source), (2,))
        _wait_for(lambda: _committed(target, 2) or child.poll() is not None, 30, "step 2 mirrored")
        _save(str(source), (3,), LARGE)  # about 4 s to copy: SIGTERM comes during the copy
        _wait_for(lambda: _in_flight(target, 3) or child.poll() is not None, 30, "step 3 in flight")
        assert child.poll() is None, child.communicate()
        child.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, (out, err)
    assert time.monotonic() - stopping < 20, "the copy in flight should end at its next piece"
    lines = out.splitlines()
    assert len(lines) == 3, out
    assert lines[0].startswith("plan: ")  # at start: step 1, or nothing once copied
    assert " UTC: mirrored step 1 " in lines[1] and " UTC: mirrored step 2 " in lines[2]
    assert not _committed(target, 3)
    _assert_sound(str(target), [1, 2])


def test_a_damaged_step_exits_1_and_another_job_s_mirror_exits_2(
    roots: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, target = roots
    _save(str(source), (1, 2, 3))
    largest = max(
        (p for p in (source / step_folder(2)).rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x40
    largest.write_bytes(bytes(data))
    code, out, err = _mirror(capsys, str(source), str(target))
    assert code == 1, (out, err)
    failed = [line for line in out.splitlines() if "not mirrored" in line]
    assert len(failed) == 1 and failed[0].startswith("step 2: not mirrored: Corrupt"), out
    assert "CRC32C" in failed[0]
    assert err.splitlines()[-1] == "spotckpt: error: 1 step not mirrored: 2"
    _assert_sound(str(target), [1, 3])
    code, out, _ = _mirror(capsys, str(source), str(target), "--json")
    assert code == 1 and list(json.loads(out)["failed"]) == ["2"]  # one document: the report

    other = target.parent / "other"
    _save(str(other), (5,))  # another job's root where the mirror goes
    for extra in ((), ("--json",)):
        code, out, err = _mirror(capsys, str(source), str(other), *extra)
        assert code == 2, (out, err)
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("spotckpt: error: "), err
        assert "belongs to job" in lines[0]
        if extra:
            assert json.loads(out)["exit_code"] == 2
    assert Catalog(open_store(str(other))).steps() == [5]

    monkeypatch.setenv("SPOTCKPT_VERIFY_KEYS", str(write_signing_key(target.parent / "k.pem")))
    code, out, _ = _mirror(capsys, str(source), str(target.parent / "signed"), "--step", "1")
    assert code == 1 and "step 1: not mirrored: SignatureError" in out, out


@pytest.mark.process
@pytest.mark.timeout(180)
def test_s3_mirrors_to_azure_and_gcs(
    s3_uri: str,
    az_uri: str,
    gcs_uri: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    _save(s3_uri, (1, 2))
    connection = os.environ["AZURE_STORAGE_CONNECTION_STRING"]
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")  # the target's, by --target-option
    secret = "AccountKey=" + connection.split("AccountKey=")[1].split(";")[0]
    code, out, err = _mirror(
        capsys, s3_uri, az_uri, "--target-option", f"connection_string={connection}"
    )
    assert code == 0, (out, err)
    assert "\nup to date\n" in out and out.count("copied 1 object") == 2, out
    assert out.splitlines()[-1].startswith("moved "), out
    assert secret not in out + err
    code, out, err = _mirror(capsys, s3_uri, gcs_uri, "--json", "--copies", "2")
    assert code == 0, (out, err)
    assert [c["step"] for c in json.loads(out)["copied"]] == [1, 2]
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection)
    for uri in (az_uri, gcs_uri):
        steps = Catalog(open_store(uri)).steps()
        assert steps == [1, 2], uri
        for step in steps:
            assert verify_checkpoint(open_store(uri), step).ok, (uri, step)
        with CheckpointManager(uri, preemption=False, keep_last=None) as manager:
            target = {"w": torch.zeros(SMALL), "b": torch.zeros(7)}
            assert manager.restore(target) == 2
            assert torch.equal(target["w"], _state(2, SMALL)["w"]), uri
