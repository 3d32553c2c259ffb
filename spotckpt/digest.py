"""A step's digest: one value that says two copies of a checkpoint hold the same step.

The digest is the root of a binary Merkle tree (BLAKE3) whose leaves are, in this order:

1. the manifest: its document (a flat manifest, or an indexed root) without ``"signature"``,
   encoded canonically (`spotckpt.format.signing.canonical`: keys sorted, compact, ASCII), so
   re-signing a step with a rotated key keeps its digest;
2. every data object of the step, sorted by key (relative to the step folder):
   ``<key> NUL <size> NUL <crc32c> NUL <blake3 or empty>``.

A leaf is ``BLAKE3(0x00 || leaf)``, an inner node ``BLAKE3(0x01 || left || right)``, and a node
without a sibling moves up unchanged; the digest is ``blake3:`` and the root's hex. It is
computed from the manifest alone, so it is cheap to record with every commit (the ``save``
event's ``digest``); ``spotckpt verify --digest`` prints it after checking every byte against
that manifest, so a digest printed by a clean verify stands for the bytes. Copies that keep the
manifest and objects as they are agree: the bucket, a fast-tier copy of the step (its manifest is
the bucket's, byte for byte), a copy of the step folder to another bucket or prefix. A Hugging
Face export is another artifact (other files, other bytes) and has no digest of this kind.
Without signing, the objects' leaves hold only CRC32Cs: the digest then tells copies apart, it
does not prove who made them.
"""

from __future__ import annotations

from collections.abc import Iterable

import blake3

from spotckpt.format import bounded_json
from spotckpt.format.manifest import ObjectRecord
from spotckpt.format.signing import canonical

PREFIX = "blake3:"


def step_digest(manifest_bytes: bytes, objects: Iterable[ObjectRecord]) -> str:
    """The digest of a step from its manifest's bytes and its data objects."""
    document = bounded_json.loads(manifest_bytes, "manifest")
    leaves = [canonical(document)]
    for record in sorted(objects, key=lambda r: r.key):
        fields = (record.key, str(record.size), str(record.crc32c), record.blake3 or "")
        leaves.append("\0".join(fields).encode())
    return PREFIX + merkle_root(leaves).hex()


def merkle_root(leaves: list[bytes]) -> bytes:
    """The root of the binary Merkle tree over `leaves` (see the module docstring)."""
    level = [blake3.blake3(b"\x00" + leaf).digest() for leaf in leaves]
    if not level:
        return blake3.blake3(b"").digest()
    while len(level) > 1:
        paired = [
            blake3.blake3(b"\x01" + level[i] + level[i + 1]).digest()
            for i in range(0, len(level) - 1, 2)
        ]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]
