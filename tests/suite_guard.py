"""The suite's guards: a hung test fails with every stack instead of holding the run, a process
a test starts never outlives it, and `make check` runs only tests that start no process and open
no network socket.

**Timeouts.** Every test runs under pytest-timeout (``timeout`` in pyproject.toml; a test that
needs more says so with ``@pytest.mark.timeout(N)``), by its ``signal`` method: SIGALRM raises in
the test's own thread, so only that test fails and the rest of its file still runs on the same
xdist worker. (The ``thread`` method ends the whole worker with ``os._exit``, and under
``--dist loadfile`` xdist hands the crashed worker's whole file, the hung test first, to a new
worker, which hangs the same way: tried here, eight crashes before xdist gives up.)
`Timeouts.pytest_timeout_set_timer` replaces the plugin's handler so that the failure itself
carries what is needed to see why: the stack of every thread of the test process, and for each
live rank process the suite forked (`preloaded`), its own threads' stacks (faulthandler, on
SIGUSR2, registered in every rank) and the end of its log; any other child is named with its
command line. Should the handler never get to run (the main thread stuck in C code that does not
return to the interpreter), `BACKSTOP_GRACE_S` later every thread's stack goes to the real stderr,
the test's child processes are killed and the main thread's system call is interrupted
(`Timeouts._unstick`); the worker itself is never ended (see there why).

**Children.** A process started while the test ran (not by a fixture's set-up: module and session
fixtures keep theirs, also when the test's body first asks for one) and still alive after its
teardown is killed, with its whole tree, and the test gets a warning that names it.
multiprocessing's own children are left to the objects that own them (a DataLoader iterator
still alive ends its workers itself, and raises in the main thread if one is killed under it).

**`make check`** (``--no-processes``): a test that starts a process or binds or connects a
socket other than a Unix one fails at once, naming what it did and the ``process`` marker to put
on it. ``make check`` runs ``-m "not process and not slow"`` under it, so the quick set cannot
quietly grow slow; the marker goes on files (``pytestmark``), tests, or comes from the fixtures
in `PROCESS_FIXTURES`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

import preloaded

BACKSTOP_GRACE_S = 60.0
"""How long after its timeout a test whose alarm could not end it has its children killed."""
EXIT_GRACE_S = 3.0
"""How long a process a test left behind gets to end by itself (a loader's workers, exiting)."""
DUMP_WAIT_S = 3.0
"""How long the rank processes get to write their stacks into their logs."""
LOG_TAIL_LINES = 60

PROCESS_FIXTURES = frozenset(
    {
        "moto_endpoint",
        "s3_client",
        "s3_bucket",
        "s3_uri",
        "gcs_endpoint",
        "gcs_uri",
        "fake_gcs_endpoint",
        "azurite_endpoint",
        "azurite_connection_string",
        "az_container",
        "az_uri",
        "small_disk",
    }
)
"""Fixtures that start a server process or talk to one: a test using any is a ``process`` test."""


def _thread_stacks() -> str:
    """Every thread's stack but the caller's, named."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident != me and "execnet" not in frame.f_code.co_filename:  # not xdist's own
            stack = "".join(traceback.format_stack(frame))
            parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n{stack}")
    return "\n".join(parts)


def _descendants() -> dict[int, psutil.Process]:
    try:
        return {p.pid: p for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return {}


def _describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}: {' '.join(process.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {process.pid}: (gone)"


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as log:
            return "".join(log.readlines()[-LOG_TAIL_LINES:])
    except OSError as error:
        return f"(log unreadable: {error})"


def children_report(exclude: set[int]) -> str:
    """The live child processes with their stacks where they can give them (rank processes dump
    theirs on SIGUSR2 into their logs); `exclude`: pids not to report (session servers)."""
    ranks = {p.pid: p for p in preloaded.live_ranks()}
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    _wait_for_logs_to_settle([p.log for p in ranks.values()])
    parts = []
    for pid, process in sorted(_descendants().items()):
        if pid in exclude:
            continue
        rank = ranks.get(pid)
        if rank is None:
            parts.append(f"=== child {_describe(process)}")
        else:
            parts.append(f"=== rank {_describe(process)}; its log ends:\n{_tail(rank.log)}")
    return "\n".join(parts) or "(no child processes)"


def _wait_for_logs_to_settle(logs: list[str]) -> None:
    """Until the logs stop growing (the dumps are in), at most `DUMP_WAIT_S`."""

    def sizes() -> list[int]:
        return [os.path.getsize(log) if os.path.exists(log) else 0 for log in logs]

    deadline = time.monotonic() + DUMP_WAIT_S
    before: list[int] | None = None
    while logs and time.monotonic() < deadline:
        threading.Event().wait(0.3)
        now = sizes()
        if now == before:
            return
        before = now


def _process_helper(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker or fork server: started by a first user, kept for the
    life of the process that started it."""
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing.resource_tracker" in command or "multiprocessing.forkserver" in command


def _parent(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.Error:
        return None


def _kill_tree(process: psutil.Process) -> None:
    try:
        family = [process, *process.children(recursive=True)]
    except psutil.Error:
        family = [process]
    for member in family:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(family, timeout=10)


class Timeouts:
    """pytest-timeout's signal method, with the children's stacks in the failure, and a backstop
    for a test that the alarm cannot interrupt (module doc)."""

    def __init__(self, stderr_fd: int) -> None:
        self.stderr = os.fdopen(stderr_fd, "w", closefd=False)

    @pytest.hookimpl(tryfirst=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
            return None  # the plugin's own way
        timeout = float(settings.timeout)

        def on_alarm(signum: int, frame: Any) -> None:
            __tracebackhide__ = True
            report = (
                f"the test ran past its timeout of {timeout:g} s "
                "(@pytest.mark.timeout(N) gives one that needs more)\n"
                f"other threads of the test process:\n{_thread_stacks() or '(none)'}\n"
                f"child processes:\n{children_report({preloaded.server_pid()})}"
            )
            pytest.fail(report)

        backstop = threading.Timer(
            timeout + BACKSTOP_GRACE_S, self._unstick, (item.nodeid, threading.main_thread())
        )
        backstop.daemon = True

        def cancel() -> None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            backstop.cancel()

        item.cancel_timeout = cancel  # type: ignore[attr-defined]  # read by the plugin's cancel
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        backstop.start()
        return True

    def _unstick(self, nodeid: str, main: threading.Thread) -> None:
        """The alarm has not ended the test: the main thread is blocked where the signal's
        handler cannot run. Dump every thread to the real stderr, kill the processes the test
        started (what it most likely waits on), and interrupt the main thread's system call.
        Never exit the worker: under ``--dist loadfile`` xdist hands a crashed worker's whole
        file, the crashing test included, to the next worker, which hangs the same way."""
        print(f"\n*** {nodeid} is stuck past its timeout; threads:", file=self.stderr, flush=True)
        faulthandler.dump_traceback(file=self.stderr, all_threads=True)
        for process in preloaded.live_ranks():
            process.kill()
        server = preloaded.server_pid()
        for pid, process in _descendants().items():
            if pid != server and _parent(process) == os.getpid():
                _kill_tree(process)
        if main.ident is not None:
            signal.pthread_kill(main.ident, signal.SIGALRM)


class ChildReaper:
    """Kills what a test's body started and left running (module doc)."""

    def __init__(self) -> None:
        self.before_call: set[int] = set()
        self.fixtures_own: set[int] = set()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]) -> Iterator[None]:
        """A server that a session or module fixture starts belongs to the fixture, also when
        a test's body first asks for it (``request.getfixturevalue``): later tests use it."""
        if fixturedef.scope == "function":
            yield
            return
        before = set(_descendants())
        yield
        self.fixtures_own |= set(_descendants()) - before

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        self.before_call = set(_descendants())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        yield
        starters = {os.getpid(), preloaded.server_pid()}  # a server's own children are its business
        # multiprocessing's children (a live DataLoader iterator's workers) belong to objects that
        # end them, and killing one makes its loader raise in whatever the main thread runs next
        owned = {child.pid for child in multiprocessing.active_children()}
        leftover = [
            p
            for pid, p in _descendants().items()
            if pid not in self.before_call | starters | owned | self.fixtures_own
            and not _process_helper(p)
        ]
        leftover = [p for p in leftover if _parent(p) in starters]
        _, leftover = psutil.wait_procs(leftover, timeout=EXIT_GRACE_S)  # some are on their way
        for process in leftover:
            what = _describe(process)
            _kill_tree(process)
            warnings.warn(
                pytest.PytestWarning(f"{item.nodeid} left a process running, killed: {what}"),
                stacklevel=1,
            )
        self.before_call = set()


class NoProcesses:
    """``--no-processes``: a test that starts a process or uses a network socket fails, also
    when a thread of its own did it (and the test caught nothing of it)."""

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []
        self.refused: list[str] = []

    def _refuse(self, what: str) -> None:
        message = (
            f"this test {what}, which `make check` runs without: mark it "
            "@pytest.mark.process (or its file: pytestmark = pytest.mark.process)"
        )
        self.refused.append(message)
        raise pytest.fail.Exception(message)

    def _patch(self, owner: Any, name: str, what: str, allow: Callable[..., bool] | None) -> None:
        original = getattr(owner, name)
        own = name in vars(owner)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if allow is None or not allow(*args, **kwargs):
                self._refuse(what)
            return original(*args, **kwargs)

        setattr(owner, name, guarded)
        self.undo.append(
            (lambda: setattr(owner, name, original)) if own else (lambda: delattr(owner, name))
        )

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        def unix(sock: socket.socket, *args: Any, **kwargs: Any) -> bool:
            return sock.family == getattr(socket, "AF_UNIX", None)

        self.refused = []
        self._patch(subprocess.Popen, "_execute_child", "starts a process", None)
        self._patch(multiprocessing.util, "spawnv_passfds", "starts a process", None)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                self._patch(os, name, "starts a process", None)
        self._patch(socket.socket, "bind", "binds a network socket", unix)
        self._patch(socket.socket, "connect", "connects a network socket", unix)
        self._patch(socket.socket, "connect_ex", "connects a network socket", unix)
        try:
            yield
        finally:
            while self.undo:
                self.undo.pop()()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        outcome = yield
        if self.refused and outcome.exception is None:  # a thread's refusal, swallowed
            outcome.force_exception(pytest.fail.Exception(self.refused[0]))


def mark_process_tests(items: list[pytest.Item]) -> None:
    """A test that uses a server fixture (`PROCESS_FIXTURES`) is a ``process`` test."""
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)


def install(config: pytest.Config) -> None:
    """Register the guards (from conftest's ``pytest_configure``)."""
    stderr_fd = os.dup(2)  # capture is suspended while plugins configure: the real stderr
    config.pluginmanager.register(Timeouts(stderr_fd), "spotckpt-timeouts")
    config.pluginmanager.register(ChildReaper(), "spotckpt-child-reaper")
    if config.getoption("no_processes"):
        config.pluginmanager.register(NoProcesses(), "spotckpt-no-processes")
