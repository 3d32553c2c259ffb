"""CRC32C (Castagnoli), the checksum of every object and tensor chunk, and BLAKE3, the strong
hash of chunks that incremental saves compare and reads of signed steps check.

Computed with the ``crc32c`` package rather than ``google-crc32c``: both run the same hardware
instruction, but google-crc32c's C entry point accepts only ``bytes``, so checksumming a tensor or
an upload buffer would first copy it (measured here: 0.3 GiB/s with the copy against 10.8 GiB/s
for ``crc32c`` on a memoryview, which also releases the GIL while it runs).
"""

from __future__ import annotations

import base64

import blake3
from crc32c import crc32c as _crc32c

Buffer = bytes | bytearray | memoryview


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of `data`, continuing from `value` (the CRC of what came before)."""
    return int(_crc32c(data, value))


def crc32c_b64(data: Buffer) -> str:
    """CRC32C in the base64 big-endian form S3's ``x-amz-checksum-crc32c`` expects."""
    return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode()


def chunk_hash(data: Buffer) -> str:
    """BLAKE3 of a chunk's bytes, hex (multi-threaded for large chunks)."""
    threads = blake3.blake3.AUTO if memoryview(data).nbytes >= 1 << 20 else 1
    return str(blake3.blake3(data, max_threads=threads).hexdigest())
