"""``spotckpt stats`` (goodput, request counts and their estimated price from a run's events)
and ``spotckpt launch`` (a training job under torch's elastic launcher, `spotckpt.launch`)."""

from __future__ import annotations

import click

from spotckpt.cli.common import (
    emit_json,
    json_option,
    opened_root,
    probe_root,
    storage_option,
    uri_argument,
)
from spotckpt.cost import DEFAULT_PRICES, load_prices
from spotckpt.redact import printable
from spotckpt.stats import load_stats


@click.command("stats")
@uri_argument
@storage_option
@json_option
@click.option(
    "--prices",
    "prices_path",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON object of prices replacing the defaults (S3 Standard, us-east-1): "
    "write_per_1000, read_per_1000, delete_per_1000, storage_per_gb_month, egress_per_gb, "
    "currency, and egress_per_gb_between (mirror egress per provider pair, "
    '{"s3->gs": 0.09}).',
)
def stats_command(
    uri: str | None,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
    prices_path: str | None,
) -> None:
    """Goodput from the run's events: evictions, steps lost, save costs, the interval; the
    requests the saves and restores made, with their estimated price; and the bytes copied to
    mirrors, their estimated egress price and each mirror's lag.

    Save stall is the time the training loop was blocked; the suggested interval is Daly's
    optimum for the measured save cost, step time and eviction rate. Prices are list prices
    (no free tier, no discounts): an estimate.
    """
    prices = load_prices(prices_path) if prices_path else DEFAULT_PRICES
    with opened_root(uri, storage_options) as store:
        stats = load_stats(store, prices)
        if not stats.events:
            probe_root(store)  # a missing bucket is an error, not "no events"
    if as_json:
        emit_json(stats.to_dict())
        return
    click.echo("\n".join(printable(line) for line in stats.text().splitlines()))


@click.command(
    "launch",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,  # --help goes to torchrun's parser, which lists every option
)
@click.argument("torchrun_args", nargs=-1, type=click.UNPROCESSED)
def launch_command(torchrun_args: tuple[str, ...]) -> int:
    """Run a training script under torchrun; exit 75 when the job was preempted.

    spotckpt launch [TORCHRUN OPTIONS] SCRIPT.py [SCRIPT ARGS], e.g. spotckpt launch
    --standalone --nproc-per-node=2 train.py --steps 200. Exit status: 0 done; 75 preempted
    (the first failed worker exited 75, or the launcher got a stop signal, forwarded it to the
    workers and waited for their emergency save); else that worker's status; 2 bad usage.
    `spotckpt launch --help` lists torchrun's options.
    """
    from spotckpt.launch import main as launch  # imports torch: only this command needs it

    return launch(list(torchrun_args))
