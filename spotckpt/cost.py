"""What checkpoints cost on an object store: a price table and the estimates made from it.

Object stores bill three things that a checkpoint uses: requests, in classes (see
`spotckpt.storage.requests`), bytes stored per month, and bytes that leave the region (none, when
training runs in the bucket's region, as it should). `DEFAULT_PRICES` is S3 Standard in
us-east-1 (aws.amazon.com/s3/pricing, checked 2026): $0.005 per 1,000 PUT, COPY, POST and LIST
requests, $0.0004 per 1,000 GET, HEAD and other requests, DELETE free, $0.023 per GB-month for
the first 50 TB. GCS Standard (cloud.google.com/storage/pricing: class A $0.005, class B $0.0004
per 1,000, $0.020 per GB-month in us-central1) and Azure hot blobs are close; a user whose prices
differ passes a JSON object of the fields of `PriceTable` (``spotckpt stats --prices FILE``).

Mirrors (`spotckpt.mirroring`) move every byte they copy out of the source's region, priced per
provider pair (`egress_per_gb`). The provider is read from the URI's scheme: ``s3`` (AWS), ``gs``
(Google Cloud), ``az`` (Azure); anything else (a local folder, memory, fsspec) is ``local``, from
which nothing is billed. `DEFAULT_EGRESS_PER_GB` holds list prices per GB as the providers'
pages gave them (2025; check them, they change):

- within one provider, to another region: AWS $0.02 between most regions
  (aws.amazon.com/s3/pricing, "Data Transfer"); GCS $0.02 between regions of one continent,
  up to $0.08 or more between continents (cloud.google.com/storage/pricing, "Network");
  Azure $0.02 between regions of one continent (azure.microsoft.com/pricing/details/bandwidth);
- to another cloud (or a local folder), which is internet egress: AWS $0.09 for the first 10 TB
  of a month, GCS premium tier $0.12 for the first TB, Azure $0.087 for the first 10 TB.

Whether two roots of one provider are in one region (free) cannot be told from their URIs (a
bucket's region is not in its name), so two roots of one provider are priced as another region;
a price file overrides any pair (``"egress_per_gb_between": {"s3->s3": 0}``).

The figures are estimates: list prices, no free tier, no discounts, and requests counted by the
processes that saved (a save's uploads in another process are counted only where that process
reports them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from spotckpt.errors import InvalidArgumentError
from spotckpt.storage.registry import uri_scheme
from spotckpt.storage.requests import RequestTally

GB = 1e9
"""Object stores price per decimal gigabyte."""

PROVIDERS = ("s3", "gs", "az", "local")
"""Who bills a root's egress, by its URI's scheme (`provider`); ``local`` bills nothing."""
_SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
_REGION_PER_GB = {"s3": 0.02, "gs": 0.02, "az": 0.02}
"""Another region of the same provider (see the module docstring)."""
_INTERNET_PER_GB = {"s3": 0.09, "gs": 0.12, "az": 0.087}
"""Out of the provider's cloud: internet egress, first tier (see the module docstring)."""


def _default_rate(source: str, target: str) -> float:
    if source == "local":
        return 0.0
    return _REGION_PER_GB[source] if source == target else _INTERNET_PER_GB[source]


DEFAULT_EGRESS_PER_GB: dict[str, float] = {
    f"{source}->{target}": _default_rate(source, target)
    for source in PROVIDERS
    for target in PROVIDERS
}
"""Egress per GB from the provider of a source root to that of a target root, ``"s3->gs"``."""


@dataclass(frozen=True)
class PriceTable:
    """Prices in `currency`; requests per 1,000, storage per GB-month, egress per GB."""

    write_per_1000: float = 0.005
    read_per_1000: float = 0.0004
    delete_per_1000: float = 0.0
    storage_per_gb_month: float = 0.023
    egress_per_gb: float = 0.0
    """Bytes the job's own processes read from the store (0: training in the bucket's region)."""
    currency: str = "USD"
    egress_per_gb_between: Mapping[str, float] = field(default_factory=dict)
    """Mirror egress per GB by provider pair (``"s3->gs"``), over `DEFAULT_EGRESS_PER_GB`."""

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name not in ("currency", "egress_per_gb_between") and not _price(value):
                raise InvalidArgumentError(f"price {item.name} must be a number >= 0: {value!r}")
        routes = self.egress_per_gb_between
        if not isinstance(routes, Mapping):
            raise InvalidArgumentError(
                'egress_per_gb_between must be an object from a pair such as "s3->gs" to a '
                f"price per GB, got {type(routes).__name__}"
            )
        for route, value in routes.items():
            if route not in DEFAULT_EGRESS_PER_GB:
                raise InvalidArgumentError(
                    f"egress_per_gb_between: unknown pair {route!r}; pairs are SOURCE->TARGET "
                    f'of {", ".join(PROVIDERS)} ("s3->gs")'
                )
            if not _price(value):
                raise InvalidArgumentError(
                    f"egress_per_gb_between[{route!r}] must be a number >= 0: {value!r}"
                )

    def requests_cost(self, tally: RequestTally) -> float:
        """The price of the requests in `tally`, and of the bytes it received (egress)."""
        return (
            tally.write * self.write_per_1000 / 1000
            + tally.read * self.read_per_1000 / 1000
            + tally.delete * self.delete_per_1000 / 1000
            + tally.received / GB * self.egress_per_gb
        )

    def storage_cost_per_month(self, size: float) -> float:
        """The price of keeping `size` bytes for a month."""
        return size / GB * self.storage_per_gb_month

    def to_dict(self) -> dict[str, Any]:
        """The table as JSON fields (the form `load_prices` reads)."""
        document = asdict(self)
        document["egress_per_gb_between"] = dict(self.egress_per_gb_between)
        return document


def _price(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


DEFAULT_PRICES = PriceTable()


def provider(uri: str) -> str:
    """Who bills the egress of the root at `uri`: ``s3``, ``gs``, ``az``, else ``local``."""
    return _SCHEMES.get(uri_scheme(uri).lower(), "local")


def egress_per_gb(prices: PriceTable, source: str, target: str) -> float:
    """The price per GB of copying from the root at `source` to the root at `target` (URIs):
    the table's override for their provider pair, else `DEFAULT_EGRESS_PER_GB`. Two roots of
    one provider count as two regions (their URIs do not say whether they share one)."""
    return provider_egress_per_gb(prices, provider(source), provider(target))


def provider_egress_per_gb(prices: PriceTable, source: str, target: str) -> float:
    """`egress_per_gb` between two providers of `PROVIDERS` (``"s3"``, ``"local"``)."""
    route = f"{source}->{target}"
    return float(prices.egress_per_gb_between.get(route, DEFAULT_EGRESS_PER_GB[route]))


def egress_cost(prices: PriceTable, source: str, target: str, size: float) -> float:
    """The price of copying `size` bytes from the root at `source` to the root at `target`."""
    return size / GB * egress_per_gb(prices, source, target)


def load_prices(path: str | Path) -> PriceTable:
    """A price table from a JSON object of `PriceTable`'s fields; missing ones keep the
    defaults, unknown ones are refused."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"cannot read the price table {path}: {error}") from None
    if not isinstance(document, dict):
        raise InvalidArgumentError(f"the price table {path} must be a JSON object")
    known = {item.name for item in fields(PriceTable)}
    unknown = sorted(set(document) - known)
    if unknown:
        raise InvalidArgumentError(f"unknown prices {unknown} in {path}; known: {sorted(known)}")
    return PriceTable(**document)
