"""``spotckpt mirror SRC DST``: copy the committed steps a second root lacks (another region,
another cloud), each object checked against the source's manifest and each step committed at the
mirror by its own manifest (`spotckpt.mirroring`); once, or with ``--follow`` round after round
until SIGINT or SIGTERM, so that a job can restart from the mirror when the source's region is
gone. Before copying it prints what it will copy (`Mirror.plan`) and the egress that costs, after
it the bytes moved and their price (`spotckpt.cost.egress_per_gb`): mirroring across regions and
clouds is billed per GB."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from types import FrameType
from typing import Any

import click

from spotckpt.catalog import Catalog
from spotckpt.cli.common import (
    Parsed,
    check_root,
    closing_store,
    emit_json,
    json_option,
    one_line,
    parse_duration,
    parse_size,
    plural,
    probe_root,
    progress_bar,
    redacted,
    register_secrets,
    resolve_location,
    signed_catalog,
    storage_pair,
    utc_time,
)
from spotckpt.cost import DEFAULT_PRICES, GB, PriceTable, egress_per_gb, load_prices
from spotckpt.errors import CommandFailedError
from spotckpt.mirroring import (
    DEFAULT_COPIES,
    DEFAULT_PIECE_BYTES,
    BandwidthLimit,
    Mirror,
    MirrorPlan,
    MirrorReport,
    MirrorStoppedError,
    Pause,
    StepCopy,
)
from spotckpt.units import human_size

DEFAULT_EVERY_S = 60.0
"""Seconds between two rounds of ``--follow``."""


@click.command("mirror")
@click.argument("source", metavar="SRC")
@click.argument("target", metavar="DST")
@click.option(
    "--step",
    "steps",
    multiple=True,
    type=click.IntRange(min=0),
    help="Mirror this committed step (repeatable; default: every one the mirror lacks).",
)
@click.option(
    "--keep-last",
    type=click.IntRange(min=1),
    default=None,
    help="Mirror only the source's newest N steps and keep N at the mirror (default: all).",
)
@click.option("--follow", is_flag=True, help="Catch up again every --every until SIGINT/SIGTERM.")
@click.option(
    "--every",
    type=Parsed("DURATION", parse_duration),
    default=None,
    help="With --follow: the time between rounds (90s, 30m, 1h; default 60s).",
)
@click.option(
    "--bandwidth",
    type=Parsed("SIZE", parse_size),
    default=None,
    help="At most this many bytes per second over every copy (50MB, 1GiB; default: no limit).",
)
@click.option(
    "--copies",
    type=click.IntRange(min=1),
    default=DEFAULT_COPIES,
    show_default=True,
    help="Objects copied at once.",
)
@click.option(
    "--source-option",
    "source_options",
    multiple=True,
    type=storage_pair,
    metavar="KEY=VALUE",
    help="SRC's storage option (repeatable), over the config's storage_options.",
)
@click.option(
    "--target-option",
    "target_options",
    multiple=True,
    type=storage_pair,
    metavar="KEY=VALUE",
    help="DST's storage option (repeatable); the config's storage_options are not DST's.",
)
@click.option(
    "--prices",
    "prices_path",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON price table (as spotckpt stats --prices); egress_per_gb_between overrides the "
    'egress per GB of a provider pair, {"s3->gs": 0.09}.',
)
@json_option
def mirror_command(
    source: str,
    target: str,
    steps: tuple[int, ...],
    keep_last: int | None,
    follow: bool,
    every: float | None,
    bandwidth: int | None,
    copies: int,
    source_options: tuple[tuple[str, str], ...],
    target_options: tuple[tuple[str, str], ...],
    prices_path: str | None,
    as_json: bool,
) -> None:
    """Copy SRC's committed steps that DST lacks to DST, checked, each committed by its manifest.

    SRC must exist; DST is created as needed and must be a mirror of SRC's job (exit 2 else).
    Exit 1 when a step could not be mirrored (the others are). With --follow, repeat until
    SIGINT or SIGTERM, then exit 0 (a copy in flight is left uncommitted: the next run reuses it).
    Before copying, the plan (steps, objects, bytes) and its estimated egress price; after, the
    bytes moved and theirs (list prices per provider pair, --prices to override).
    """
    if every is not None and not follow:
        raise click.UsageError("--every needs --follow")
    if follow and steps:
        raise click.UsageError("--step and --follow do not go together: --follow mirrors new steps")
    if every is not None and every <= 0:
        raise click.UsageError("--every must be more than 0 s")
    prices = load_prices(prices_path) if prices_path else DEFAULT_PRICES
    stop = threading.Event()
    with ExitStack() as stack:
        catalogs = _open_catalogs(stack, source, target, source_options, target_options)
        update = stack.enter_context(progress_bar("mirror"))
        mirror = Mirror(
            *catalogs,
            copies=copies,
            limit=BandwidthLimit(bandwidth) if bandwidth is not None else None,
            # Under a limit, pieces of at most a second's worth: a stop lands within a second.
            piece_bytes=min(DEFAULT_PIECE_BYTES, bandwidth or DEFAULT_PIECE_BYTES),
            pause=Pause(stop_when=stop.is_set),  # --follow's signals stop copies at a piece
            progress=update,
        )
        egress = _Egress(prices, egress_per_gb(prices, mirror.source.uri, mirror.target.uri))
        plan = egress.plan(mirror.plan(steps or None, keep_last=keep_last))
        if follow:
            if as_json:
                click.echo(json.dumps({"time": _now(), "plan": plan}, default=str))
            else:
                click.echo(egress.plan_line(plan))
            every_s = DEFAULT_EVERY_S if every is None else every
            _follow(mirror, keep_last, every_s, as_json, stop, egress)
            return
        if not as_json:
            click.echo(egress.plan_line(plan))
        report = mirror.catch_up(steps or None, keep_last=keep_last)
    if as_json:
        emit_json({**_document(report, egress), "plan": plan})
    else:
        _print_report(report)
        click.echo(egress.moved_line(report.copied_bytes))
    if report.failed:
        shown = ", ".join(str(step) for step in sorted(report.failed))
        raise CommandFailedError(f"{plural(len(report.failed), 'step')} not mirrored: {shown}")


def _open_catalogs(
    stack: ExitStack,
    source: str,
    target: str,
    source_options: tuple[tuple[str, str], ...],
    target_options: tuple[tuple[str, str], ...],
) -> tuple[Catalog, Catalog]:
    """Both stores (closed with `stack`) and their catalogs under the configuration's signing
    keys; SRC's storage options are the config's under --source-option, DST's only
    --target-option (a mirror has credentials of its own)."""
    source_uri, source_settings = resolve_location(source, source_options)
    target_settings = dict(target_options)
    register_secrets(target_settings)
    source_store = stack.enter_context(closing_store(source_uri, source_settings))
    check_root(source_store)
    probe_root(source_store)
    target_store = stack.enter_context(closing_store(target, target_settings))
    if target_store.uri == source_store.uri:
        raise click.UsageError(f"SRC and DST are the same root: {redacted(source_store.uri)}")
    return signed_catalog(source_store, source_uri), signed_catalog(target_store, target)


# --follow -----------------------------------------------------------------------------------------


def _follow(
    mirror: Mirror,
    keep_last: int | None,
    every: float,
    as_json: bool,
    stop: threading.Event,
    egress: _Egress,
) -> None:
    """Catch up every `every` seconds until SIGINT or SIGTERM sets `stop`; one line (or JSON
    document) per round that copied or failed something. A failed step is tried again the next
    round (its warning is logged on stderr each time)."""
    with _stop_on_signals(stop):
        while not stop.is_set():
            try:
                report = mirror.catch_up(keep_last=keep_last)
            except MirrorStoppedError:  # the step in flight stays uncommitted
                return
            copied = [step for step in report.copied if not step.already]
            if copied or report.failed:
                if as_json:
                    document = {"time": _now(), **_document(report, egress)}
                    click.echo(json.dumps(document, default=str))
                else:
                    _print_round(report, copied, egress)
            if stop.wait(every):
                return


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set `stop` instead of ending the process; the previous handlers are
    back on leaving."""

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {number: signal.signal(number, handler) for number in _SIGNALS}
    try:
        yield
    finally:
        for number, before in previous.items():
            signal.signal(number, before)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _now() -> str:
    return utc_time(datetime.now(timezone.utc))


def _print_round(report: MirrorReport, copied: list[StepCopy], egress: _Egress) -> None:
    if copied:
        shown = ", ".join(str(step.step) for step in copied)
        moved = sum(step.copied_bytes for step in copied)
        click.echo(
            f"{_now()} UTC: mirrored {'step' if len(copied) == 1 else 'steps'} {shown} "
            f"({human_size(moved)}, egress {egress.money(egress.cost(moved))}); {_lag(report)}"
        )
    for step, why in sorted(report.failed.items()):
        click.echo(f"{_now()} UTC: step {step} not mirrored: {one_line(why)}")


# Output -------------------------------------------------------------------------------------------


class _Egress:
    """The price of the bytes a mirror moves: `rate` per GB (decimal) from the price table."""

    def __init__(self, prices: PriceTable, rate: float) -> None:
        self.prices = prices
        self.rate = rate

    def cost(self, size: int) -> float:
        return size / GB * self.rate

    def money(self, value: float) -> str:
        return f"{value:.6f} {self.prices.currency} (estimated)"

    def plan(self, plan: MirrorPlan) -> dict[str, Any]:
        """The plan as JSON fields, with its egress price."""
        return {
            "steps": plan.steps,
            "objects": plan.objects,
            "bytes": plan.bytes,
            "egress_per_gb": self.rate,
            "egress_cost": self.cost(plan.bytes),
            "currency": self.prices.currency,
        }

    def plan_line(self, plan: dict[str, Any]) -> str:
        if not plan["objects"]:
            return "plan: nothing to copy"
        steps = ", ".join(str(step) for step in plan["steps"])
        return (
            f"plan: {'step' if len(plan['steps']) == 1 else 'steps'} {steps}: "
            f"{plural(plan['objects'], 'object')}, {human_size(plan['bytes'])} to copy, egress "
            f"{self.money(plan['egress_cost'])} at {self.rate:g} {self.prices.currency}/GB"
        )

    def moved_line(self, size: int) -> str:
        return f"moved {human_size(size)}: egress {self.money(self.cost(size))}"


def _document(report: MirrorReport, egress: _Egress) -> dict[str, Any]:
    """`MirrorReport.to_dict`, with credentials redacted from the URIs and the failures, and
    the egress price of the bytes copied."""
    document = report.to_dict()
    document["egress_cost"] = egress.cost(report.copied_bytes)
    document["egress_per_gb"] = egress.rate
    document["currency"] = egress.prices.currency
    document["source"] = redacted(document["source"])
    document["target"] = redacted(document["target"])
    document["failed"] = {step: one_line(why) for step, why in document["failed"].items()}
    return document


def _print_report(report: MirrorReport) -> None:
    for copy in report.copied:
        click.echo(_step_line(copy))
    for step, why in sorted(report.failed.items()):
        click.echo(f"step {step}: not mirrored: {one_line(why)}")
    if report.retired:
        shown = ", ".join(str(retired) for retired in report.retired)
        click.echo(f"retired {'step' if len(report.retired) == 1 else 'steps'} {shown}")
    click.echo(_lag(report))


def _step_line(step: StepCopy) -> str:
    if step.already:
        return f"step {step.step}: already mirrored"
    present = f" ({step.present_objects} already there)" if step.present_objects else ""
    return (
        f"step {step.step}: copied {plural(step.copied_objects, 'object')}{present}, "
        f"{human_size(step.copied_bytes)} in {step.seconds:.1f} s"
    )


def _lag(report: MirrorReport) -> str:
    if report.steps_behind == 0:
        return "up to date"
    behind = f"{plural(report.steps_behind, 'step')} behind"
    if report.seconds_behind is None:
        return f"{behind}, time unknown"
    return f"{behind}, {report.seconds_behind:.0f} s"
