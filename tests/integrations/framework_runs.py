"""Framework workers as real child processes: run one to its end, or SIGTERM it at a step.

The Hugging Face and Accelerate tests run their workers (``tests/hf_worker.py``,
``tests/accelerate_worker.py``) through these: each announces ``REACHED <step>`` on stdout and
writes ``digest.json`` (a sha256 per parameter and optimizer tensor) when it trains to the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from spotckpt import CheckpointManager

from tests_support import TESTS

CHILD_TIMEOUT_S = 600


def child_env() -> dict[str, str]:
    """The environment without spotckpt settings (the URI is an argument) and offline for HF."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def run(worker: str, uri: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run a worker to its end; its stderr is kept in OUT.log."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "a") as log:
        return subprocess.run(
            [sys.executable, str(TESTS / worker), uri, str(out), *extra],
            cwd=out,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )


def run_preempted(
    worker: str, uri: str, out: Path, step: int, *extra: str, group: bool = False
) -> int:
    """Run a worker with ``--stop-at step``, SIGTERM it once it says it got there; its status.

    With `group`, the signal goes to its whole process group (data-loader workers included), as
    torchrun, SLURM and Kubernetes deliver it.
    """
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(TESTS / worker), uri, str(out), "--stop-at", str(step), *extra]
    with open(out.with_suffix(".log"), "a") as log:
        child = subprocess.Popen(
            command,
            cwd=out,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=group,
        )
    watchdog = threading.Timer(CHILD_TIMEOUT_S, child.kill)
    watchdog.start()
    reached = False
    try:
        assert child.stdout is not None
        for line in child.stdout:  # ends when the child exits
            if line.strip() == f"REACHED {step}":
                reached = True
                if group:
                    os.killpg(child.pid, signal.SIGTERM)
                else:
                    child.send_signal(signal.SIGTERM)
        status = child.wait()
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert reached, f"the child never reached step {step}: {tail(out)}"
    return status


def tail(out: Path) -> str:
    """The end of a worker's log, for assertion messages."""
    return out.with_suffix(".log").read_text()[-3000:]


def digest(out: Path) -> dict[str, Any]:
    """What a worker that ran to its end wrote."""
    result: dict[str, Any] = json.loads((out / "digest.json").read_text())
    return result


def committed_steps(uri: str) -> list[int]:
    with CheckpointManager(uri, preemption=False) as manager:
        return manager.steps()
