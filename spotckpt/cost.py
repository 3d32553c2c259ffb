"""What checkpoints cost on an object store: a price table and the estimates made from it.

Object stores bill three things that a checkpoint uses: requests, in classes (see
`spotckpt.storage.requests`), bytes stored per month, and bytes that leave the region (none, when
training runs in the bucket's region, as it should). `DEFAULT_PRICES` is S3 Standard in
us-east-1 (aws.amazon.com/s3/pricing, checked 2026): $0.005 per 1,000 PUT, COPY, POST and LIST
requests, $0.0004 per 1,000 GET, HEAD and other requests, DELETE free, $0.023 per GB-month for
the first 50 TB. GCS Standard (cloud.google.com/storage/pricing: class A $0.005, class B $0.0004
per 1,000, $0.020 per GB-month in us-central1) and Azure hot blobs are close; a user whose prices
differ passes a JSON object of the fields of `PriceTable` (``spotckpt stats --prices FILE``).

The figures are estimates: list prices, no free tier, no discounts, and requests counted by the
processes that saved (a save's uploads in another process are counted only where that process
reports them).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from spotckpt.errors import InvalidArgumentError
from spotckpt.storage.requests import RequestTally

GB = 1e9
"""Object stores price per decimal gigabyte."""


@dataclass(frozen=True)
class PriceTable:
    """Prices in `currency`; requests per 1,000, storage per GB-month, egress per GB."""

    write_per_1000: float = 0.005
    read_per_1000: float = 0.0004
    delete_per_1000: float = 0.0
    storage_per_gb_month: float = 0.023
    egress_per_gb: float = 0.0
    currency: str = "USD"

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name != "currency" and not (
                isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
            ):
                raise InvalidArgumentError(f"price {item.name} must be a number >= 0: {value!r}")

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
        return asdict(self)


DEFAULT_PRICES = PriceTable()


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
