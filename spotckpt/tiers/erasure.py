"""Reed-Solomon parity over equal-length stripes, by zfec (a maintained C implementation).

Block numbers follow zfec: 0..K-1 are the data blocks (the K objects' stripes, zero-padded to the
stripe length), K..K+M-1 the parity blocks. Any K of the K+M blocks give back every data block.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

from spotckpt.errors import CorruptCheckpointError
from spotckpt.extras import import_extra


def _zfec() -> ModuleType:
    """zfec, from the ``erasure`` extra (imported on first use: the core install has none)."""
    return import_extra("zfec", "erasure", 'redundancy "ec:K+M"')


def parity_block(data_blocks: list[bytes], parity: int, index: int) -> bytes:
    """Parity block `index` (0-based among the parity blocks) of K equal-length data blocks."""
    encoder = _zfec().Encoder(len(data_blocks), len(data_blocks) + parity)
    return bytes(encoder.encode(tuple(data_blocks), (len(data_blocks) + index,))[0])


def data_block(blocks: Mapping[int, bytes], data: int, parity: int, index: int) -> bytes:
    """Data block `index` rebuilt from any `data` blocks (by zfec block number) of one stripe."""
    if len(blocks) < data:
        raise CorruptCheckpointError(
            f"erasure-coded stripe: {len(blocks)} pieces survive, {data} are needed"
        )
    numbers = tuple(sorted(blocks)[:data])
    decoder = _zfec().Decoder(data, data + parity)
    decoded = decoder.decode(tuple(blocks[n] for n in numbers), numbers)
    return bytes(decoded[index])
