"""`ManifestReader`: the only reader of the manifest formats (`spotckpt.format.manifest`, the
indexed `spotckpt.format.index`), for one checkpoint root: sizes checked before a read, signatures
checked under an enforcing keyring, references trusted only into the root's own job.
`spotckpt.catalog.Catalog.read_manifest` reads through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from spotckpt.errors import (
    CorruptCheckpointError,
    ManifestError,
    NoCheckpointError,
    ObjectMissingError,
    ObjectNotFoundError,
)
from spotckpt.format.index import (
    INDEXED_FORMAT,
    Box,
    Part,
    Root,
    Wanted,
    check_part_size,
    every_chunk,
    manifest_format,
    manifest_from_parts,
    overlapping_chunks,
    parse_part,
    parse_root,
    part_ranks,
)
from spotckpt.format.manifest import Manifest, check_manifest_size
from spotckpt.format.references import FEATURE as REFERENCES
from spotckpt.format.references import object_path
from spotckpt.format.signing import Keyring
from spotckpt.layout import JobIdentity, manifest_key, rank_object_key, step_folder
from spotckpt.storage.base import ObjectStore
from spotckpt.storage.copying import Expected

PART_READS = 16
"""Index parts of an indexed manifest are read this many at a time."""
PART_READ_UNCHECKED = 8 << 20
"""An index part the root claims to be larger than this is first looked up (HEAD), so that a
forged root's claim is never the size of a read before the store confirms it; smaller parts
(nearly all) are read at once, with at most `PART_READS` times this many bytes unconfirmed."""

WantedFromRoot = Callable[[Root], tuple[Mapping[str, list[Box]], Iterable[str]]]
"""What a reader needs of an indexed checkpoint, given its root: boxes by tensor, value names."""


class ManifestReader:
    """Reads the manifests of the root of `store`; with a `keyring` (an enforcing one, or None)
    every manifest must be signed for the root's job, told by `job` (read when first needed)."""

    def __init__(
        self, store: ObjectStore, keyring: Keyring | None, job: Callable[[], JobIdentity | None]
    ) -> None:
        self.store = store
        self.keyring = keyring
        self._job = job
        self._job_id: str | None = None

    @property
    def uri(self) -> str:
        """The root's URI."""
        return self.store.uri

    def raw(self, step: int) -> bytes:
        """The raw manifest of a committed step, size-checked before the read."""
        key = manifest_key(step)
        info = self.store.head(key)
        if info is None:
            raise NoCheckpointError(f"step {step} has no committed checkpoint at {self.uri}")
        check_manifest_size(info.size, step)
        try:
            return self.store.get_range(key, 0, info.size)
        except ObjectNotFoundError:
            raise NoCheckpointError(
                f"step {step} has no committed checkpoint at {self.uri}"
            ) from None

    def read(
        self, step: int, wanted: WantedFromRoot | None = None, *, data: bytes | None = None
    ) -> Manifest:
        """The validated manifest of a committed step (ManifestError, NoCheckpointError): the
        only place that knows the manifest formats.

        A ``spotckpt/1`` manifest is one document. An indexed one (``spotckpt/2``) is a root plus
        index parts: with `wanted` (from the root: the boxes of each tensor and the values a
        reader needs) only the parts that locate those chunks are read, and the manifest lists
        just those chunks; without it, every part, checked. `data` is the manifest's bytes when
        already fetched (the coordinator reads them once for every rank).
        """
        if data is None:
            data = self.raw(step)
        return self._completed(self.parse(data, step), data, step, wanted)

    def _completed(
        self, header: Manifest | Root, data: bytes, step: int, wanted: WantedFromRoot | None
    ) -> Manifest:
        """`read` of a manifest already parsed into `header`."""
        self.check_signed(data, step, f"manifest of step {step}")
        if isinstance(header, Manifest):
            if REFERENCES in header.features:
                self._check_job(header)
            return header
        if wanted is None:
            return self._from_parts(header, every_chunk(header), header.values, set(header.parts))
        boxes, values = wanted(header)
        chunks = overlapping_chunks(header, boxes)
        return self._from_parts(header, chunks, values, part_ranks(header, chunks))

    def stored_objects(self, step: int, data: bytes) -> dict[str, Expected]:
        """Every object committed step `step` (manifest bytes `data`) needs, by key relative to
        the root, with the size, CRC32C and (signed) BLAKE3 it must have: its own data objects,
        those of earlier steps it references, and an indexed root's parts. The manifest and
        every part are read and checked as `read` checks them."""
        header = self.parse(data, step)  # parsed once: a flat manifest is its own header
        manifest = self._completed(header, data, step, None)
        folder = step_folder(step)
        needed = {
            object_path(folder, key): Expected(record.size, record.crc32c, record.blake3)
            for key, record in manifest.objects.items()
        }
        if isinstance(header, Root):
            needed.update(
                (f"{folder}/{part.key}", Expected(part.size, part.crc32c))
                for part in header.parts.values()
            )
        return needed

    def check_signed(self, data: bytes, step: int, what: str) -> None:
        """SignatureError unless `data` is signed for `step` of this root's job (only with a
        keyring; the job identity is read when first needed)."""
        if self.keyring is None:
            return
        if self._job_id is None:  # job.json is create-only: once read, it stays
            job = self._job()
            self._job_id = job.id if job is not None else None
        self.keyring.check(data, step=step, job=self._job_id, what=what)

    def parse(self, data: bytes, step: int) -> Manifest | Root:
        """A flat manifest whole, or an indexed one's root."""
        declared = manifest_format(data)
        if declared is not None and declared.split("+")[0] == INDEXED_FORMAT:
            return parse_root(data, step)
        return Manifest.from_json(data, expected_step=step)

    def _check_job(self, manifest: Manifest) -> None:
        """ManifestError unless a manifest with references was written by this root's job: a
        reference is trusted only into the steps of the job that owns the root."""
        job = self._job()
        claimed = manifest.incremental.job if manifest.incremental else ""
        if job is None or job.id != claimed:
            raise ManifestError(
                f"step {manifest.step} references earlier steps as job {claimed[:32]!r}, but "
                f"{self.uri} belongs to job {job.id if job else None!r}: its references are not "
                "trusted"
            )

    def _from_parts(
        self, root: Root, wanted: Wanted, values: Iterable[str], ranks: set[int]
    ) -> Manifest:
        """The manifest of `wanted` from the index parts of `ranks` (all of them for a full read,
        so that every part is checked)."""
        ordered = sorted(ranks)
        with ThreadPoolExecutor(max(1, min(PART_READS, len(ordered)))) as pool:
            parts = dict(
                zip(ordered, pool.map(lambda r: self._read_part(root, r), ordered), strict=True)
            )
        return manifest_from_parts(root, wanted, values, parts)

    def _read_part(self, root: Root, rank: int) -> Part:
        """Rank `rank`'s index part, checked: ObjectMissingError when it is gone,
        CorruptCheckpointError when it does not match the root, ManifestError when it is
        forged (among others, when its object is not its rank's own)."""
        record = check_part_size(root, rank)
        folder = step_folder(root.step)
        key = f"{folder}/{record.key}"
        try:
            if record.size > PART_READ_UNCHECKED:
                self._check_part_size(key, record.size)
            data = self.store.get_range(key, 0, record.size)
        except ObjectNotFoundError:
            raise ObjectMissingError(f"index part {key} of rank {rank} is missing") from None
        part = parse_part(data, root, rank, folder)
        self.check_signed(data, root.step, f"index part {key}")
        own = {rank_object_key(root.attempt, rank, spread) for spread in (False, True)}
        if part.record.key not in own:
            raise ManifestError(
                f"index part {key} locates its chunks in object {part.record.key!r}, which is "
                f"not rank {rank}'s own"
            )
        return part

    def _check_part_size(self, key: str, size: int) -> None:
        """CorruptCheckpointError unless the part at `key` has the `size` the root claims."""
        info = self.store.head(key)
        if info is None:
            raise ObjectNotFoundError(key)
        if info.size != size:
            raise CorruptCheckpointError(
                f"index part {key} has {info.size} bytes, the manifest says {size}"
            )
