"""``spotckpt import-dcp`` and ``spotckpt export-dcp``: a run's checkpoint between standard DCP
folders and spotckpt steps (`spotckpt.dcp_convert`, which imports torch: only when a command
runs)."""

from __future__ import annotations

import click

from spotckpt.cli.common import (
    check_root,
    closing_store,
    emit_json,
    json_option,
    register_secrets,
    resolve_location,
    signed_catalog,
    step_option,
    storage_option,
    storage_pair,
)
from spotckpt.redact import printable
from spotckpt.units import human_size


@click.command("import-dcp")
@click.argument("source", metavar="SRC")
@click.argument("target", metavar="DST", required=False)
@click.option(
    "--step",
    type=click.IntRange(min=0),
    default=None,
    help="The step to commit (and, in a root of step-<N>/ folders, the one to import); "
    "default: the N of SRC's step-<N> folder, the newest.",
)
@click.option(
    "--source-option",
    "source_options",
    multiple=True,
    type=storage_pair,
    metavar="KEY=VALUE",
    help="SRC's storage option (repeatable); the config's storage_options are DST's.",
)
@click.option("--overwrite", is_flag=True, help="Replace the step if DST has it committed.")
@storage_option
@json_option
def import_dcp_command(
    source: str,
    target: str | None,
    step: int | None,
    source_options: tuple[tuple[str, str], ...],
    overwrite: bool,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
) -> None:
    """Commit the standard DCP checkpoint at SRC as a step of the spotckpt root DST.

    SRC is a DCP checkpoint folder (.metadata and .distcp objects, as FileSystemWriter,
    FsspecWriter or s3torchconnector write them) or a root of step-<N>/ such folders. DST
    defaults to SPOTCKPT_URI or spotckpt.toml's uri; its storage options and signing key are
    the config's (with --storage-option over them). The step is committed create-only, with
    CRC32Cs, signed when a signing key is configured. Tensors are read one at a time.
    """
    from spotckpt.dcp_convert import import_dcp  # imports torch: only this command needs it

    target_uri, target_settings = resolve_location(target, storage_options)
    source_settings = dict(source_options)
    register_secrets(source_settings)
    with (
        closing_store(source, source_settings) as source_store,
        closing_store(target_uri, target_settings) as target_store,
    ):
        check_root(source_store)
        report = import_dcp(
            source_store,
            target_store,
            step=step,
            keyring=signed_catalog(target_store, target_uri).keyring,
            overwrite=overwrite,
        )
    if as_json:
        emit_json(report.to_dict())
        return
    click.echo(
        printable(
            f"imported {report.source} as step {report.step} of {report.destination}: "
            f"{report.tensors} tensors ({human_size(report.tensor_bytes)}), "
            f"{report.values} values in {report.seconds:.1f} s"
        )
    )


@click.command("export-dcp")
@click.argument("locations", nargs=-1, metavar="[URI] OUT")
@step_option
@click.option("--overwrite", is_flag=True, help="Replace a DCP checkpoint already in OUT.")
@storage_option
@json_option
def export_dcp_command(
    locations: tuple[str, ...],
    step: int | None,
    overwrite: bool,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
) -> None:
    """Write a committed step as a standard DCP checkpoint into the local folder OUT.

    OUT then loads with torch.distributed.checkpoint.load and FileSystemReader, or becomes a
    torch.save file with dcp_to_torch_save. The step is read verified, under the configured
    signing keys. Tensors are read one at a time.
    """
    if not 1 <= len(locations) <= 2:
        raise click.UsageError("export-dcp takes [URI] OUT: one or two locations")
    uri, out = (None, locations[0]) if len(locations) == 1 else locations
    from spotckpt.dcp_convert import export_dcp  # imports torch: only this command needs it

    resolved, options = resolve_location(uri, storage_options)
    with closing_store(resolved, options) as store:
        check_root(store)
        report = export_dcp(
            store, step, out, keyring=signed_catalog(store, uri).keyring, overwrite=overwrite
        )
    if as_json:
        emit_json(report.to_dict())
        return
    click.echo(
        printable(
            f"exported step {report.step} of {report.source} to {report.destination}: "
            f"{report.tensors} tensors ({human_size(report.tensor_bytes)}), "
            f"{report.values} values in {report.seconds:.1f} s"
        )
    )
