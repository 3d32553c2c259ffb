"""Incremental saves: a chunk whose bytes did not change since the base step is referenced in
the base step's object instead of being uploaded again.

Change detection hashes bytes, never trusts version counters (they miss writes through ``.data``,
numpy views and ``copy_`` into shared storage): every tensor chunk of an incremental save is
hashed with BLAKE3 (256 bits, multi-threaded) from the very bytes the save would upload (the
staged CPU copy for an async save), and the hash goes into the manifest with the chunk. A chunk is
referenced only when the base step holds the same name and chunk offsets with the same dtype,
global shape, chunk sizes and hash; anything else is written. A reference copies the base step's
location of those bytes (its object, range and block CRC32Cs), so a reference never chains
through the base's manifest: it names the step that wrote the bytes.

The base is the newest committed step of the root, when it is a one-document manifest written by
an incremental save of this job (`spotckpt.catalog.JobIdentity`) fewer than `FULL_REWRITE_AFTER`
incremental saves after the last full one; otherwise the save writes everything (a full rewrite,
depth 0), which bounds how long old step folders are held by references.

What may enter a signed manifest (`may_vouch_for`): a reference copies the base's record and
location into a manifest that the job then signs, so a signing save takes a base only when its
manifest was read under the job's keyring and its signature verified (`Catalog` built with the
keyring, the manifest naming the ``signed`` feature), and every record and chunk it would copy
carries a BLAKE3. An unsigned newest step (one planted by a writer without the key, or saved
before the key was set and read with ``accept_unsigned``) is no base: the signing save uploads
every chunk, and the saves after it reference only signed steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spotckpt.catalog import Catalog
from spotckpt.checksum import chunk_hash, crc32c
from spotckpt.errors import CheckpointError
from spotckpt.format.manifest import (
    FORMAT_VERSION,
    ChunkLocation,
    Incremental,
    Manifest,
    ObjectRecord,
)
from spotckpt.format.references import FEATURE, is_reference, object_path
from spotckpt.format.signing import SIGNED
from spotckpt.layout import step_folder

FULL_REWRITE_AFTER = 16
"""Incremental saves in a row (saves that referenced something) after which the next save
writes everything again."""

Chunk = tuple[str, tuple[int, ...]]
"""A tensor chunk by name and offsets."""


@dataclass(frozen=True)
class Stored:
    """A chunk of the base step as a later step would reference it."""

    dtype: str
    shape: tuple[int, ...]
    sizes: tuple[int, ...]
    location: ChunkLocation
    record: ObjectRecord


@dataclass(frozen=True)
class Base:
    """The base step of an incremental save: its chunks by name and offsets, its block size,
    and the depth the save gets when it references any of them."""

    step: int
    depth: int
    block_size: int
    chunks: dict[Chunk, Stored]

    def find(
        self,
        chunk: Chunk,
        dtype: str,
        shape: tuple[int, ...],
        sizes: tuple[int, ...],
        data: memoryview,
    ) -> tuple[Stored | None, str]:
        """The base's stored chunk when it holds exactly `data` in this layout (else None),
        and the hash of `data` when it had to be computed ("" when the layout or the first
        block's CRC32C, recorded by the base, already shows that the bytes differ: then the
        writer hashes them while they upload)."""
        stored = self.chunks.get(chunk)
        if stored is None or (stored.dtype, stored.shape, stored.sizes) != (dtype, shape, sizes):
            return None, ""
        if stored.location.length != data.nbytes:
            return None, ""
        if crc32c(data[: self.block_size]) != stored.location.block_crc32c[0]:
            return None, ""  # a different first block: certainly changed
        digest = chunk_hash(data)
        return (stored if digest == stored.location.blake3 else None), digest


def may_vouch_for(catalog: Catalog, manifest: Manifest) -> bool:
    """Whether a signing save may copy `manifest`'s records into the manifest it signs: read
    under the keyring with a verified signature (a `Catalog` with a keyring refuses a wrong one
    and lets an unsigned one through only with ``accept_unsigned``, so the ``signed`` feature of
    a manifest it returned means a signature that verified), every record with a BLAKE3."""
    return catalog.keyring is not None and SIGNED in manifest.features and not unhashed(manifest)


def unhashed(manifest: Manifest) -> list[str]:
    """The objects of `manifest` whose record, or a chunk or value in which, has no BLAKE3:
    none may be in a manifest that is signed (the signature would cover only CRC32Cs)."""
    keys = {key for key, record in manifest.objects.items() if not record.blake3}
    keys |= {location.key for location in manifest.locations() if not location.blake3}
    return sorted(keys)


def base_of(manifest: Manifest, job: str) -> Base | None:
    """`manifest` as the base of a save of `job`, or None when it may not be one."""
    info = manifest.incremental
    if info is None or not job or info.job != job or info.depth >= FULL_REWRITE_AFTER:
        return None
    folder = step_folder(manifest.step)
    chunks: dict[Chunk, Stored] = {}
    for fqn, tensor in manifest.tensors.items():
        for chunk in tensor.chunks:
            location = chunk.location
            if not location.blake3:
                continue
            record = manifest.objects[location.key]
            key = object_path(folder, location.key)
            chunks[(fqn, chunk.offsets)] = Stored(
                tensor.dtype,
                tensor.shape,
                chunk.sizes,
                replace(location, key=key),
                replace(record, key=key),
            )
    return Base(manifest.step, info.depth + 1, manifest.block_size, chunks)


def load_base(
    catalog: Catalog, step: int | None, job: str | None, *, signing: bool = False
) -> Base | None:
    """The base step `step` (the newest committed one, chosen by the coordinator) read from
    `catalog` (built with the job's keyring), or None: none, not this job's, too deep,
    unreadable, missing objects, or, for a `signing` save, not vouched for (`may_vouch_for`);
    then the save writes everything, which is always correct."""
    if step is None or not job:
        return None
    try:
        manifest = catalog.read_manifest(step)
    except CheckpointError:
        return None
    if manifest.format.split("+")[0] != FORMAT_VERSION:
        return None
    if signing and not may_vouch_for(catalog, manifest):
        return None
    try:  # what the base references must still be there, or the new step could not commit
        catalog.check_referenced(step, {k: r.size for k, r in manifest.objects.items()})
    except CheckpointError:
        return None
    return base_of(manifest, job)


def features_of(manifest: Manifest) -> set[str]:
    """The format features a manifest built by an incremental save uses."""
    return {FEATURE} if any(is_reference(key) for key in manifest.objects) else set()


def record_of(manifest: Manifest, job: str, base: Base | None) -> Incremental:
    """What an incremental manifest records of its save: its job and depth (when this rank
    could not read the base that another rank referenced, the deepest: the next save writes
    everything)."""
    if not any(is_reference(key) for key in manifest.objects):
        return Incremental(job=job, depth=0)
    return Incremental(job=job, depth=base.depth if base is not None else FULL_REWRITE_AFTER)
