"""Redundancy specs of the fast tier (``replicate:F``, ``ec:K+M``): the value, its parser and the
check of the `redundancy` setting.

Pure (no torch, no store, nothing of `spotckpt.tiers`), so that `spotckpt.config` checks the
setting with the tier's own parser without importing the tier; `spotckpt.tiers.redundancy`
places the copies a spec asks for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spotckpt.errors import InvalidArgumentError
from spotckpt.extras import has_module

_REPLICATE = re.compile(r"replicate:([0-9]{1,3})")
_ERASURE = re.compile(r"ec:([0-9]{1,3})\+([0-9]{1,3})")
MAX_PIECES = 256  # zfec's limit on K+M


@dataclass(frozen=True)
class Redundancy:
    """A parsed spec: `copies` for replication, or `data` + `parity` for erasure coding."""

    copies: int = 1
    data: int = 0
    parity: int = 0

    @property
    def erasure(self) -> bool:
        """True for ``ec:K+M``."""
        return self.data > 0

    @property
    def nodes_needed(self) -> int:
        """The fewest nodes the spec can be placed on."""
        return self.data + self.parity if self.erasure else self.copies

    @property
    def storage_factor(self) -> float:
        """Bytes kept in the tier per byte of state."""
        return (self.data + self.parity) / self.data if self.erasure else float(self.copies)

    def __str__(self) -> str:
        return f"ec:{self.data}+{self.parity}" if self.erasure else f"replicate:{self.copies}"


NO_REDUNDANCY = Redundancy()


def parse_redundancy(spec: str | None) -> Redundancy:
    """``None`` (the local copy only), ``"replicate:F"`` (F >= 1) or ``"ec:K+M"``."""
    if spec is None:
        return NO_REDUNDANCY
    replicate = _REPLICATE.fullmatch(spec)
    if replicate and int(replicate.group(1)) >= 1:
        return Redundancy(copies=int(replicate.group(1)))
    erasure = _ERASURE.fullmatch(spec)
    if erasure:
        data, parity = int(erasure.group(1)), int(erasure.group(2))
        if data >= 1 and parity >= 1 and data + parity <= MAX_PIECES:
            return Redundancy(data=data, parity=parity)
    raise InvalidArgumentError(
        f'redundancy must be None, "replicate:F" (F >= 1) or "ec:K+M" (K, M >= 1, K+M <= '
        f"{MAX_PIECES}), got {spec!r}"
    )


def check_redundancy(spec: str) -> None:
    """The `redundancy` setting's check: InvalidArgumentError unless `spec` parses, and, for
    ``ec:K+M``, zfec (the ``erasure`` extra) is installed."""
    if parse_redundancy(spec).erasure and not has_module("zfec"):
        raise InvalidArgumentError("ec:K+M needs zfec: pip install 'spotckpt[erasure]'")
