"""The ``spotckpt`` command line: ls, inspect, verify, gc, mirror, export-hf, import-dcp,
export-dcp, stats, launch.

The checkpoint URI argument may be left out when ``SPOTCKPT_URI`` or ``uri`` in ``spotckpt.toml``
(see `spotckpt.config.Config`) gives it. Storage options come from the config's
``storage_options``, overridden one by one with ``--storage-option key=value``.

Exit status: 0 success; 1 a checkpoint failed verification (``verify`` found problems, or another
command met corrupt data or an invalid manifest); 2 anything else that stops a command (bad
usage or URI, a checkpoint root that does not exist, missing step, unreadable config, storage
errors, a mirror that belongs to another job), with a one-line message on stderr. With
``--json`` every outcome is one JSON document on stdout, errors included
(``{"error": "...", "exit_code": 2}``), with the same exit status.
Progress bars appear on stderr only when it is a terminal; log records are one line each.
Credentials are never printed, and control characters in names read from a bucket are escaped.
Only ``verify``, ``export-hf``, ``import-dcp``, ``export-dcp`` and ``launch`` import torch.

``mirror`` exits 1 when a step could not be mirrored (it prints which and why, as ``verify``
prints its problems, and mirrors the other steps); with ``--follow`` it exits 0 on SIGINT or
SIGTERM.

``launch`` is the exception to the statuses above: it runs a training job under torch's elastic
launcher and exits with the job's status (0 done, 75 preempted, else the first failed worker's
status; 2 on bad usage); see `spotckpt.launch`.

Checkpoints are read through `spotckpt.catalog.Catalog` and the `spotckpt.layout` names, as a
user's tool would; of the format modules only the dtype table is imported (for export-hf's
``--dtype`` choices, which need no torch). The package: `common` (the group, shared
options, opening the root, text helpers), one module per command group (`ls`, `inspect_step`,
`verify_gc`, `mirror`, `export_hf`, `dcp_convert`, `jobs` for stats and launch), and here the
entry point that turns every outcome into an exit status.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import NoReturn

import click

from spotckpt.cli.common import cli, one_line, parse_duration, parse_size
from spotckpt.cli.dcp_convert import export_dcp_command, import_dcp_command
from spotckpt.cli.export_hf import export_command
from spotckpt.cli.inspect_step import inspect_command
from spotckpt.cli.jobs import launch_command, stats_command
from spotckpt.cli.ls import ls_command
from spotckpt.cli.mirror import mirror_command
from spotckpt.cli.verify_gc import gc_command, verify_command
from spotckpt.errors import (
    CommandFailedError,
    ConfigError,
    CorruptCheckpointError,
    ManifestError,
    MirrorConflictError,
    MissingDependencyError,
    NoCheckpointError,
    StorageError,
)

EXIT_OK, EXIT_FAILED_VERIFICATION, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

for _command in (
    ls_command,
    inspect_command,
    verify_command,
    gc_command,
    mirror_command,
    export_command,
    import_dcp_command,
    export_dcp_command,
    stats_command,
    launch_command,
):
    cli.add_command(_command)

_USAGE_ERRORS = (
    ConfigError,
    MissingDependencyError,  # names the extra to install
    MirrorConflictError,  # another job's root, or another commit of a step, at the mirror
    NoCheckpointError,
    StorageError,
    ValueError,
    OSError,
    LookupError,
)


def _run(args: list[str]) -> tuple[int, str | None, bool]:
    """Run the command line: its exit status, the failure's message (None on success), and
    whether the command printed its own result before failing."""
    try:
        code = cli.main(args=args, prog_name="spotckpt", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as error:
        click.echo(error.ctx.get_help() if error.ctx is not None else str(error), err=True)
        return EXIT_USAGE, None, True
    except click.UsageError as error:
        return EXIT_USAGE, error.format_message(), False
    except (click.Abort, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted", False
    except CommandFailedError as error:
        return EXIT_FAILED_VERIFICATION, str(error), True
    except (CorruptCheckpointError, ManifestError) as error:
        return EXIT_FAILED_VERIFICATION, str(error), False
    except _USAGE_ERRORS as error:
        return EXIT_USAGE, str(error) or type(error).__name__, False
    except Exception as error:  # one line, never a traceback: this is the CLI's outermost frame
        return EXIT_USAGE, f"{type(error).__name__}: {error}", False
    return (code if isinstance(code, int) else EXIT_OK), None, False


def _wants_json(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among the options (before any ``--``), even when parsing failed."""
    options = args[: args.index("--")] if "--" in args else args
    return "--json" in options


def _fail(code: int, message: str, *, as_json: bool) -> NoReturn:
    """The one-line error on stderr (and, for --json, as a document on stdout); exit `code`."""
    text = one_line(message)
    if as_json:
        click.echo(json.dumps({"error": text, "exit_code": code}))
    click.echo(f"spotckpt: error: {text}", err=True)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point; exits with 0, 1 or 2 (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    code, message, printed = _run(args)
    if message is not None:
        _fail(code, message, as_json=_wants_json(args) and not printed)
    sys.exit(code)


__all__ = ["cli", "main", "parse_duration", "parse_size"]
