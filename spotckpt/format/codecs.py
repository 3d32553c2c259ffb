"""The registry of chunk encodings (`spotckpt.format.encodings`), by the codec a location names.

It holds the built-in compression (`spotckpt.format.compression.ZSTD_PLANES`) and whatever a
caller registers; a manifest naming a codec that no registered encoding reads is refused
(`spotckpt.format.manifest`), as is a read of such a chunk. `registered` scopes a registration
(a test's own encoding), so that none outlives its user.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from spotckpt.format.compression import ZSTD_PLANES
from spotckpt.format.encodings import Encoding, EncodingRegistry

ENCODINGS = EncodingRegistry([ZSTD_PLANES])
"""The encodings this spotckpt reads."""

_E = TypeVar("_E", bound=Encoding)


def encoding_of(codec: str) -> Encoding:
    """The encoding of chunks stored with `codec` (`spotckpt.format.encodings.RAW` for none);
    InvalidArgumentError for a codec that no registered encoding reads."""
    return ENCODINGS.of(codec)


@contextmanager
def registered(encoding: _E) -> Iterator[_E]:
    """`encoding` registered for the duration of the block, and forgotten after it."""
    ENCODINGS.register(encoding)
    try:
        yield encoding
    finally:
        ENCODINGS.unregister(encoding)
