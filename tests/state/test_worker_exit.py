"""A process whose loader workers spotckpt shielded exits with every worker stopped normally.

At exit spotckpt shuts down each live multi-worker iterator the DataLoader's own way (a stop
message to each worker, then a join), so that multiprocessing's exit hook does not kill them
under the DataLoader's SIGCHLD handler. A loader and its iterator kept alive only by a reference
cycle (here a job object that refers to itself) used to be freed by the garbage collector first,
which closed its queues' feeder threads before its shutdown sent the stop messages: the workers
never got them, each waited out a 5 s join and was then terminated (a 10-20 s late exit for a
2-worker loader, past a launcher's kill deadline).

Each case runs a child script; after spotckpt's exit hook (registered after the probe's, so it
runs first), the probe records the workers' exit codes, and each worker leaves a file when it
returns from its loop (a worker ended by a signal exits 0 too, but leaves none).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # its tests start processes or servers

CHILD_TIMEOUT_S = 300  # a guard against a hung child only

SCRIPT = textwrap.dedent(
    """
    import atexit, json, sys

    out, hold = sys.argv[1], sys.argv[2]
    workers = []

    def record():
        with open(out, "w") as file:
            json.dump([worker.exitcode for worker in workers], file)

    atexit.register(record)  # before spotckpt's exit hook is registered, so it runs after it

    import torch
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader
    from spotckpt import TrainState

    from multiprocessing.util import Finalize

    def stopped_normally(worker_id):
        with open(f"{out}.{worker_id}", "w") as file:
            file.write("stopped on its message")

    def note_a_normal_stop(worker_id):
        # Runs only when the worker returns from its loop (not when a signal ends it).
        Finalize(None, stopped_normally, args=(worker_id,), exitpriority=0)

    data = TensorDataset(torch.arange(64.0))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=2,
                                generator=torch.Generator().manual_seed(0),
                                worker_init_fn=note_a_normal_stop)
    state = TrainState(dataloader=loader)
    iterator = iter(loader)
    workers += iterator._workers
    for index, batch in enumerate(iterator):
        if index == 3:
            break
    if hold == "cycle":  # as a training job object that refers to itself keeps its loader
        job = {"loader": loader, "state": state}
        job["self"] = job
        del loader, state, iterator, job
    """
)


@pytest.mark.parametrize("hold", ["loader", "cycle"])
def test_workers_stop_on_their_message_at_exit(tmp_path: Path, hold: str) -> None:
    out = tmp_path / "exit-codes.json"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out), hold],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "killed by signal" not in done.stderr
    assert json.loads(out.read_text()) == [0, 0], done.stderr[-3000:]
    for worker_id in (0, 1):  # a terminated worker also exits 0 (ShieldedWorkerInit)
        assert Path(f"{out}.{worker_id}").exists(), done.stderr[-3000:]
