"""``spotckpt launch``: torch's elastic launcher (torchrun), with exit statuses a scheduler can use.

``spotckpt launch [torchrun options] script.py [script args]`` (or ``python -m spotckpt.launch
...``) parses its arguments with torchrun's own parser (`torch.distributed.run.parse_args`'s
parser) and runs torchrun's own agent (`torch.distributed.run.run`): same options, same
rendezvous, same worker environment. It changes three defaults and how the launcher ends.

Why not plain torchrun: a restart policy keyed on "preempted" (Kubernetes ``podFailurePolicy``
``onExitCodes: [75]``, SkyPilot ``recover_on_exit_codes``, systemd ``RestartPreventExitStatus``)
needs the launcher's own status to say so, and torchrun never does. When a worker fails torchrun
exits 1 whatever the worker's status, and when torchrun itself gets SIGTERM (a spot reclaim, a
node drain, ``docker stop``) it forwards the signal to the workers, waits for them, then dies with
a ``SignalException`` traceback and status 1, although the workers saved and exited 75. Here:

- ``0``: every worker finished.
- ``75`` (`spotckpt.PREEMPTED_EXIT_CODE`): preempted. The first worker to end with a failure
  exited 75 (the trainer committed an emergency checkpoint after an eviction notice), or the
  launcher got a stop signal: it forwarded it to the workers and waited for their emergency
  save. Start the same command again; the trainer resumes from its last committed checkpoint.
- anything else: the first failed worker's own exit status (1 when it had none, i.e. it was
  killed by a signal), so that a crash is told from a preemption and counts against retries.
  The workers torchrun then stops itself do not count (see `exit_status`).

A stop signal may reach the launcher alone (``docker stop`` through tini, the kubelet, ``kill
PID``) or every process at once (a VM shutdown, ``kill -- -PGID`` of a group the workers share,
systemd's control-group kill). Either way the workers get it (torchrun starts each worker in a
session of its own and signals that session's group, so the trainer's data-loader processes see
it too), the launcher waits for them, and it exits 75. torchrun's traceback is replaced by one
line on stderr.

Defaults that differ from torchrun's, each applied only when the option is not on the command
line and not in torchrun's environment variable for it:

- ``--signals-to-handle``: SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 (torchrun leaves out
  SIGUSR1, which SLURM and other batch schedulers send ahead of a stop, so that it would kill the
  launcher instead of reaching the workers). Variable: ``PET_SIGNALS_TO_HANDLE``.
- ``--shutdown-timeout``: how long torchrun waits for the workers after forwarding a signal
  before it SIGKILLs them. torchrun's default is 30 s whatever the save needs; here it is the
  trainer's emergency save budget, ``SPOTCKPT_SAVE_BUDGET_S`` (`spotckpt.config.Settings`'
  ``save_budget_s``, default 25 s) rounded up to whole seconds, plus `EXIT_MARGIN_S` (5 s) for
  the worker to leave after its save commits (close the manager, tear down the process group,
  exit the interpreter). Killing a worker mid-save loses the newest checkpoint; waiting a few
  seconds longer than needed costs nothing, as the launcher returns as soon as the workers
  exit. Variables: ``PET_SHUTDOWN_TIMEOUT``, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``. The launcher
  reads only the environment for the budget, not ``spotckpt.toml``: with a budget set there,
  pass ``--shutdown-timeout`` too. Whoever stops the launcher must wait longer than this
  (``terminationGracePeriodSeconds``, ``docker stop -t``, ``TimeoutStopSec``).
- the usage line says ``spotckpt launch``.

Only this module's `main` imports torch, and only when it runs: ``import spotckpt.cli`` stays
free of torch.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from spotckpt import PREEMPTED_EXIT_CODE
from spotckpt.config import Settings
from spotckpt.errors import LaunchUsageError

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

EXIT_OK = 0
EXIT_FAILED = 1
"""A worker failed without an exit status of its own (killed by a signal), or the launcher did."""
EXIT_USAGE = 2
"""Bad arguments or settings: argparse's status, which torchrun's parser uses too."""

FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
"""The default ``--signals-to-handle``: torchrun's list plus SIGUSR1 (SLURM's warning signal)."""

SAVE_BUDGET_VARIABLE = "SPOTCKPT_SAVE_BUDGET_S"
DEFAULT_SAVE_BUDGET_S: float = Settings.save_budget_s
EXIT_MARGIN_S = 5
"""Seconds a worker gets to exit after its emergency save, on top of the save budget."""

_PROG = "spotckpt launch"
log = logging.getLogger(__name__)


def default_shutdown_timeout(environ: Mapping[str, str] | None = None) -> int:
    """The ``--shutdown-timeout`` used when none is given: the save budget plus the exit margin.

    The budget is ``SPOTCKPT_SAVE_BUDGET_S`` (seconds, default 25), the same variable the
    trainer's `PreemptionWatcher` reads for its deadline, so launcher and trainer agree on how
    long the save may take; it is rounded up because torchrun takes whole seconds.
    Raises `LaunchUsageError` when the variable is not a positive number.
    """
    env = os.environ if environ is None else environ
    text = env.get(SAVE_BUDGET_VARIABLE, "").strip()
    budget = DEFAULT_SAVE_BUDGET_S
    if text:
        try:
            budget = float(text)
        except ValueError:
            budget = math.nan
        if not (math.isfinite(budget) and budget > 0):
            raise LaunchUsageError(
                f"{SAVE_BUDGET_VARIABLE}: must be a positive number of seconds, got {text!r}"
            )
    return math.ceil(budget) + EXIT_MARGIN_S


def parse_launch_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """torchrun's arguments, parsed by torchrun's own parser with this launcher's defaults.

    Using torch's parser (rather than a copy of its options) keeps every torchrun option and its
    ``PET_*`` environment variables working as torch documents them; only defaults change, so
    an option the user passes always wins.
    argparse exits 2 with torchrun's usage message on a bad option, 0 after ``--help``.
    """
    from torch.distributed.run import get_args_parser

    env = os.environ  # torchrun's parser reads its PET_* variables from here too
    parser = get_args_parser()
    parser.prog = _PROG
    parser.description = (
        "torchrun that exits 75 when the job was preempted (the first failed worker exited 75, or "
        "the launcher got a stop signal and forwarded it to the workers), 0 on success, else the "
        "first failed worker's status. Defaults: --signals-to-handle "
        f"{','.join(FORWARDED_SIGNALS)}; --shutdown-timeout {SAVE_BUDGET_VARIABLE} "
        f"(default {DEFAULT_SAVE_BUDGET_S:g}) + {EXIT_MARGIN_S} s."
    )
    if "PET_SIGNALS_TO_HANDLE" not in env:
        parser.set_defaults(signals_to_handle=",".join(FORWARDED_SIGNALS))
    args = parser.parse_args(None if argv is None else list(argv))
    # torchrun's own default is None, meaning TORCH_ELASTIC_SHUTDOWN_TIMEOUT or else 30 s; the
    # budget is read (and checked) only when it is the value in use.
    if args.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env:
        args.shutdown_timeout = default_shutdown_timeout(env)
    return args


class _StopSignals:
    """The launcher's handlers for the stop signals, around torchrun's own.

    torchrun installs its handler (raise ``SignalException``, which makes the agent forward the
    signal and wait for the workers) only when it starts the workers. Before that, during the
    seconds torch takes to import and during rendezvous, a stop signal would kill the launcher
    with no status of its own; after the agent returns, a late signal would raise in the middle
    of reporting. So this class records a signal while torch loads (`record`), raises torch's
    ``SignalException`` from the start of `torch.distributed.run.run` (`arm`), records again
    once it returned (`record`), and puts the previous handlers back at the end (`restore`).
    Off the main thread Python allows no handlers: then it does nothing.
    """

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._raise: Callable[[str, signal.Signals], BaseException] | None = None
        self._active = threading.current_thread() is threading.main_thread()

    def record(self, names: Iterable[str] = FORWARDED_SIGNALS) -> None:
        """From now on a stop signal is only noted in `received`."""
        self._raise = None
        self._install(names)

    def arm(
        self, names: Iterable[str], exception: Callable[[str, signal.Signals], BaseException]
    ) -> None:
        """From now on a stop signal raises `exception(message, signal)`, as torchrun's handler
        does; only `names` are handled, the others get their previous handlers back."""
        self._raise = exception
        wanted = set(_signals(names))
        for signum in [s for s in self._previous if s not in wanted]:
            signal.signal(signum, self._previous.pop(signum))
        self._install(names)

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        if self._active:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
        self._previous.clear()

    def _install(self, names: Iterable[str]) -> None:
        if not self._active:
            return
        for signum in _signals(names):
            previous = signal.signal(signum, self._on_signal)
            self._previous.setdefault(signum, previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        sigval = signal.Signals(signum)
        if self.received is None:
            self.received = sigval
        if self._raise is not None:
            raise self._raise(f"Process {os.getpid()} got signal: {sigval}", sigval)


def _signals(names: Iterable[str]) -> list[signal.Signals]:
    """The signals named in a torchrun ``--signals-to-handle`` list that this platform has."""
    found = []
    for name in names:
        value = getattr(signal, name.strip(), None)
        if isinstance(value, signal.Signals):
            found.append(value)
    return found


def exit_status(failure: ProcessFailure) -> int:
    """The launcher's status for the first worker that failed: its own exit status (75 when the
    trainer stopped for a preemption), or 1 when it has none (it was killed by a signal).

    Only the first failure counts. Once a worker fails torchrun stops the others (SIGTERM, then
    SIGKILL after the shutdown timeout) and lists them as failures too: a spotckpt trainer that
    gets that SIGTERM saves and exits 75, which is torchrun's doing, not a preemption. torchrun
    orders failures by time (`ChildFailedError.get_first_failure`), the ones it saw before
    stopping the rest first.
    """
    code = failure.exitcode
    return code if 0 < code < 256 else EXIT_FAILED


def _say(message: str) -> None:
    print(f"{_PROG}: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with `argv` (default: ``sys.argv[1:]``); return the exit status (see the
    module docstring): 0 done, 75 preempted, else the first failed worker's status, 2 bad usage.
    """
    stops = _StopSignals()
    stops.record()  # torch takes seconds to import: a stop signal now must not kill us silently
    try:
        try:
            args = parse_launch_args(argv)
        except LaunchUsageError as error:
            _say(f"error: {error}")
            return EXIT_USAGE
        except SystemExit as stop:  # argparse: usage error (2) or --help (0), already printed
            return stop.code if isinstance(stop.code, int) else EXIT_USAGE
        return _run(args, stops)
    finally:
        stops.restore()


def _run(args: argparse.Namespace, stops: _StopSignals) -> int:
    """torchrun's `run` under torchrun's `record` (error files as torchrun writes them), with the
    outcome turned into an exit status and one line on stderr instead of a traceback."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import run

    handled = args.signals_to_handle.split(",")
    try:
        stops.arm(handled, SignalException)
        if stops.received is not None:  # it came while torch loaded: start nothing
            _say(
                f"stopped by {stops.received.name} before the workers started; exiting "
                f"{PREEMPTED_EXIT_CODE} (preempted): start the job again"
            )
            return PREEMPTED_EXIT_CODE
        try:
            record(run)(args)
        finally:
            stops.record(handled)
    except SignalException as stop:
        # torchrun's agent forwarded the signal to every worker's process group and waited up
        # to --shutdown-timeout for them to save and exit before this was raised again.
        _say(
            f"stopped by {stop.sigval.name}: forwarded it to the workers and waited for their "
            f"emergency save; exiting {PREEMPTED_EXIT_CODE} (preempted): start the job again to "
            "resume from its last checkpoint"
        )
        return PREEMPTED_EXIT_CODE
    except ChildFailedError as failed:
        return _report_failure(failed)
    except Exception as error:  # the agent itself failed: rendezvous, a bad --nproc-per-node, ...
        log.debug("the launcher failed", exc_info=True)  # `spotckpt -v launch` shows where
        _say(
            f"error: {type(error).__name__}: {' '.join(str(error).split())}; exiting {EXIT_FAILED}"
        )
        return EXIT_FAILED
    return EXIT_OK


def _report_failure(failed: ChildFailedError) -> int:
    rank, first = failed.get_first_failure()
    code = exit_status(first)
    if code == PREEMPTED_EXIT_CODE:
        _say(
            f"rank {rank} exited {PREEMPTED_EXIT_CODE} (preempted); exiting "
            f"{PREEMPTED_EXIT_CODE}: start the job again to resume from its last checkpoint"
        )
        return code
    print(failed.format_msg(), file=sys.stderr, flush=True)
    if first.exitcode < 0:
        how = f"was killed by {first.signal_name()}"
    else:
        how = f"exited {first.exitcode}"
    _say(f"rank {rank} {how} (first failure); exiting {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
