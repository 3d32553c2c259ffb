"""Real evictions: SIGTERM sent to real training processes at random steps, then restarts.

The spot run is driven by the demo's own driver (`examples/demo.py`); the final parameters must
equal an uninterrupted run's bit for bit and no completed step may be lost.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests_support import REPO

pytestmark = pytest.mark.process  # its tests start processes or servers


def _load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spotckpt_demo", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["spotckpt_demo"] = module
    spec.loader.exec_module(module)
    return module


demo = _load_demo()


@pytest.mark.parametrize(
    ("save_every", "async_save", "store", "local_every"),
    [(1, False, "local", 0), (4, True, "s3", 2)],
    ids=["saving-every-step", "async-uploads-and-fast-tier-on-s3"],
)
def test_random_sigterms_lose_nothing(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    save_every: int,
    async_save: bool,
    store: str,
    local_every: int,
) -> None:
    base = str(tmp_path / "ck") if store == "local" else request.getfixturevalue("s3_uri")
    args = argparse.Namespace(
        steps=24,
        save_every=save_every,
        local_every=local_every,
        evictions=2,
        step_delay=0.02,
        seed=7,
        async_save=async_save,
    )
    evictions = demo.spot_run(args, f"{base}/spot", tmp_path)
    reference = demo.run(
        demo.train_command(args, tmp_path, "ref"), f"{base}/ref", tmp_path / "ref.log"
    )
    assert reference.wait(timeout=300) == 0
    assert len(evictions) == 2
    assert [e.steps_lost for e in evictions] == [0, 0]
    assert all(e.save_s > 0 for e in evictions)
    assert (tmp_path / "spot.digest").read_text() == (tmp_path / "ref.digest").read_text()
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "spot.losses").read_text().splitlines()
    ]
    assert sorted(set(steps)) == list(range(1, 25))
    # The first restart stays on its node, the second lands on a fresh one (an empty disk).
    assert [e.new_node for e in evictions] == [False, True]
    assert all(e.store_bytes is not None and e.tier_bytes is not None for e in evictions)
    sources = [(bool(e.tier_bytes), bool(e.store_bytes)) for e in evictions]
    from_tier, from_store = (True, False), (False, True)
    assert sources == ([from_tier, from_store] if local_every else [from_store, from_store])


def test_torchrun_sigterm_both_ranks_save_the_same_step(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    env = {**os.environ, "SPOTCKPT_URI": uri, "PYTHONUNBUFFERED": "1"}
    losses = tmp_path / "losses"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(REPO / "examples" / "train.py"), "--steps", "500", "--save-every", "50",
        "--step-delay", "0.05", "--workers", "1", "--loss-log", str(losses),
    ]  # fmt: skip
    agent = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while demo.last_step(losses) < 5:
            assert agent.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        signalled = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=60)
        elapsed = time.monotonic() - signalled
    finally:
        if agent.poll() is None:
            agent.kill()
    text = output.decode(errors="replace")
    stops = re.findall(r"rank (\d): preempted; checkpoint of step (\d+) committed", text)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], text[-3000:]
    assert len({step for _, step in stops}) == 1, stops
    # the library's own lines come from rank 0 only
    assert len(re.findall(r"spotckpt emergency save of step \d+ committed", text)) == 1, text
    assert elapsed < 30, f"workers took {elapsed:.1f} s, past torchrun's 30 s kill"
    step = int(stops[0][1])
    manifest = json.loads((tmp_path / "ck" / f"step-{step:09d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert sorted(o["rank"] for o in manifest["objects"]) == [0, 1]


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(c) for c in (task / "children").read_text().split())
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("store", ["local", "s3"])
def test_sigterm_before_the_first_periodic_save_exits_promptly(
    request: pytest.FixtureRequest, tmp_path: Path, store: str
) -> None:
    """The emergency save is the run's first save; the trainer and its loader workers all exit."""
    base = str(tmp_path / "ck") if store == "local" else request.getfixturevalue("s3_uri")
    losses, log = tmp_path / "losses", tmp_path / "train.log"
    command = [
        sys.executable, str(REPO / "examples" / "train.py"), "--steps", "500",
        "--save-every", "400", "--step-delay", "0.05", "--workers", "2", "--loss-log", str(losses),
    ]  # fmt: skip
    trainer = demo.run(command, f"{base}/run", log)
    try:
        deadline = time.monotonic() + 120
        while demo.last_step(losses) < 3:
            assert trainer.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        workers = _children(trainer.pid)
        assert len(workers) >= 2, workers
        trainer.send_signal(signal.SIGTERM)
        status = trainer.wait(timeout=120)
        exited = time.time()
    finally:
        if trainer.poll() is None:
            trainer.kill()
    text = log.read_text()
    assert status == 75, text[-3000:]
    committed = re.search(r"^(\S+ \S+) spotckpt emergency save of step \d+ committed", text, re.M)
    assert committed is not None, text[-3000:]
    moment = time.mktime(time.strptime(committed.group(1).split(",")[0], "%Y-%m-%d %H:%M:%S"))
    # A second or two is usual; the bound only separates "exits" from the old hang at exit.
    assert exited - moment < 20, f"exited {exited - moment:.1f} s after the commit"
    assert "Traceback" not in text, text[-3000:]
    assert not [pid for pid in workers if _alive(pid)], "loader workers outlived the trainer"


def test_failed_demo_keeps_its_logs_and_leaves_no_process(tmp_path: Path) -> None:
    """A trainer that cannot start: the demo says so with its last lines and kills every child."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint root should be")
    env = {**os.environ, "SPOTCKPT_URI": str(blocker), "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--steps", "20", "--evictions", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "demo FAILED" in done.stderr and "last lines of" in done.stderr
    kept = re.search(r"logs kept in (\S+)", done.stderr)
    assert kept is not None and Path(kept.group(1)).is_dir(), done.stderr
    assert (Path(kept.group(1)) / "spot.log").read_text()  # the trainer's own words are there
    leftovers = subprocess.run(
        ["pgrep", "-f", kept.group(1)], capture_output=True, text=True
    ).stdout.split()
    assert leftovers == [], f"processes left behind: {leftovers}"


def test_demo_shows_where_each_restore_came_from(tmp_path: Path) -> None:
    """`make demo`'s table: a restart on the same node reads the fast tier, one on a fresh node
    the store; nothing is lost and the parameters match the uninterrupted run."""
    env = {**os.environ, "SPOTCKPT_URI": str(tmp_path / "ck"), "TMPDIR": str(tmp_path)}
    command = [
        sys.executable, str(REPO / "examples" / "demo.py"), "--steps", "30", "--evictions", "2",
        "--save-every", "25", "--local-every", "5", "--seed", "11",
    ]  # fmt: skip
    done = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[-3:] == ["restarted on", "restore", "restored from"], table[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert [row[-3] for row in rows] == ["same node", "new node"], table
    size = r"\d+(\.\d)? (B|KiB|MiB)"
    assert re.fullmatch(rf"tier {size} / store 0 B", rows[0][-1]), table
    assert re.fullmatch(rf"tier 0 B / store {size}", rows[1][-1]), table
    assert not rows[0][-1].startswith("tier 0 B") and not rows[1][-1].endswith("store 0 B")
    assert "restores from the fast tier: 1, from the store: 1" in done.stdout
    assert "steps lost in total: 0" in done.stdout
    assert "final parameters identical to the uninterrupted run: yes" in done.stdout
