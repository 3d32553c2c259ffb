"""`make demo`: a spot market in one command.

Starts an embedded S3 server (moto, on loopback) unless ``SPOTCKPT_URI`` names a bucket, trains
`examples/train.py` as a child process, evicts it with SIGTERM at random steps several times the
way a spot market would, restarts it after each eviction, runs the same training uninterrupted for
reference, and prints what happened: steps lost per eviction, emergency-save and restore times,
where each restore read its bytes from, and whether the final parameters are identical; then
one goodput line read from the spot run's events, as ``spotckpt stats`` reads them; last, where
each run wrote and the ``spotckpt ls``/``stats`` commands that show it (with the embedded
server: that its checkpoints are gone with it).

The trainer keeps a fast tier (``--local-dir``) on its node's disk, a folder per node id under
the demo's temporary folder. Every second replacement is a fresh node with an empty disk, which
restores from the store; the others restart on the node they left and restore from its tier.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from spotckpt.stats import load_stats
from spotckpt.storage import open_store
from spotckpt.units import human_size

ROOT = Path(__file__).resolve().parent
PREEMPTED = 75
EMERGENCY = re.compile(r"emergency save of step (\d+) committed in ([\d.]+) s")
RESTORED = re.compile(r"restored step (\d+) in ([\d.]+) s")
SOURCES = re.compile(r"restore read: local (\d+) B, peer (\d+) B, store (\d+) B")
START_TIMEOUT_S = 180.0  # from start to the eviction step, on a loaded 2-core machine
EXIT_TIMEOUT_S = 60.0  # from SIGTERM to exit; a healthy trainer takes a second or two
RUN_TIMEOUT_S = 600.0  # a whole uninterrupted run


@dataclass
class Eviction:
    """What one eviction cost."""

    at_step: int
    committed: int
    save_s: float
    new_node: bool = False
    restore_s: float | None = None
    tier_bytes: int | None = None
    store_bytes: int | None = None

    @property
    def steps_lost(self) -> int:
        return self.at_step - self.committed

    def restored(self, log_text: str) -> None:
        """Record the restore the restarted trainer logged (its time and its byte sources)."""
        if times := RESTORED.findall(log_text):
            self.restore_s = float(times[-1][1])
        if sources := SOURCES.findall(log_text):
            local, peer, store = (int(n) for n in sources[-1])
            self.tier_bytes, self.store_bytes = local + peer, store

    @property
    def source(self) -> str:
        """``tier 1.2 MiB / store 0 B``: where the restore after this eviction read from."""
        if self.tier_bytes is None or self.store_bytes is None:
            return "-"
        return f"tier {human_size(self.tier_bytes)} / store {human_size(self.store_bytes)}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def embedded_s3() -> Iterator[str]:
    """A moto S3 server on loopback with a fresh bucket; yields the checkpoint URI."""
    import boto3

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the embedded S3 server did not start") from None
                time.sleep(0.1)
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        bucket = f"demo-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        print(f"embedded S3 server at {endpoint}, bucket {bucket}")
        yield f"s3://{bucket}/runs/tiny"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def offline_environment() -> None:
    """Placeholder credentials for the embedded loopback server, and no metadata lookups.

    Used only when the demo starts its own server: with SPOTCKPT_URI naming a real bucket, the
    usual credential chain (profile, IRSA, instance role) applies untouched.
    """
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "demo")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "demo")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def train_command(args: argparse.Namespace, work: Path, name: str) -> list[str]:
    """The trainer's command line for run `name`; its fast tier (if any) lives under `work`."""
    extra = ["--async-save"] if args.async_save else []
    if args.local_every:
        disks = work / f"{name}-disks"  # one folder per node id below it, as on real nodes
        disks.mkdir(parents=True, exist_ok=True)
        extra += ["--local-dir", str(disks / "{node}"), "--local-every", str(args.local_every)]
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *extra,
        "--steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
        "--step-delay",
        str(args.step_delay),
        "--loss-log",
        str(work / f"{name}.losses"),
        "--digest-file",
        str(work / f"{name}.digest"),
    ]


def last_step(loss_log: Path) -> int:
    if not loss_log.exists():
        return 0
    lines = loss_log.read_text().splitlines()
    return int(lines[-1].split('"step": ')[1].split(",")[0]) if lines else 0


class Trainers:
    """Every trainer this driver started, each in its own process group, so none outlives it."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, command: list[str], uri: str, log: Path, node: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "SPOTCKPT_URI": uri, "SPOTCKPT_NODE": node, "PYTHONUNBUFFERED": "1"}
        with open(log, "ab") as out:
            process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started.append(process)
        return process

    def kill_all(self) -> None:
        """SIGKILL every trainer still running, with its loader workers."""
        for process in self.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)


TRAINERS = Trainers()


def run(command: list[str], uri: str, log: Path, node: str = "node-1") -> subprocess.Popen[bytes]:
    """Start a trainer on `node` writing to `log` (killed with its workers when the driver ends)."""
    return TRAINERS.start(command, uri, log, node)


class TrainerFailed(RuntimeError):
    """A trainer misbehaved; the message ends with the last lines of its log."""

    def __init__(self, what: str, log: Path) -> None:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        tail = "\n".join(f"    {line}" for line in lines[-25:])
        super().__init__(f"{what}; last lines of {log}:\n{tail}")


def wait_for(process: subprocess.Popen[bytes], log: Path, what: str, timeout: float) -> int:
    """The exit status of `process`, or TrainerFailed (with its log) if it outlives `timeout`."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TrainerFailed(f"{what} did not exit within {timeout:.0f} s", log) from None


def evict_at(process: subprocess.Popen[bytes], loss_log: Path, step: int, log: Path) -> int:
    """Wait until training reached `step`, SIGTERM its process group, return the exit status."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while last_step(loss_log) < step:
        if process.poll() is not None:
            raise TrainerFailed(f"training exited early with status {process.returncode}", log)
        if time.monotonic() > deadline:
            raise TrainerFailed(f"training did not reach step {step} in time", log)
        time.sleep(0.01)
    # The whole group, as torchrun and `tini -g` deliver it: loader workers must survive it.
    os.killpg(process.pid, signal.SIGTERM)
    return wait_for(process, log, "the evicted trainer", EXIT_TIMEOUT_S)


def spot_run(args: argparse.Namespace, uri: str, work: Path) -> list[Eviction]:
    rng = random.Random(args.seed)
    log, losses = work / "spot.log", work / "spot.losses"
    evictions: list[Eviction] = []
    command = train_command(args, work, "spot")
    nodes = 1
    for number in range(args.evictions):
        target = last_step(losses) + rng.randint(3, max(4, args.steps // (args.evictions + 2)))
        before = log.read_text() if log.exists() else ""
        status = evict_at(run(command, uri, log, f"node-{nodes}"), losses, target, log)
        text = log.read_text()[len(before) :]
        if status != PREEMPTED:
            raise TrainerFailed(
                f"eviction {number + 1}: exit status {status}, not {PREEMPTED}", log
            )
        saved = EMERGENCY.findall(text)
        if not saved:
            raise TrainerFailed(f"eviction {number + 1}: no emergency save was logged", log)
        if evictions:
            evictions[-1].restored(text)
        new_node = (number + 1) % 2 == 0  # every second replacement is a fresh machine
        if new_node:
            nodes += 1
        evictions.append(
            Eviction(last_step(losses), int(saved[-1][0]), float(saved[-1][1]), new_node)
        )
        print(
            f"eviction {number + 1}: SIGTERM at step {evictions[-1].at_step}, exit status {status}"
        )
    before = log.read_text()
    final = run(command, uri, log, f"node-{nodes}")
    status = wait_for(final, log, "the final run", RUN_TIMEOUT_S)
    if status != 0:
        raise TrainerFailed(f"the final run exited with status {status}", log)
    if evictions:
        evictions[-1].restored(log.read_text()[len(before) :])
    return evictions


def goodput_line(uri: str) -> str:
    """The one-line goodput summary of a checkpoint root, from the code `spotckpt stats` runs."""
    store = open_store(uri)
    try:
        return load_stats(store).one_line()
    finally:
        store.close()


def report(evictions: list[Eviction], identical: bool) -> None:
    print()
    print(
        "| eviction | SIGTERM at step | committed step | steps lost | emergency save "
        "| restarted on | restore | restored from |"
    )
    print("|---:|---:|---:|---:|---:|:---|---:|:---|")
    for i, e in enumerate(evictions, 1):
        restore = "-" if e.restore_s is None else f"{e.restore_s:.2f} s"
        node = "new node" if e.new_node else "same node"
        print(
            f"| {i} | {e.at_step} | {e.committed} | {e.steps_lost} | {e.save_s:.2f} s "
            f"| {node} | {restore} | {e.source} |"
        )
    print()
    print(
        f"evictions: {len(evictions)}, steps lost in total: {sum(e.steps_lost for e in evictions)}"
    )
    from_tier = sum(1 for e in evictions if e.tier_bytes and not e.store_bytes)
    from_store = sum(1 for e in evictions if e.store_bytes and not e.tier_bytes)
    print(f"restores from the fast tier: {from_tier}, from the store: {from_store}")
    print(f"final parameters identical to the uninterrupted run: {'yes' if identical else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--save-every", type=int, default=25, help="durable save interval")
    parser.add_argument(
        "--local-every", type=int, default=5, help="fast-tier save interval (0: no fast tier)"
    )
    parser.add_argument("--evictions", type=int, default=3)
    parser.add_argument("--step-delay", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--async-save", action="store_true", help="upload in the background")
    args = parser.parse_args(argv)
    if not os.environ.get("SPOTCKPT_URI"):
        offline_environment()
    work = Path(tempfile.mkdtemp(prefix="spotckpt-demo-"))
    try:
        code = demo(args, work)
    except Exception as error:  # any failure: report it, keep the logs, kill the trainers
        print(f"\ndemo FAILED: {error}\nlogs kept in {work}", file=sys.stderr)
        return 1
    finally:
        TRAINERS.kill_all()
    if code == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs kept in {work}", file=sys.stderr)
    return code


def demo(args: argparse.Namespace, work: Path) -> int:
    """The spot run and the reference run; 0 when nothing was lost and the results match."""
    embedded = not os.environ.get("SPOTCKPT_URI")
    with _checkpoint_root() as base:
        runs = {"spot run": f"{base}/spot", "reference run": f"{base}/reference"}
        print(f"spot run: {args.steps} steps, {args.evictions} evictions (seed {args.seed})")
        print(f"  checkpoints in {runs['spot run']}")
        evictions = spot_run(args, runs["spot run"], work)
        goodput = goodput_line(runs["spot run"])
        print("reference run: the same training, uninterrupted")
        print(f"  checkpoints in {runs['reference run']}")
        log = work / "ref.log"
        reference = run(train_command(args, work, "ref"), runs["reference run"], log)
        status = wait_for(reference, log, "the reference run", RUN_TIMEOUT_S)
        if status != 0:
            raise TrainerFailed(f"the reference run exited with status {status}", log)
    identical = (work / "spot.digest").read_text() == (work / "ref.digest").read_text()
    report(evictions, identical)
    print(goodput)
    print()
    print(where_to_look(runs, embedded))
    return 0 if identical and not any(e.steps_lost for e in evictions) else 1


def where_to_look(runs: dict[str, str], embedded: bool) -> str:
    """Where each run wrote and the commands that show it; with the embedded server, that it
    is gone (its bucket lived in the server's memory) and how to keep the next demo's."""
    width = max(map(len, runs))
    lines = ["checkpoints:"]
    lines += [f"  {name + ':':<{width + 1}} {uri}" for name, uri in runs.items()]
    if embedded:
        lines.append(
            "the embedded S3 server stopped with the demo: these checkpoints are gone. To keep "
            "them, name a folder or a bucket: SPOTCKPT_URI=/tmp/spotckpt-demo make demo"
        )
        return "\n".join(lines)
    spot = shlex.quote(runs["spot run"])
    command = _spotckpt_command()
    lines += [
        "look at the spot run's checkpoints and its goodput with:",
        f"  {command} ls {spot}",
        f"  {command} stats {spot}",
    ]
    return "\n".join(lines)


def _spotckpt_command() -> str:
    """The ``spotckpt`` command of the environment running the demo, by its full path: the
    commands printed work in a shell that has not activated that environment (`.venv`)."""
    script = Path(sys.executable).with_name("spotckpt")
    if script.is_file():
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m spotckpt.cli"


@contextmanager
def _checkpoint_root() -> Iterator[str]:
    configured = os.environ.get("SPOTCKPT_URI")
    if configured:
        print(f"using SPOTCKPT_URI={configured}")
        yield configured.rstrip("/") + f"/demo-{uuid.uuid4().hex[:8]}"
        return
    with embedded_s3() as uri:
        yield uri


if __name__ == "__main__":
    sys.exit(main())
