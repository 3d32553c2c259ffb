"""`StepReadings`: retention's view of a root's committed steps (`spotckpt.policy.StepReading`),
read from the store for `spotckpt.catalog.Catalog.read_steps`, and `missing_objects`, which tells
a manifest whose objects are not all there (rule 1 of `spotckpt.policy`; a commit checks the same).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from spotckpt.errors import (
    BoundedJSONError,
    CorruptCheckpointError,
    ManifestError,
    NoCheckpointError,
    StorageError,
)
from spotckpt.format.index import Box, Root
from spotckpt.format.manifest import Manifest
from spotckpt.layout import (
    MANIFEST_NAME,
    attempt_folders,
    parse_step_folder,
    referenced_folders,
    step_folder,
    step_key,
)
from spotckpt.manifest_reading import PART_READS, WantedFromRoot
from spotckpt.policy import StepReading
from spotckpt.storage.base import Listing, ObjectInfo, ObjectStore

REFERENCE_CHECKS = 16
"""A commit checks the objects its manifest references this many at a time (a HEAD each)."""
LISTED_FROM = 32
"""From this many objects in one attempt folder on, a commit checks them with one listing."""
MISSING_NAMED = 5
"""A failed commit names at most this many of the objects it found missing or resized."""
READ_STEPS_TRIES = 5
"""`Catalog.read_steps` lists again this many times at most while manifests vanish under it."""


def _no_chunks(root: Root) -> tuple[Mapping[str, list[Box]], Iterable[str]]:
    """What retention (`Catalog.read_steps`) wants of an indexed root: no chunk, no value (an
    indexed save never references)."""
    return {}, []


_NO_CHUNKS: WantedFromRoot = _no_chunks


def _described(key: str, size: int, found: ObjectInfo | None) -> str:
    """What is wrong with an object a manifest names (`Catalog.missing_objects`)."""
    if found is None:
        return f"object {key} is missing"
    return f"object {key} is {found.size} bytes, not the {size} written"


class StepReadings:
    """The `StepReading`s of the root of `store`, from `step_listing` (step folders' manifests,
    attempt objects rolled up) and `read_manifest`; a manifest is read again only when the
    listing shows it changed."""

    def __init__(
        self,
        store: ObjectStore,
        read_manifest: Callable[[int, WantedFromRoot], Manifest],
        step_listing: Callable[[], Listing],
    ) -> None:
        self.store = store
        self._read_manifest = read_manifest
        self._step_listing = step_listing
        self._known: dict[int, tuple[ObjectInfo, StepReading]] = {}
        self._committed: dict[int, tuple[int, Manifest]] = {}

    @property
    def uri(self) -> str:
        """The root's URI."""
        return self.store.uri

    def read(self) -> list[StepReading]:
        """Every committed step's `StepReading` (retention's view, `spotckpt.policy`), from
        one listing in which every manifest was read: a manifest deleted while it is read (by
        retention or gc elsewhere) means a new listing, so that no step that commits meanwhile
        goes unseen. A manifest read before, unchanged in the listing, is not read
        again. StorageError when the steps keep changing, or the store fails."""
        try:
            return self._read()
        finally:
            self._committed.clear()  # a seed is for the retention right after its commit

    def _read(self) -> list[StepReading]:
        for _ in range(READ_STEPS_TRIES):
            listing = self._step_listing()
            manifests = {
                step: info
                for info in listing.objects
                if (step := parse_step_folder(info.key.partition("/")[0])) is not None
                and info.key.partition("/")[2] == MANIFEST_NAME
            }
            try:
                readings = self._readings(manifests)
            except NoCheckpointError:
                continue
            return readings
        raise StorageError(
            f"the committed steps under {self.uri} kept changing while retention read them "
            f"({READ_STEPS_TRIES} listings); nothing was deleted"
        )

    def committed(self, manifest: Manifest, size: int) -> None:
        """Learn a manifest this process just committed (`size` bytes, create-only, already
        checked as a reader would: `spotckpt.catalog.Catalog.learn_committed`), so that the
        retention right after the commit does not read back and parse what it wrote: the next
        listing that shows a manifest of that size at that step takes it. Its objects are
        checked then all the same, as for a manifest read back."""
        self._committed[manifest.step] = (size, manifest)

    def _readings(self, manifests: dict[int, ObjectInfo]) -> list[StepReading]:
        """The readings of the listed `manifests`, reading those not known from before (a
        listed time tells a manifest re-saved at the same step apart; without one, no reuse),
        nor committed by this process (`committed`)."""
        known = {
            step: reading
            for step, (info, reading) in self._known.items()
            if manifests.get(step) == info and info.last_modified is not None
        }
        seeded = {
            step: manifest
            for step, (size, manifest) in self._committed.items()
            if step in manifests and step not in known and manifests[step].size == size
        }
        fresh = [step for step in manifests if step not in known and step not in seeded]
        with ThreadPoolExecutor(max(1, min(PART_READS, len(fresh)))) as pool:
            known.update(zip(fresh, pool.map(self._reading, fresh), strict=True))
        known.update((step, self._judged(step, manifest)) for step, manifest in seeded.items())
        self._known = {step: (manifests[step], reading) for step, reading in known.items()}
        return [known[step] for step in sorted(manifests)]

    def forget(self, steps: Iterable[int]) -> None:
        """Drop the readings of steps whose manifest the catalog removes: a step saved again
        in the same second with a manifest of the same size would look unchanged in a listing
        that gives times to the second."""
        for step in steps:
            self._known.pop(step, None)
            self._committed.pop(step, None)

    def _reading(self, step: int) -> StepReading:
        """Retention's view of one committed step; NoCheckpointError when it vanished."""
        try:
            manifest = self._read_manifest(step, _NO_CHUNKS)
        except (ManifestError, CorruptCheckpointError, BoundedJSONError) as error:
            return StepReading(step, None, f"{type(error).__name__}: {error}")
        return self._judged(step, manifest)

    def _judged(self, step: int, manifest: Manifest) -> StepReading:
        """The reading of a readable `manifest`: unreadable when an object it names is missing
        or of another size."""
        missing = missing_objects(
            self.store, step, {k: r.size for k, r in manifest.objects.items()}
        )
        if missing:  # a manifest copied without its objects, or objects deleted since
            more = (
                f" and {len(missing) - MISSING_NAMED} more" if len(missing) > MISSING_NAMED else ""
            )
            return StepReading(step, None, f"{'; '.join(missing[:MISSING_NAMED])}{more}")
        return reading_of(step, manifest)


def reading_of(step: int, manifest: Manifest) -> StepReading:
    """The reading of a readable step whose objects are all there: the attempt folders of its
    own and of earlier steps that it needs."""
    own = {f"{step_folder(step)}/{name}" for name in attempt_folders(manifest)}
    return StepReading(step, frozenset(own | referenced_folders(manifest)))


def missing_objects(store: ObjectStore, step: int, expected: Mapping[str, int]) -> list[str]:
    """The objects of `expected` (key relative to the step folder, and size) that are
    missing or of another size, each described."""
    keys = sorted(expected)
    found = _found(store, step, keys) if keys else {}
    return [
        _described(step_key(step, key), expected[key], info)
        for key in keys
        if (info := found[key]) is None or info.size != expected[key]
    ]


def _found(store: ObjectStore, step: int, keys: list[str]) -> dict[str, ObjectInfo | None]:
    """What the store holds at each of `keys` (relative to the step folder): one listing
    of their folder when there are `LISTED_FROM` or more in one (a request per thousand
    keys), else one HEAD each, `REFERENCE_CHECKS` at a time."""
    folders = {key.partition("/")[0] for key in keys}
    if len(keys) >= LISTED_FROM and len(folders) == 1 and "/" in keys[0]:
        prefix = step_key(step, f"{folders.pop()}/")
        listed = {info.key: info for info in store.list(prefix)}
        return {key: listed.get(step_key(step, key)) for key in keys}
    with ThreadPoolExecutor(min(REFERENCE_CHECKS, len(keys))) as pool:
        found = pool.map(lambda key: store.head(step_key(step, key)), keys)
        return dict(zip(keys, found, strict=True))
