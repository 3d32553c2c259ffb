"""A shielded loader worker ignores preemption signals until released, then ends with status 0.

A signal to the process group (torchrun, SLURM, ``kill -- -PGID``) reaches the loader's workers
while the trainer saves. Python runs a signal's handler only when the worker is next scheduled, so
on a loaded machine the group's SIGTERM, sent while the shield was up, can be handled after the
trainer released it (its emergency save took 20 ms). A worker that then died of the signal made
the trainer's exit print "DataLoader worker (pid N) is killed by signal: Terminated" (a CI run).

Each case forks a real worker with the shield installed. The worker holds the signal pending
(``pthread_sigmask``, as a worker not yet scheduled) until the parent has signalled it and, in
some cases, released the shield; then it lets the handler run. Exit status 3 means the worker
ignored the signal; 0 means the handler ended it the way a released worker must; -N that it died
of signal N.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.synchronize import Event

import pytest

from spotckpt.state import ShieldedWorkerInit

CHILD_TIMEOUT_S = 120.0  # a guard against a hung child only
IGNORED = 3  # the worker's status when it outlived the signal


def _worker(shield: ShieldedWorkerInit, signum: int, ready: Event, go: Event) -> None:
    shield(0)  # as the DataLoader calls its worker_init_fn
    signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
    ready.set()
    go.wait(CHILD_TIMEOUT_S)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    for _ in range(10_000):  # backward jumps: Python runs the pending handler here
        pass
    os._exit(IGNORED)


def _run(signum: int, *, release_before_handled: bool) -> int | None:
    context = multiprocessing.get_context("fork")
    shield = ShieldedWorkerInit(None, (signal.SIGTERM, signal.SIGUSR1))
    ready, go = context.Event(), context.Event()
    worker = context.Process(target=_worker, args=(shield, signum, ready, go))
    worker.start()
    try:
        assert ready.wait(CHILD_TIMEOUT_S), "the worker never installed its shield"
        os.kill(worker.pid or 0, signum)  # sent while shielded; pending in the worker
        if release_before_handled:
            shield.released.value = 1
        go.set()
        worker.join(CHILD_TIMEOUT_S)
        return worker.exitcode
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()


@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_handled_while_shielded_is_ignored(signum: int) -> None:
    assert _run(signum, release_before_handled=False) == IGNORED


@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_sent_while_shielded_but_handled_after_the_release_ends_it_with_status_0(
    signum: int,
) -> None:
    assert _run(signum, release_before_handled=True) == 0


@pytest.mark.process
def test_a_released_worker_ends_on_terminate_with_status_0() -> None:
    """The DataLoader's and multiprocessing's shutdown terminate workers: never a hang."""
    context = multiprocessing.get_context("fork")
    shield = ShieldedWorkerInit(None, (signal.SIGTERM,))
    ready = context.Event()

    def wait_forever() -> None:
        shield(0)
        ready.set()
        while True:
            signal.pause()

    worker = context.Process(target=wait_forever)
    worker.start()
    try:
        assert ready.wait(CHILD_TIMEOUT_S)
        shield.released.value = 1
        worker.terminate()
        worker.join(CHILD_TIMEOUT_S)
        assert worker.exitcode == 0
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
