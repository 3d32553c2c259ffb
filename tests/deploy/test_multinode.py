"""The multi-node JobSet, run here: two simulated nodes on this machine.

Each node is deploy/entrypoint.sh (the image's entry point, so `spotckpt launch`, torchrun's agent)
with the trainer environment that the JobSet's pod template gives a pod on that node (ConfigMap,
downward-API node name and zone, the rendezvous and fast-tier settings), built from the manifest
itself. Only what a single machine cannot provide differs, each replaced in one place: the
rendezvous host (pod 0's name in the headless service) becomes 127.0.0.1, the checkpoint URI a
local folder, and the hostPath of the fast tier a folder per node. One node's agent then gets
SIGTERM, as the kubelet sends it on an eviction; every rank saves the same step to the fast tier
(with a copy on the other node) and exits 75. The evicted node's disk is lost; the JobSet
restarts the whole job (restart attempt 1), which must restore without reading the bucket and
continue bit for bit as an uninterrupted run of the same job does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import spotckpt

from deploy_helpers import (
    ENTRYPOINT,
    K8S_VARIANTS,
    REPO,
    clean_env,
    effective_env,
    kustomize_build,
    option,
    trainer_container,
)
from tests_support import free_port

pytestmark = pytest.mark.process  # its tests start processes or servers

VARIANT = "eks-multinode"
TRAINER = REPO / "examples" / "train.py"
NODES = ["node0", "node1"]
ZONES = ["zone-a", "zone-b"]
STEPS = 24
ZONE_LABEL = "metadata.labels['topology.kubernetes.io/zone']"
ATTEMPT_LABEL = "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"
RESTORE_LINE = re.compile(r"restore read: local (\d+) B, peer (\d+) B, store (\d+) B")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Job:
    """One run of the JobSet's job (one restart attempt) on this machine's simulated nodes."""

    def __init__(self, root: Path, attempt: int) -> None:
        self.root = root
        self.attempt = attempt
        self.docs = kustomize_build(K8S_VARIANTS[VARIANT])
        self.port = free_port()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        # The hostPath (type DirectoryOrCreate) that the init container hands to the trainer.
        (root / "tier").mkdir(exist_ok=True)

    def node_env(self, rank: int) -> dict[str, str]:
        fields = {
            "spec.nodeName": NODES[rank],
            ZONE_LABEL: ZONES[rank],
            ATTEMPT_LABEL: str(self.attempt),
        }
        env = effective_env(self.docs, fields)
        # What one machine cannot give: pod 0's address, a bucket, each node's own disk.
        manifest_endpoint = f"{env['LAUNCH_RDZV_HOST']}:29400"
        assert env["LAUNCH_TORCHRUN_ARGS"].count(manifest_endpoint) == 1
        env["LAUNCH_TORCHRUN_ARGS"] = env["LAUNCH_TORCHRUN_ARGS"].replace(
            manifest_endpoint, f"127.0.0.1:{self.port}"
        )
        env["SPOTCKPT_URI"] = (self.root / "bucket").as_uri()
        env["SPOTCKPT_LOCAL_DIR"] = env["SPOTCKPT_LOCAL_DIR"].replace(
            "/var/lib/spotckpt/", f"{self.root / 'tier'}/", 1
        )
        assert option(env["LAUNCH_TORCHRUN_ARGS"].split(), "--nnodes") == str(len(NODES))
        return clean_env(
            **env,
            LAUNCH_PYTHON=sys.executable,
            LAUNCH_NPROC_PER_NODE="1",
            PYTHONPATH=str(REPO),
        )

    def command(self, step_delay: float) -> list[str]:
        """The overlay's training command, with the example at its path here and a short run."""
        args = trainer_container(self.docs)["args"]
        assert Path(args[0]).name == TRAINER.name
        local_every = option(args, "--local-every")
        return [
            str(TRAINER),
            *("--steps", str(STEPS), "--save-every", "1000", "--local-every", local_every),
            *("--workers", "0", "--log-every", "0", "--step-delay", str(step_delay)),
            *("--loss-log", str(self.root / "losses.jsonl")),
            *("--digest-file", str(self.root / "digest.json")),
        ]

    def start(self, step_delay: float = 0.0) -> None:
        # Node 0 first: it hosts the rendezvous store, as pod 0 of the JobSet does.
        for rank in range(len(NODES)):
            log = self.root / f"attempt{self.attempt}-{NODES[rank]}.log"
            self.logs.append(log)
            with log.open("wb") as out:
                self.processes.append(
                    subprocess.Popen(
                        ["bash", str(ENTRYPOINT), *self.command(step_delay)],
                        env=self.node_env(rank),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            if rank == 0:
                self.wait_for(lambda: _listening(self.port), "node0's rendezvous store")

    def wait_for(self, predicate: Any, what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for process in self.processes:
                if process.poll() is not None:
                    pytest.fail(
                        f"a node exited {process.returncode} before {what}:\n{self.output()}"
                    )
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} after {timeout} s:\n{self.output()}")
            time.sleep(0.1)

    def finish(self, timeout: float = 300) -> list[int]:
        try:
            return [process.wait(timeout=timeout) for process in self.processes]
        finally:
            self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=60)

    def output(self) -> str:
        return "\n".join(f"== {log.name}\n{log.read_text()[-5000:]}" for log in self.logs)


def _losses(root: Path) -> list[dict[str, Any]]:
    lines = (root / "losses.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_two_nodes_evicted_one_restore_from_the_fast_tier_and_continue_bit_exactly(
    tmp_path: Path,
) -> None:
    # The uninterrupted job: the reference.
    reference = tmp_path / "reference"
    reference.mkdir()
    job = Job(reference, attempt=0)
    job.start()
    assert job.finish() == [0, 0], job.output()

    # The same job, node1 evicted mid-run.
    root = tmp_path / "evicted"
    root.mkdir()
    job = Job(root, attempt=0)
    try:
        job.start(step_delay=0.3)
        # Some training first; the eviction's emergency save is the job's first save.
        job.wait_for(
            lambda: (root / "losses.jsonl").exists() and len(_losses(root)) >= 8,
            "step 8",
        )
        job.processes[1].send_signal(signal.SIGTERM)  # the kubelet's SIGTERM to node1's pod
    except BaseException:
        job.kill()
        raise
    statuses = job.finish()
    assert statuses == [spotckpt.PREEMPTED_EXIT_CODE] * 2, job.output()
    evicted_at = len(_losses(root))
    assert 8 <= evicted_at < STEPS, job.output()
    tiers = root / "tier"
    assert (tiers / "node0").is_dir() and (tiers / "node1").is_dir()
    shutil.rmtree(tiers / "node1")  # the evicted machine's disk is gone

    # The JobSet restarts the whole job: attempt 1, same manifest.
    restarted = Job(root, attempt=1)
    restarted.start()
    assert restarted.finish() == [0, 0], restarted.output()
    (found,) = [m for log in restarted.logs for m in RESTORE_LINE.finditer(log.read_text())]
    local, peer, store = (int(n) for n in found.groups())
    assert store == 0, f"read the bucket:\n{restarted.output()}"
    assert local > 0 and peer > 0, "node0 from its own disk, node1 from node0's copy"
    assert f"starting at step {evicted_at + 1}" in restarted.output()
    print(f"evicted at step {evicted_at}; restore read local {local} B, peer {peer} B, store 0 B")

    # Bit for bit what the uninterrupted job computed: every loss and the final state.
    assert _losses(root) == _losses(reference)
    assert json.loads((root / "digest.json").read_text()) == json.loads(
        (reference / "digest.json").read_text()
    )
