"""The preloaded rank server (tests/preloaded.py) gives a rank what a fresh interpreter would:
the rank tests' exit statuses, outputs and signals are only as trustworthy as this."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from preloaded import PreloadedProcess

pytestmark = pytest.mark.process  # its tests start processes or servers

SCRIPT = """
import json, os, signal, sys, threading, time, atexit
mode = sys.argv[1]
print(json.dumps({
    "argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "marker": os.environ.get("MARKER"),
    "inherited": os.environ.get("ONLY_IN_THE_PARENT"), "path0": sys.path[0],
    "torch": "torch" in sys.modules, "session": os.getsid(0) == os.getpid(),
}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if mode == "exit":
    sys.exit(75)
if mode == "raise":
    raise ValueError("boom")
if mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "wait":
    signal.pause()
if mode == "late":  # a non-daemon thread finishes, then atexit runs, before the exit
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
    atexit.register(lambda: print("atexit ran", flush=True))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(SCRIPT)
    return path


def _start(script: Path, mode: str, **kw: bool) -> PreloadedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ONLY_IN_THE_PARENT"}
    return PreloadedProcess([str(script), mode], {**env, "MARKER": mode}, **kw)


def test_a_rank_sees_its_own_argv_environment_folder_and_main(
    script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONLY_IN_THE_PARENT", "1")
    process = _start(script, "ok")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    seen = json.loads(output.splitlines()[0])
    assert seen["argv"] == [str(script.resolve()), "ok"]
    assert seen["name"] == "__main__" and seen["marker"] == "ok" and seen["inherited"] is None
    assert seen["cwd"] == os.getcwd() and seen["path0"] == str(script.resolve().parent)
    assert seen["torch"] and not seen["session"]  # preloaded, in the parent's session
    assert "to stderr" in output


@pytest.mark.parametrize(
    ("mode", "status", "said"),
    [
        ("exit", 75, ""),
        ("raise", 1, "ValueError: boom"),
        ("sigkill", -signal.SIGKILL, ""),
        ("late", 0, "thread done\natexit ran"),
    ],
)
def test_exit_statuses_are_the_interpreter_s(
    script: Path, mode: str, status: int, said: str
) -> None:
    process = _start(script, mode)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == status, output
    assert said in output


def test_a_rank_in_a_session_of_its_own_takes_a_signal_to_its_group(script: Path) -> None:
    process = _start(script, "wait", new_session=True)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.5)
    assert process.poll() is None
    os.killpg(process.pid, signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGTERM, output
    assert '"session": true' in output


def test_a_rank_that_outlives_its_wait_can_be_killed(script: Path) -> None:
    process = _start(script, "wait")
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=0.5)
    process.kill()
    assert process.wait(timeout=120) == -signal.SIGKILL
    process.kill()  # after the exit: nothing to signal, no error


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs root")
def test_a_bound_folder_is_seen_by_that_rank_only(script: Path, tmp_path: Path) -> None:
    disk, base = tmp_path / "disk", tmp_path / "base"
    disk.mkdir()
    base.mkdir()
    (disk / "on-the-disk").write_text("")
    lister = tmp_path / "lister.py"
    lister.write_text("import os, sys\nprint(sorted(os.listdir(sys.argv[1])))\n")
    process = PreloadedProcess([str(lister), str(base)], dict(os.environ), bind=(disk, base))
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert output.strip() == "['on-the-disk']"
    assert not list(base.iterdir())  # the test's own view is unchanged
