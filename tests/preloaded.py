"""Rank processes forked from a server that has already imported torch and spotckpt.

Why: every gloo rank the tests start as ``python worker.py ...`` spends about 3 CPU-s (more on
a loaded 2-core machine) importing torch, DCP and spotckpt before its first line of test code,
and the rank and node tests start a few hundred of them. Here one server per pytest process
(``python preloaded.py``, started on first use) imports the rank scripts' modules once, and each
rank is a fork of it: a real process with its own pid, session, signals and exit status.
multiprocessing's ``forkserver`` does the same but also re-runs the parent's ``__main__`` in
every child (pytest's, here), so this is a small server of its own: JSON lines over a socket
pair, one thread, SIGCHLD through a wake-up pipe.

What a rank sees is what ``subprocess.Popen([sys.executable, script, *argv], env=env)`` would
give it: `sys.argv`, `os.environ`, the working directory, `sys.path` (the script's folder, then
``PYTHONPATH``), stdout and stderr into one log, ``__name__ == "__main__"``, and at the end
non-daemon threads joined, atexit handlers run and an exit status (``-N`` after signal N).
Optionally it gets a session of its own and a private mount namespace in which one folder is
bound over another (what ``unshare --mount`` and ``mount --bind`` do for the node tests).
User-facing launches (``spotckpt launch``, torchrun, the examples) still start fresh
interpreters: only the tests' own rank scripts come through here.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import weakref
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PRELOAD = ["dist_worker", "tier_worker", "integrity_worker"]
"""The rank scripts' modules: importing them imports torch, DCP, DTensor and spotckpt."""

_CLONE_NEWNS = 0x00020000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
DUMP_SIGNAL = signal.SIGUSR2
"""A rank writes every thread's stack into its log on this signal (the suite's timeout asks)."""


class PreloadedProcess:
    """One rank: the part of `subprocess.Popen`'s interface that the tests use."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        *,
        new_session: bool = False,
        bind: tuple[Path, Path] | None = None,
    ) -> None:
        self.args = args
        fd, self.log = tempfile.mkstemp(prefix="rank-", suffix=".log")
        os.close(fd)
        self._server = _server()
        request = {
            "args": args,
            "env": env,
            "cwd": os.getcwd(),
            "log": self.log,
            "new_session": new_session,
            "bind": None if bind is None else [str(bind[0]), str(bind[1])],
        }
        self.pid = self._server.start(request)
        _LIVE.add(self)

    @property
    def returncode(self) -> int | None:
        return self._server.status(self.pid)

    def poll(self) -> int | None:
        return self._server.status(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        status = self._server.wait(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return status

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait for the exit; the rank's stdout and stderr together (the log is removed)."""
        self.wait(timeout)
        output = Path(self.log).read_text(errors="replace")
        Path(self.log).unlink(missing_ok=True)
        return output, None

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_LIVE: weakref.WeakSet[PreloadedProcess] = weakref.WeakSet()


def live_ranks() -> list[PreloadedProcess]:
    """The rank processes of this process's server that have not exited."""
    return [p for p in list(_LIVE) if p.poll() is None]


def server_pid() -> int | None:
    """The pid of this process's server; None before its first rank."""
    if _CLIENT is None or _CLIENT[0] != os.getpid():
        return None
    return _CLIENT[1].process.pid


class _Client:
    """The pytest side of one server: requests out, pids and exit statuses back (a reader
    thread files them; a server that dies fails every wait instead of hanging it)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.socket = ours
        self.lines = ours.makefile("r", encoding="utf-8")
        self.lock = threading.Lock()  # one request on the wire at a time
        self.changed = threading.Condition()
        self.statuses: dict[int, int] = {}
        self.broken = ""
        ready = json.loads(self.lines.readline() or '{"error": "the server exited"}')
        if "error" in ready:
            raise RuntimeError(f"the preloaded rank server did not start:\n{ready['error']}")
        self.replies: list[dict[str, Any]] = []
        threading.Thread(target=self._read, name="preloaded-statuses", daemon=True).start()

    def start(self, request: dict[str, Any]) -> int:
        with self.lock, self.changed:
            self.replies.clear()
            self.socket.sendall(json.dumps(request).encode() + b"\n")
            while not self.replies and not self.broken:
                self.changed.wait()
            if self.broken:
                raise RuntimeError(self.broken)
            reply = self.replies.pop()
        if "error" in reply:
            raise RuntimeError(f"the preloaded rank server could not fork:\n{reply['error']}")
        return int(reply["pid"])

    def status(self, pid: int) -> int | None:
        with self.changed:
            return self.statuses.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.statuses or self.broken, timeout)
            if pid not in self.statuses and self.broken:
                raise RuntimeError(self.broken)
            return self.statuses.get(pid)

    def _read(self) -> None:
        for line in self.lines:
            message = json.loads(line)
            with self.changed:
                if "status" in message:
                    self.statuses[int(message["pid"])] = int(message["status"])
                else:
                    self.replies.append(message)
                self.changed.notify_all()
        with self.changed:
            self.broken = f"the preloaded rank server exited ({self.process.wait()})"
            self.changed.notify_all()


_CLIENT: tuple[int, _Client] | None = None


def _server() -> _Client:
    """This process's server, started on first use (a forked child starts its own)."""
    global _CLIENT
    if _CLIENT is None or _CLIENT[0] != os.getpid():
        _CLIENT = (os.getpid(), _Client())
    return _CLIENT[1]


# The server -----------------------------------------------------------------------------------


def _serve(fd: int) -> None:
    """Import the rank modules, then fork one rank per request until the client hangs up."""
    channel = socket.socket(fileno=fd)
    try:
        for module in PRELOAD:
            __import__(module)
    except BaseException:
        channel.sendall(json.dumps({"error": traceback.format_exc()}).encode() + b"\n")
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    channel.sendall(b'{"ready": true}\n')
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
                _reap(channel)
                continue
            data = channel.recv(1 << 20)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = _fork(
                        request, close=[channel.fileno(), wake_r, wake_w, selector.fileno()]
                    )
                    reply: dict[str, Any] = {"pid": pid}
                except Exception:
                    reply = {"error": traceback.format_exc()}
                channel.sendall(json.dumps(reply).encode() + b"\n")
        _reap(channel)


def _reap(channel: socket.socket) -> None:
    """Report every rank that has exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        message = {"pid": pid, "status": os.waitstatus_to_exitcode(status)}
        channel.sendall(json.dumps(message).encode() + b"\n")


def _fork(request: dict[str, Any], close: list[int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        status = _run_script(request)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)


def _run_script(request: dict[str, Any]) -> int:
    """In the forked rank: set the process up as a fresh interpreter would be, run the script
    as ``__main__``, then leave as the interpreter does; the exit status."""
    if request["new_session"]:
        os.setsid()
    if request["bind"] is not None:
        _bind_privately(*request["bind"])
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    out = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    for fd in (1, 2):
        os.dup2(out, fd)
    os.close(out)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    script = str(Path(request["args"][0]).resolve())
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [str(Path(script).parent), *extra, *(p for p in sys.path if p not in extra)]
    sys.argv[:] = [script, *request["args"][1:]]
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own order:
    atexit._run_exitfuncs()  # non-daemon threads, then atexit handlers
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def _exit_status(code: object) -> int:
    """What the interpreter makes of ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _bind_privately(source: str, target: str) -> None:
    """A mount namespace of this process's own in which `source` is seen at `target`."""
    libc = ctypes.CDLL(None, use_errno=True)
    steps = (
        ("unshare", lambda: libc.unshare(_CLONE_NEWNS)),
        ("make / private", lambda: libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None)),
        ("bind", lambda: libc.mount(source.encode(), target.encode(), None, _MS_BIND, None)),
    )
    for what, call in steps:
        if call() != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what} ({source} on {target}): {os.strerror(errno)}")


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
