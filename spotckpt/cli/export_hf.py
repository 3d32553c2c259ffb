"""``spotckpt export-hf``: a step's model weights as Hugging Face safetensors in a folder or a
bucket (`spotckpt.export`, which imports torch: only when the command runs)."""

from __future__ import annotations

import click

from spotckpt.cli.common import (
    Parsed,
    check_root,
    closing_store,
    emit_json,
    json_option,
    parse_size,
    plural,
    progress_bar,
    resolve_location,
    resolve_step,
    signed_catalog,
    step_option,
    storage_option,
)
from spotckpt.format.dtypes import BY_NAME
from spotckpt.redact import printable
from spotckpt.storage import uri_scheme
from spotckpt.units import human_size

_FLOAT_DTYPES = sorted(n for n, d in BY_NAME.items() if d.is_floating_point)


@click.command("export-hf")
@click.argument("locations", nargs=-1, metavar="[URI] OUT")
@step_option
@click.option(
    "--max-shard-size",
    type=Parsed("SIZE", parse_size),
    default="5GB",
    show_default=True,
    help="Largest output file (5GB, 500MB, 2GiB, bytes).",
)
@click.option(
    "--dtype",
    type=click.Choice(_FLOAT_DTYPES),
    default=None,
    help="Cast floating-point tensors to this dtype.",
)
@click.option("--prefix", default="model.", show_default=True, help="Export tensors under this.")
@click.option("--keep-prefix", is_flag=True, help="Keep the prefix in the output names.")
@click.option(
    "--include",
    "include",
    multiple=True,
    metavar="PATH",
    help="Copy this local file into OUT, or a folder's top-level files but weights and hidden "
    "ones (repeatable): config.json, tokenizer files.",
)
@click.option(
    "--keep-tied",
    is_flag=True,
    help="Write tied weights under every name (by default once, as save_pretrained does).",
)
@click.option("--overwrite", is_flag=True, help="Replace an export or included files in OUT.")
@storage_option
@json_option
def export_command(
    locations: tuple[str, ...],
    step: int | None,
    max_shard_size: int,
    dtype: str | None,
    prefix: str,
    keep_prefix: bool,
    include: tuple[str, ...],
    keep_tied: bool,
    overwrite: bool,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
) -> None:
    """Write a checkpoint's model weights as Hugging Face safetensors into OUT.

    OUT is a folder or a bucket URI. Storage options apply to OUT too when it is of the same
    kind (scheme) as URI. A weight tied to the input embeddings (lm_head.weight) is written once,
    as save_pretrained does; --include adds config and tokenizer files so that OUT loads with
    from_pretrained as it is.
    """
    if not 1 <= len(locations) <= 2:
        raise click.UsageError("export-hf takes [URI] OUT: one or two locations")
    uri, out = (None, locations[0]) if len(locations) == 1 else locations
    try:
        resolved, options = resolve_location(uri, storage_options)
    except click.UsageError:  # one location, and no URI configured: OUT is what is missing
        raise click.UsageError(
            f"missing argument OUT: export-hf writes into a folder or bucket URI given after "
            f"the checkpoint URI (spotckpt export-hf {locations[0]} OUT); a single location is "
            "OUT when SPOTCKPT_URI or spotckpt.toml names the checkpoint, and neither does"
        ) from None
    from spotckpt.export import export_hf  # imports torch: only this command needs it

    cast = BY_NAME[dtype].torch_dtype if dtype is not None else None
    out_options = options if uri_scheme(out) == uri_scheme(resolved) else {}
    with closing_store(resolved, options) as store:
        check_root(store)
        chosen = resolve_step(store, step)
        with (
            closing_store(out, out_options) as out_store,
            progress_bar(f"export step {chosen}") as progress,
        ):
            report = export_hf(
                store,
                chosen,
                out_store,
                keyring=signed_catalog(store, uri).keyring,
                max_shard_size=max_shard_size,
                dtype=cast,
                prefix=prefix,
                strip_prefix=not keep_prefix,
                overwrite=overwrite,
                include=include,
                dedupe_tied=not keep_tied,
                progress=progress,
            )
    if as_json:
        emit_json(report.to_dict())
        return
    index = [report.index] if report.index is not None else []
    for name in [*report.files, *report.included, *index]:  # in the order they were written
        click.echo(printable(f"wrote {report.out_uri}/{name}"))
    for dropped, kept in report.tied.items():
        click.echo(printable(f"{dropped} is tied to {kept}: written once"))
    click.echo(
        f"step {chosen}: {report.tensors} tensors, {report.total_parameters:,} parameters, "
        f"{human_size(report.total_size)} in {plural(len(report.files), 'file')}"
    )
