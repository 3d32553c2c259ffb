"""What every ``spotckpt`` command shares: the click group and its logging, the shared options and
their parsers, opening the checkpoint root, and the text helpers (tables, sizes, times) that
escape what a bucket holds and redact credentials."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import click

from spotckpt.catalog import Catalog
from spotckpt.config import Config
from spotckpt.errors import (
    InvalidArgumentError,
    MissingURIError,
    NoCheckpointError,
    ObjectNotFoundError,
    RootMissingError,
)
from spotckpt.redact import is_secret_key, printable, redact, secret_values
from spotckpt.storage import ObjectStore, open_store, uri_scheme
from spotckpt.version import __version__

_secrets: set[str] = set()
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?b?\s*$", re.IGNORECASE)


# Opening the checkpoint root --------------------------------------------------------------------


def redacted(text: str) -> str:
    """`text` without the credentials the arguments and the config named."""
    return redact(text, _secrets)


def register_secrets(options: dict[str, Any]) -> None:
    """Redact the credentials among storage `options` from everything printed from now on."""
    _secrets.update(secret_values(options))


def resolve_location(
    uri: str | None, pairs: Sequence[tuple[str, str]]
) -> tuple[str, dict[str, Any]]:
    """The checkpoint URI and storage options from the arguments over the config."""
    cli_options = dict(pairs)
    register_secrets(cli_options)
    try:
        config = Config.load(uri=uri or None)
    except MissingURIError:
        raise click.UsageError(
            "no checkpoint URI: pass the URI argument or set SPOTCKPT_URI "
            "(or put uri in spotckpt.toml)"
        ) from None
    register_secrets(config.storage_options)
    return config.uri, {**config.storage_options, **cli_options}


def signed_catalog(store: ObjectStore, uri: str | None) -> Catalog:
    """The root's catalog under the configuration's signing keys (``SPOTCKPT_SIGNING_KEY``,
    ``SPOTCKPT_VERIFY_KEYS``, ``SPOTCKPT_ACCEPT_UNSIGNED`` or the config file): with any,
    unsigned and wrongly signed steps are refused."""
    return Catalog.configured(store, Config.load(uri=uri or None))


@contextmanager
def opened_root(uri: str | None, pairs: Sequence[tuple[str, str]]) -> Iterator[ObjectStore]:
    """The checkpoint root's store; a root that does not exist is an error."""
    resolved, options = resolve_location(uri, pairs)
    with closing_store(resolved, options) as store:
        check_root(store)
        yield store


def check_root(store: ObjectStore) -> None:
    """Raise RootMissingError for a local root that is not a folder.

    A missing bucket shows as ObjectNotFoundError from the first listing (see `probe_root`)."""
    if uri_scheme(store.uri) != "file":
        return
    parts = urlsplit(store.uri)
    path = Path(unquote(parts.path) if parts.scheme == "file" else store.uri)
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise RootMissingError(f"checkpoint root {path} {what}")


def probe_root(store: ObjectStore) -> None:
    """List one object so that a missing bucket raises RootMissingError."""
    try:
        next(iter(store.list()), None)
    except ObjectNotFoundError as error:  # S3 NoSuchBucket, GCS 404 on the bucket
        raise RootMissingError(f"checkpoint root {store.uri} does not exist: {error}") from None


@contextmanager
def closing_store(uri: str, options: dict[str, Any]) -> Iterator[ObjectStore]:
    """The store of `uri`, closed on leaving."""
    store = open_store(uri, **options)
    try:
        yield store
    finally:
        store.close()


def resolve_step(store: ObjectStore, step: int | None) -> int:
    """`step`, or the latest committed one; a missing bucket is RootMissingError, not "no step"."""
    try:
        return Catalog(store).resolve(step)
    except NoCheckpointError:
        if step is not None:
            probe_root(store)
        raise


# Formatting ---------------------------------------------------------------------------------------


def utc_time(text_or_time: str | datetime | None) -> str:
    """A UTC time to the second; a manifest's text that is not ISO 8601 is shown as it is."""
    if text_or_time is None:
        return "-"
    if isinstance(text_or_time, str):
        try:
            moment = datetime.fromisoformat(text_or_time)
        except ValueError:
            return text_or_time
    else:
        moment = text_or_time
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def plural(count: int, noun: str) -> str:
    """``1 object``, ``2 objects``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns; cells (names read from a bucket among them) are made printable."""
    rows = [[printable(str(cell)) for cell in row] for row in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=False)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join(lines)


def emit_json(document: Any) -> None:
    """`document` on stdout, indented."""
    click.echo(json.dumps(document, indent=2, default=str))


def one_line(text: str) -> str:
    """`text` redacted, on one line, with control characters escaped."""
    return printable(" ".join(redacted(text).split()))


@contextmanager
def progress_bar(description: str, unit: str = "B") -> Iterator[Callable[[int, int], None]]:
    """A callback ``(done, total)`` that drives a tqdm bar on stderr when it is a terminal;
    in bytes (scaled to KiB, MiB, ...), or in another `unit` counted as it is."""
    from tqdm import tqdm  # only the commands with progress bars pay for importing it

    bar = tqdm(
        desc=description,
        total=0,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )

    def update(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        bar.close()


# Option values ------------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``30m``, ``1h``, ``2d``; ValueError otherwise."""
    match = _DURATION.match(text)
    if match is None:
        raise InvalidArgumentError(f"{text!r} is not a duration such as 90s, 30m, 1h or 2d")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def parse_size(text: str) -> int:
    """Bytes in ``5GB`` (decimal), ``2GiB`` (binary), ``500MB``, ``1000000``; ValueError
    otherwise."""
    match = _SIZE.match(text)
    if match is None:
        raise InvalidArgumentError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB")
    prefix, binary = (match.group(2) or "").lower(), bool(match.group(3))
    power = " kmgt".index(prefix) if prefix else 0
    size = int(float(match.group(1)) * (1024 if binary else 1000) ** power)
    if size < 1:
        raise InvalidArgumentError(f"{text!r} is less than 1 byte")
    return size


class Parsed(click.ParamType):
    """A click parameter type from a parse function that raises ValueError."""

    def __init__(self, name: str, parse: Callable[[str], Any]) -> None:
        self.name = name
        self.parse = parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


def _storage_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        shown = "text that names a credential" if is_secret_key(text) else repr(text.strip())
        raise InvalidArgumentError(f"expected KEY=VALUE, got {shown} without '='")
    if not key.strip():
        raise InvalidArgumentError("expected KEY=VALUE, got no KEY before '='")
    return key.strip(), value


# Shared options and the group ---------------------------------------------------------------------

storage_pair = Parsed("KEY=VALUE", _storage_pair)
"""A ``KEY=VALUE`` storage option (``--storage-option``, ``mirror``'s ``--source-option``)."""
uri_argument = click.argument("uri", required=False, metavar="[URI]")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
storage_option = click.option(
    "--storage-option",
    "-o",
    "storage_options",
    multiple=True,
    type=storage_pair,
    metavar="KEY=VALUE",
    help="Storage back-end option (repeatable), over the config's storage_options.",
)
step_option = click.option(
    "--step", type=click.IntRange(min=0), default=None, help="Step (default: the latest)."
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="spotckpt")
@click.option("-v", "--verbose", is_flag=True, help="Log what is done on stderr.")
def cli(verbose: bool) -> None:
    """Inspect, verify, clean up and export spotckpt checkpoints; launch training jobs.

    URI is s3://bucket/prefix, gs://bucket/prefix, file:///path or a path; without it,
    SPOTCKPT_URI or uri in ./spotckpt.toml is used.
    """
    _configure_logging(verbose)


class _OneLineFormatter(logging.Formatter):
    """``spotckpt: warning: message (Error: text)``: one redacted, printable line per record."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info is not None and record.exc_info[1] is not None:
            error = record.exc_info[1]
            text += f" ({type(error).__name__}: {error})"
        return f"spotckpt: {record.levelname.lower()}: {one_line(text)}"


def _configure_logging(verbose: bool) -> None:
    """spotckpt's records (DEBUG and up with --verbose, else WARNING and up) and other libraries'
    warnings go to stderr, one line each; so do Python warnings."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter())
    package = logging.getLogger("spotckpt")
    package.handlers = [handler]
    package.propagate = False
    package.setLevel(logging.DEBUG if verbose else logging.WARNING)
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.captureWarnings(True)
