"""``spotckpt verify`` (every object of a step against its manifest; exit 1 on problems) and
``spotckpt gc`` (unreferenced attempts, uncommitted steps, stale uploads, retention); both read
under the configuration's signing keys."""

from __future__ import annotations

from collections.abc import Sequence

import click

from spotckpt.cli.common import (
    Parsed,
    emit_json,
    json_option,
    opened_root,
    parse_duration,
    plural,
    progress_bar,
    resolve_step,
    signed_catalog,
    step_option,
    storage_option,
    uri_argument,
)
from spotckpt.errors import CommandFailedError
from spotckpt.gc import collect_garbage
from spotckpt.redact import printable
from spotckpt.units import human_size


@click.command("verify")
@uri_argument
@step_option
@storage_option
@json_option
@click.option(
    "--digest",
    "with_digest",
    is_flag=True,
    help="Also print the step's digest: equal for every intact copy of the step.",
)
def verify_command(
    uri: str | None,
    step: int | None,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
    with_digest: bool,
) -> None:
    """Check every object of a checkpoint: presence, size, CRC32C (and BLAKE3 and signature
    when signed). Exit 1 on problems."""
    from spotckpt.verify import verify_checkpoint  # imports torch to load the stored values

    with opened_root(uri, storage_options) as store:
        chosen = resolve_step(store, step)
        with progress_bar(f"verify step {chosen}") as progress:
            report = verify_checkpoint(
                store,
                chosen,
                progress=progress,
                keyring=signed_catalog(store, uri).keyring,
                digest=with_digest,
            )
    if as_json:
        emit_json(report.to_dict())
    elif report.ok:
        signature = "" if report.signature is None else f"; {report.signature.describe()}"
        click.echo(
            f"step {chosen}: OK ({plural(report.objects_checked, 'object')}, "
            f"{human_size(report.bytes_checked)} checked{signature})"
        )
        if report.digest is not None:
            click.echo(f"digest {report.digest}")
    else:
        click.echo(f"step {chosen}: {plural(len(report.problems), 'problem')}")
        for problem in report.problems:
            click.echo(printable(f"  {problem.kind}: {problem.message}"))
            if problem.tensors and problem.kind in ("missing", "size"):
                click.echo(printable(f"    holds: {_some(problem.tensors)}"))
    if not report.ok:
        problems = plural(len(report.problems), "problem")
        raise CommandFailedError(f"step {chosen} failed verification: {problems}")


def _some(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@click.command("gc")
@uri_argument
@click.option("--dry-run", is_flag=True, help="Report what would be deleted; delete nothing.")
@click.option(
    "--keep-last",
    type=click.IntRange(min=1),
    default=None,
    help="Also delete committed checkpoints but the newest N (default: keep all).",
)
@click.option(
    "--safety-age",
    type=Parsed("DURATION", parse_duration),
    default="1h",
    show_default=True,
    help="Leave anything younger than this alone (90s, 30m, 1h, 2d).",
)
@click.option(
    "--delete-unreadable",
    is_flag=True,
    help=(
        "Also delete committed steps whose manifest cannot be read (damaged, unsigned under "
        "the key, or from a newer spotckpt); otherwise they and older steps' objects stay."
    ),
)
@storage_option
@json_option
def gc_command(
    uri: str | None,
    dry_run: bool,
    keep_last: int | None,
    safety_age: float,
    delete_unreadable: bool,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
) -> None:
    """Delete unreferenced attempts, uncommitted steps and stale uploads; apply retention."""
    with opened_root(uri, storage_options) as store, progress_bar("gc", unit="step") as progress:
        report = collect_garbage(
            store,
            keep_last=keep_last,
            safety_age_s=safety_age,
            dry_run=dry_run,
            progress=progress,
            keyring=signed_catalog(store, uri).keyring,
            delete_unreadable=delete_unreadable,
        )
    if as_json:
        emit_json(report.to_dict())
        return
    for action in report.actions:
        verb = _gc_verb(action.kind, dry_run)
        details = (
            f"{plural(action.objects, 'object')}, {human_size(action.bytes)}"
            if action.kind != "upload"
            else _human_age(action.age_s)
        )
        if action.kind in ("attempt", "uncommitted"):
            details += f", {_human_age(action.age_s)}"
        click.echo(printable(f"{verb} {action.kind} {action.target} ({details})"))
    for kept in report.kept:
        click.echo(printable(f"kept {kept}"))
    total = f"{plural(report.objects_deleted, 'object')}, {human_size(report.bytes_freed)}"
    click.echo(
        f"{'would free' if dry_run else 'freed'} {total}" + (" (dry run)" if dry_run else "")
    )


def _gc_verb(kind: str, dry_run: bool) -> str:
    if kind == "upload":
        return "would abort" if dry_run else "aborted"
    return "would delete" if dry_run else "deleted"


def _human_age(seconds: float | None) -> str:
    if seconds is None:
        return "age unknown"
    if seconds < 120:
        return f"{seconds:.0f} s old"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min old"
    return f"{seconds / 3600:.1f} h old"
