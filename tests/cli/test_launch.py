"""`spotckpt launch`: torchrun with the exit statuses a scheduler keys its restarts on.

Every run is a real launcher process (the installed console script, or ``python -m
spotckpt.launch``) with two real worker processes under torch's elastic agent; signals are real
signals. Two workers are used: a tiny script with no torch import (fast) that exits as told,
and a trainer with a real `CheckpointManager` on a local folder, whose emergency save must
commit before the launcher reports 75. One case runs the real ``examples/train.py``.

Nothing waits a fixed time: a test waits for a file a worker writes once it is in its loop, and
for the launcher's exit, each with a generous bound (the machine may be small and loaded; every
process imports torch).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from spotckpt import PREEMPTED_EXIT_CODE
from spotckpt.launch import (
    EXIT_MARGIN_S,
    FORWARDED_SIGNALS,
    LaunchUsageError,
    default_shutdown_timeout,
    main,
    parse_launch_args,
)

from tests_support import REPO, SCRIPT

pytestmark = pytest.mark.process  # its tests start processes or servers

TRAINER = REPO / "examples" / "train.py"
START_S = 180  # launcher and workers started, workers in their loop
EXIT_S = 120  # launcher gone after the signal (the save itself takes well under a second)

# Exits as told, per rank: argv = OUT CODES ON_STOP. CODES is one entry per rank: an exit status,
# "kill" (SIGKILL itself) or "wait" (until a stop signal, then exit ON_STOP). A rank that ends on
# its own first waits until every rank is ready, so that torchrun's SIGTERM to the others finds
# their handler installed.
SIMPLE_WORKER = """
import os, signal, sys, time
from pathlib import Path

out, codes, on_stop = Path(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
rank = os.environ["RANK"]


def stop(signum, frame):
    (out / f"signal-{rank}").write_text(signal.Signals(signum).name)
    sys.exit(on_stop)


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGUSR1, stop)
(out / f"ready-{rank}").write_text(str(os.getpid()))
mine = codes[int(rank)]
if mine != "wait":
    while not all((out / f"ready-{r}").exists() for r in range(len(codes))):
        time.sleep(0.01)
if mine == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mine != "wait":
    sys.exit(int(mine))
while True:
    signal.pause()
"""

# A trainer with a real CheckpointManager: argv = OUT STEPS (0: until preempted). It writes
# ready-RANK (its pid) after its first step, preempted-RANK or done-RANK (the step) at the end.
MANAGER_WORKER = """
import os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from spotckpt import PREEMPTED_EXIT_CODE, CheckpointManager, TrainState

out, steps = Path(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
state = TrainState(model=model, optimizer=optimizer)
manager = CheckpointManager(str(out / "ckpt"), keep_last=None)
step = 0
while steps == 0 or step < steps:
    step += 1
    model(torch.randn(16, 8)).square().mean().backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
    optimizer.step()
    optimizer.zero_grad()
    manager.maybe_save(step, state)
    if step == 1:
        (out / f"ready-{rank}").write_text(str(os.getpid()))
    if manager.should_stop():
        manager.close()
        (out / f"preempted-{rank}").write_text(str(step))
        dist.destroy_process_group()
        sys.exit(PREEMPTED_EXIT_CODE)
    time.sleep(0.01)  # pace the loop: two ranks share a small machine with the launcher
manager.save(step, state)
manager.close()
(out / f"done-{rank}").write_text(str(step))
dist.destroy_process_group()
sys.exit(0)
"""


def _env(**extra: str) -> dict[str, str]:
    """This environment without spotckpt's or torchrun's settings, plus `extra`."""
    prefixes = ("SPOTCKPT_", "PET_", "TORCH_ELASTIC_", "TORCHELASTIC_", "LAUNCH_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(extra)
    return env


def _launcher() -> list[str]:
    if SCRIPT.exists():
        return [str(SCRIPT), "launch"]
    return [sys.executable, "-m", "spotckpt.launch"]


@dataclass
class Launch:
    """One launcher process, its output in files, and the folder its workers write to."""

    proc: subprocess.Popen[bytes]
    out: Path

    def wait_for(self, predicate: Callable[[], bool], timeout: float = START_S) -> None:
        """Poll `predicate` until true; fail at once if the launcher exits first."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                pytest.fail(f"launcher exited {self.proc.returncode} early:\n{self.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout} s:\n{self.output()}")
            time.sleep(0.05)

    def ready(self, ranks: int = 2) -> list[int]:
        """The workers' pids, once each wrote its ready file."""
        files = [self.out / f"ready-{rank}" for rank in range(ranks)]
        self.wait_for(lambda: all(f.exists() and f.read_text() for f in files))
        return [int(f.read_text()) for f in files]

    def finish(self, timeout: float = EXIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running after {timeout} s:\n{self.output()}")

    def stderr(self) -> str:
        return (self.out / "launcher.err").read_text(errors="replace")

    def output(self) -> str:
        text = (self.out / "launcher.out").read_text(errors="replace") + self.stderr()
        return text[-6000:]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Launch]]:
    """Start ``spotckpt launch ARGS`` in a new session; kill what is left at the end."""
    started: list[Launch] = []

    def start(*args: str, env: dict[str, str] | None = None, module: bool = False) -> Launch:
        command = [sys.executable, "-m", "spotckpt.launch"] if module else _launcher()
        with (
            (tmp_path / "launcher.out").open("wb") as out,
            (tmp_path / "launcher.err").open("wb") as err,
        ):
            proc = subprocess.Popen(
                [*command, *args],
                cwd=tmp_path,
                env=env if env is not None else _env(),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        started.append(Launch(proc, tmp_path))
        return started[-1]

    yield start
    for run in started:
        if run.proc.poll() is None:
            pids = [run.proc.pid]
            pids += [int(p.read_text()) for p in run.out.glob("ready-*") if p.read_text()]
            for group in pids:  # the launcher's group, then each worker's own session
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
            run.proc.wait(timeout=60)


def _simple(tmp_path: Path, codes: str, on_stop: int = PREEMPTED_EXIT_CODE) -> list[str]:
    script = tmp_path / "simple_worker.py"
    script.write_text(SIMPLE_WORKER)
    return ["--standalone", "--nproc-per-node=2", str(script), str(tmp_path), codes, str(on_stop)]


def _manager(tmp_path: Path, steps: int = 0) -> list[str]:
    script = tmp_path / "manager_worker.py"
    script.write_text(MANAGER_WORKER)
    return ["--standalone", "--nproc-per-node=2", str(script), str(tmp_path), str(steps)]


def _committed(root: Path) -> list[int]:
    """Steps whose manifest (the commit marker) exists."""
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/manifest.json"))


def _assert_one_line_about_the_stop(stderr: str, name: str = "SIGTERM") -> None:
    assert "Traceback" not in stderr, stderr[-6000:]
    assert "SignalException" not in stderr, stderr[-6000:]
    ours = [line for line in stderr.splitlines() if line.startswith("spotckpt launch:")]
    assert len(ours) == 1, stderr[-6000:]
    assert f"stopped by {name}" in ours[0] and f"exiting {PREEMPTED_EXIT_CODE}" in ours[0]


# ---- the defaults it gives torchrun --------------------------------------------------------------


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith(("SPOTCKPT_", "PET_", "TORCH_ELASTIC_")):
            monkeypatch.delenv(name)
    return monkeypatch


def test_defaults_forward_sigusr1_and_wait_for_the_save(clean_environ: pytest.MonkeyPatch) -> None:
    args = parse_launch_args(["--standalone", "train.py", "--steps", "3"])
    assert args.signals_to_handle == ",".join(FORWARDED_SIGNALS)
    assert {"SIGTERM", "SIGUSR1"} <= set(args.signals_to_handle.split(","))
    assert args.shutdown_timeout == 25 + EXIT_MARGIN_S
    assert (args.training_script, args.training_script_args) == ("train.py", ["--steps", "3"])
    clean_environ.setenv("SPOTCKPT_SAVE_BUDGET_S", "12.5")
    assert parse_launch_args(["train.py"]).shutdown_timeout == 13 + EXIT_MARGIN_S
    assert default_shutdown_timeout({"SPOTCKPT_SAVE_BUDGET_S": "60"}) == 65


def test_options_and_torchrun_variables_win_over_the_defaults(
    clean_environ: pytest.MonkeyPatch,
) -> None:
    clean_environ.setenv("SPOTCKPT_SAVE_BUDGET_S", "soon")  # not read: a timeout is given
    args = parse_launch_args(["--shutdown-timeout=7", "--signals-to-handle", "SIGTERM", "t.py"])
    assert (args.shutdown_timeout, args.signals_to_handle) == (7, "SIGTERM")
    clean_environ.setenv("PET_SHUTDOWN_TIMEOUT", "11")
    clean_environ.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT")
    args = parse_launch_args(["t.py"])
    assert (args.shutdown_timeout, args.signals_to_handle) == (11, "SIGTERM,SIGINT")
    clean_environ.delenv("PET_SHUTDOWN_TIMEOUT")
    clean_environ.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")  # torchrun resolves it itself
    assert parse_launch_args(["t.py"]).shutdown_timeout is None


@pytest.mark.parametrize("budget", ["soon", "-5", "0", "inf", "nan"])
def test_a_bad_save_budget_is_a_usage_error(
    clean_environ: pytest.MonkeyPatch, budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(LaunchUsageError, match="SPOTCKPT_SAVE_BUDGET_S"):
        default_shutdown_timeout({"SPOTCKPT_SAVE_BUDGET_S": budget})
    clean_environ.setenv("SPOTCKPT_SAVE_BUDGET_S", budget)
    assert main(["--standalone", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spotckpt launch: error: SPOTCKPT_SAVE_BUDGET_S") and err.count("\n") == 1


# ---- exit statuses -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codes", "expected"),
    [("0,0", 0), ("wait,75", PREEMPTED_EXIT_CODE), ("wait,3", 3), ("wait,kill", 1)],
    ids=["clean", "worker-exits-75", "worker-exits-3", "worker-killed"],
)
def test_exit_status_follows_the_first_failed_worker(
    launch: Callable[..., Launch], tmp_path: Path, codes: str, expected: int
) -> None:
    """Rank 1 ends on its own; rank 0 waits until torchrun stops it, and then exits 75 as a
    spotckpt trainer would. That 75 is torchrun's doing, not the job's: only rank 1 counts."""
    run = launch(*_simple(tmp_path, codes))
    assert run.finish() == expected, run.output()
    stderr = run.stderr()
    assert "Traceback" not in stderr, run.output()
    if codes.startswith("wait"):
        assert (tmp_path / "signal-0").read_text() == "SIGTERM", run.output()
    if expected == 3:
        assert "spotckpt launch: rank 1 exited 3 (first failure); exiting 3" in stderr
    if expected == 1:
        assert "spotckpt launch: rank 1 was killed by SIGKILL" in stderr


def test_a_wrong_option_is_torchruns_usage_error(
    launch: Callable[..., Launch], tmp_path: Path
) -> None:
    run = launch("--max-restarts=many", *_simple(tmp_path, "0,0"))
    assert run.finish() == 2
    stderr = run.stderr()
    assert stderr.startswith("usage: spotckpt launch ")
    assert "argument --max-restarts/--max_restarts: invalid int value: 'many'" in stderr
    assert not list(tmp_path.glob("ready-*")), "no worker may start"


def test_a_failing_agent_is_one_line_and_exit_1(
    launch: Callable[..., Launch], tmp_path: Path
) -> None:
    """torchrun's parser takes any --nproc-per-node; its agent refuses it when it starts."""
    run = launch("--standalone", "--nproc-per-node=lots", *_simple(tmp_path, "0,0")[2:])
    assert run.finish() == 1, run.output()
    stderr = run.stderr()
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        "spotckpt launch: error: ValueError: Unsupported nproc_per_node value: lots; exiting 1"
    )


# ---- a stop signal -------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_stop_signal_reaches_the_workers_and_exits_75(
    launch: Callable[..., Launch], tmp_path: Path, signum: signal.Signals
) -> None:
    """SIGUSR1 (SLURM's warning) is forwarded too: torchrun alone would die of it."""
    run = launch(*_simple(tmp_path, "wait,wait", on_stop=0), module=True)
    run.ready()
    run.proc.send_signal(signum)
    assert run.finish() == PREEMPTED_EXIT_CODE, run.output()
    for rank in (0, 1):
        assert (tmp_path / f"signal-{rank}").read_text() == signum.name
    _assert_one_line_about_the_stop(run.stderr(), signum.name)


def test_sigterm_to_the_launcher_commits_the_emergency_save(
    launch: Callable[..., Launch], tmp_path: Path
) -> None:
    run = launch(*_manager(tmp_path))
    run.ready()
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == PREEMPTED_EXIT_CODE, run.output()
    _assert_saved_on_every_rank(tmp_path, run)
    _assert_one_line_about_the_stop(run.stderr())


def test_sigterm_to_every_process_at_once_commits_and_exits_75(
    launch: Callable[..., Launch], tmp_path: Path
) -> None:
    """A VM shutdown (or systemd stopping the unit) signals every process at once: the workers
    get SIGTERM straight away and then again from the launcher. torchrun puts each worker in a
    session of its own, so `kill -- -PGID` of the launcher's group alone would reach only the
    launcher: every group, the launcher's and each worker's, is signalled in the same instant."""
    run = launch(*_manager(tmp_path))
    groups = {run.proc.pid, *(os.getpgid(pid) for pid in run.ready())}
    for group in sorted(groups, key=lambda g: g != run.proc.pid):  # the launcher's first
        os.killpg(group, signal.SIGTERM)
    assert run.finish() == PREEMPTED_EXIT_CODE, run.output()
    _assert_saved_on_every_rank(tmp_path, run)
    _assert_one_line_about_the_stop(run.stderr())


def _assert_saved_on_every_rank(folder: Path, run: Launch) -> None:
    files = [folder / f"preempted-{rank}" for rank in (0, 1)]
    assert all(f.exists() for f in files), run.output()
    steps = {int(f.read_text()) for f in files}
    assert len(steps) == 1, f"the ranks saved different steps: {steps}"
    assert steps.pop() in _committed(folder / "ckpt"), run.output()


def test_a_clean_run_exits_0_with_its_checkpoint(
    launch: Callable[..., Launch], tmp_path: Path
) -> None:
    """Mirrors docs/launch.md's command: `spotckpt launch` of a manager's job, exit 0."""
    run = launch(*_manager(tmp_path, steps=5))
    assert run.finish(timeout=START_S) == 0, run.output()
    assert _committed(tmp_path / "ckpt") == [5]
    assert [(tmp_path / f"done-{rank}").read_text() for rank in (0, 1)] == ["5", "5"]
    assert "Traceback" not in run.stderr()


def test_the_example_trainer_saves_and_exits_75_on_sigterm(
    launch: Callable[..., Launch], tmp_path: Path
) -> None:
    checkpoints = tmp_path / "ckpt-ddp"
    env = _env(SPOTCKPT_URI=checkpoints.as_uri())
    run = launch(
        "--standalone",
        "--nproc-per-node=2",
        str(TRAINER),
        *("--steps", "100000", "--save-every", "5", "--step-delay", "0.02", "--workers", "1"),
        env=env,
    )
    run.wait_for(lambda: bool(_committed(checkpoints)))
    before = _committed(checkpoints)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == PREEMPTED_EXIT_CODE, run.output()
    after = _committed(checkpoints)
    stderr = run.stderr()
    saved = re.findall(r"rank (\d): preempted; checkpoint of step (\d+) committed", stderr)
    assert sorted(rank for rank, _ in saved) == ["0", "1"], run.output()
    (step,) = {int(step) for _, step in saved}
    assert step in after and step >= before[-1], f"{before} -> {after}, saved {step}"
    _assert_one_line_about_the_stop(stderr)
