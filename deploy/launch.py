"""torchrun, with exit statuses a scheduler can act on.

``python launch.py [torchrun options] train.py [args]`` runs exactly what ``torchrun`` runs (its own
argument parser and agent), and changes only how it ends:

- torchrun exits 1 when a worker exits non-zero, whatever the worker's status. Here, when the first
  worker to fail exited with the trainer's "preempted" status (75, ``spotckpt.PREEMPTED_EXIT_CODE``,
  after a cloud eviction notice), the launcher exits 75 too; any other failure exits 1.
- torchrun dies with a traceback (status 1) when it receives SIGTERM, after forwarding the signal
  to the workers and waiting up to ``--shutdown-timeout`` for them. Here it exits 75: the stop came
  from outside (a spot reclaim, a node drain, ``docker stop``), the workers were given the time to
  save, and the job must run again to resume.
- A clean finish exits 0.

Kubernetes (``podFailurePolicy``), SkyPilot (``recover_on_exit_codes``) and systemd
(``RestartPreventExitStatus``) key their restart rules on these statuses.
"""

from __future__ import annotations

import sys

try:
    from spotckpt import PREEMPTED_EXIT_CODE
except ImportError:  # the package is installed in the image; this keeps the launcher standalone
    PREEMPTED_EXIT_CODE = 75

FAILED_EXIT_CODE = 1


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        rank, first = e.get_first_failure()
        if first.exitcode == PREEMPTED_EXIT_CODE:
            print(
                f"launch: rank {rank} exited {PREEMPTED_EXIT_CODE} (preempted); "
                "restart the job to resume from its checkpoint",
                file=sys.stderr,
                flush=True,
            )
            return PREEMPTED_EXIT_CODE
        return FAILED_EXIT_CODE
    except SignalException as e:
        # torchrun's agent already forwarded the signal to every worker and waited up to
        # --shutdown-timeout for them to save and exit before it returned here.
        print(
            f"launch: stopped by {e.sigval.name}; workers were asked to save; "
            f"exiting {PREEMPTED_EXIT_CODE} (preempted)",
            file=sys.stderr,
            flush=True,
        )
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
