"""Replaying a data loader's randomness on resume, so the resumed epoch is the one that was cut.

Creating a data-loader iterator (once per epoch) draws random numbers: its base seed, from the
loader's ``generator=`` or else from the global torch RNG, and the sampler's permutation, from
the sampler's generator (a torch ``RandomSampler``, torchdata's, or one the loader built for
``shuffle=True``), or again from the global RNG. A checkpoint taken mid-epoch holds these
generators as they are *after* those draws, and the loader's own state holds only its position.
So a resumed run re-creates the iterator from the wrong generator states: torch's
``RandomSampler(generator=g)`` shuffles epoch 0's order again in epoch 3, a loader without a
generator shifts the global RNG (and so every later dropout mask) by one draw, and torchdata's
sampler, which resets a generator it shares with the loader, loses the base seed's draw and
shuffles the next epoch differently.

`LoaderRandomness` fixes all of these with one rule. Each time the loader creates an iterator it
records the state of every generator the loader draws from (the global torch RNG, the loader's
and its samplers' generators) *before* the creation; a save stores that record with each
generator's state *now*. On resume, the first iterator is created from the recorded states
(so it draws exactly what the cut epoch drew, and the loader's own state fast-forwards it to the
saved position), and then every generator is set to its saved state, the global RNG to what the
restore made it. No loader class is replaced: the hook is an attribute of the one loader object
(``_get_iterator``, which torch's and torchdata's loaders call for every new iterator, and the
iterator's ``_reset`` for persistent workers). torch offers no public hook for this, which is
why spotckpt writes its own.

Randomness drawn inside worker processes (``Dataset.__getitem__``) is not covered here: see
`spotckpt.seeding.SeededDataset`.
"""

from __future__ import annotations

import collections
import functools
import inspect
import io
import itertools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from spotckpt.errors import ValueLoadError

RECORD_KEY = "_spotckpt_rng"
"""The key under which a loader's (wrapped) ``state_dict`` carries its randomness record."""

_ATTRIBUTE = "_spotckpt_randomness"
_RECORD_PARTS = ("epoch_start", "now")
_GLOBAL = "global"


class LoaderRandomness:
    """The generators one loader draws from, recorded at each iterator creation and replayed.

    `state` is what a save stores; `restore` takes it back, to be applied when the loader next
    creates an iterator (at once when the save came before any iterator existed).
    """

    def __init__(self, loader: Any) -> None:
        self._loader = weakref.ref(loader)  # the loader holds this object: no reference cycle
        self.epoch_start: dict[str, torch.Tensor] | None = None
        self.pending: dict[str, Any] | None = None

    def generators(self) -> dict[str, torch.Generator]:
        """The loader's own generators by role, each object once: the loader's, then its
        samplers' however deep a wrapper holds them (`_sampler_owners`)."""
        found: dict[str, torch.Generator] = {}
        loader = self._loader()
        for role, owner in _sampler_owners(loader):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and all(
                generator is not g for g in found.values()
            ):
                found[role] = generator
        return found

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The state of every generator the loader draws from, the global torch RNG included."""
        states = {role: g.get_state() for role, g in self.generators().items()}
        states[_GLOBAL] = torch.get_rng_state()
        return states

    def state(self) -> bytes:
        """What a save stores: the states before the current iterator's creation, and now.

        One value of a fixed shape (serialized tensors), whatever generators the loader has and
        whether an iterator exists yet: DCP loads into the shape the restoring loader offers.
        """
        now = {role: g.get_state() for role, g in self.generators().items()}
        buffer = io.BytesIO()
        torch.save({"epoch_start": dict(self.epoch_start or {}), "now": now}, buffer)
        return buffer.getvalue()

    def restore(self, record: bytes) -> None:
        """Take a saved record; it is applied when the loader creates its next iterator."""
        epoch_start, now = _parse(record)
        if not epoch_start:  # saved before any iterator existed: the generators are all there is
            self._set(now)
            self.pending = None
            return
        self.pending = {"epoch_start": epoch_start, "now": now}

    def create(self, original: Callable[[], Any]) -> Any:
        """Create an iterator with `original`, recording (or, after a restore, replaying) draws."""
        if self.pending is None:
            self.epoch_start = self.snapshot()
            iterator = original()
        else:
            pending, self.pending = self.pending, None
            current = torch.get_rng_state()
            self.epoch_start = pending["epoch_start"]
            self._set(self.epoch_start)
            try:
                iterator = original()
                _fast_forward_now(iterator)
            finally:
                self._set(pending["now"])
                torch.set_rng_state(current)
        reset = getattr(iterator, "_reset", None)
        if inspect.ismethod(reset):
            # A weak method: the iterator must stay free of reference cycles, or its workers
            # outlive it until a collection (and, at exit, multiprocessing terminates them).
            iterator._reset = functools.partial(self._reset, weakref.WeakMethod(reset))
        return iterator

    def _reset(self, original: weakref.WeakMethod, *args: Any, **kwargs: Any) -> Any:
        # A persistent-workers iterator starts its next epoch here instead of in _get_iterator.
        self.epoch_start = self.snapshot()
        method = original()
        if method is None:
            raise ReferenceError("the data-loader iterator being reset no longer exists")
        return method(*args, **kwargs)

    def _set(self, states: Mapping[str, torch.Tensor]) -> None:
        generators = self.generators()
        for role, state in states.items():
            if role == _GLOBAL:
                torch.set_rng_state(state)
            elif role in generators:
                generators[role].set_state(state)


_LINKS = ("sampler", "batch_sampler")
"""The attributes through which a loader or a sampler holds the samplers it draws from."""
_LEGACY_ROLES = {
    (): "loader",
    ("sampler",): "sampler",
    ("batch_sampler", "sampler"): "batch_sampler",
}
"""The roles records have always named; deeper holders are named by their path."""
_MAX_DEPTH = 4


def _sampler_owners(loader: Any) -> list[tuple[str, Any]]:
    """The loader and every sampler it reaches through `_LINKS`, nearest first, by role.

    A wrapper can hold the sampler that draws: Accelerate on several processes puts the
    loader's batch sampler inside a ``BatchSamplerShard`` (``loader.batch_sampler.
    batch_sampler.sampler``), so looking only one level down missed that sampler's generator
    and a resume shuffled the cut epoch as epoch 0. Each object is visited once.
    """
    owners: list[tuple[str, Any]] = []
    seen: set[int] = set()
    level: list[tuple[tuple[str, ...], Any]] = [((), loader)]
    for _ in range(_MAX_DEPTH + 1):
        following: list[tuple[tuple[str, ...], Any]] = []
        for path, owner in level:
            if owner is None or id(owner) in seen:
                continue
            seen.add(id(owner))
            owners.append((_LEGACY_ROLES.get(path, ".".join(("loader", *path))), owner))
            following.extend(((*path, link), getattr(owner, link, None)) for link in _LINKS)
        level = following
    return owners


def _fast_forward_now(iterator: Any) -> None:
    """Fast-forward a restored iterator's index stream now, from the replayed generators.

    For a sampler with no state of its own, torchdata skips the batches already taken with a
    lazy ``islice``, and a stream built on a Python generator (Accelerate's
    ``BatchSamplerShard``, torch's ``BatchSampler``) draws only when first asked: after `create`
    has set the generators to their saved states, so the cut epoch would be shuffled from the
    wrong ones. Here the taken batches are skipped at once instead, with the epoch-start states
    set, which leaves the generators exactly as far on as the saved states (taken when as many
    batches had been taken). A loader with workers has already fetched ahead while its iterator
    was created, under the same states.
    """
    stream = getattr(iterator, "_sampler_iter", None)
    if not isinstance(stream, itertools.islice) or getattr(iterator, "_num_workers", 0) != 0:
        return
    taken = int(getattr(iterator, "_sampler_iter_yielded", 0))
    fresh = iter(iterator._index_sampler)
    collections.deque(itertools.islice(fresh, taken), maxlen=0)
    iterator._sampler_iter = fresh


def _parse(record: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The two state maps of a stored record (loaded with ``weights_only=True``), checked."""
    if not isinstance(record, (bytes, bytearray)):
        raise ValueLoadError(f"a data loader's randomness record is a {type(record).__name__}")
    try:
        loaded = torch.load(io.BytesIO(record), weights_only=True)
    except Exception as error:
        raise ValueLoadError(f"a data loader's randomness record does not load: {error}") from None
    maps: list[dict[str, torch.Tensor]] = []
    for name in _RECORD_PARTS:
        states = loaded.get(name) if isinstance(loaded, dict) else None
        if not isinstance(states, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) and v.dtype == torch.uint8
            for k, v in states.items()
        ):
            raise ValueLoadError("a data loader's randomness record has an unexpected layout")
        maps.append(states)
    return maps[0], maps[1]


def loader_randomness(loader: Any) -> LoaderRandomness:
    """The loader's `LoaderRandomness`, installed on first use (idempotent).

    The loader's ``_get_iterator`` is wrapped so every new iterator is recorded. For a loader
    with its own ``state_dict`` (torchdata's StatefulDataLoader, Accelerate's), ``state_dict`` and
    ``load_state_dict`` are wrapped too, so that whoever stores the loader's state (spotckpt,
    Lightning's loops, Accelerate) stores the record with it under `RECORD_KEY`.
    """
    existing = getattr(loader, _ATTRIBUTE, None)
    if isinstance(existing, LoaderRandomness):
        return existing
    randomness = LoaderRandomness(loader)
    object.__setattr__(loader, _ATTRIBUTE, randomness)
    get_iterator = getattr(loader, "_get_iterator", None)
    if callable(get_iterator):
        object.__setattr__(
            loader, "_get_iterator", functools.partial(randomness.create, get_iterator)
        )
    state_dict = getattr(loader, "state_dict", None)
    load_state_dict = getattr(loader, "load_state_dict", None)
    if callable(state_dict) and callable(load_state_dict):

        def wrapped_state_dict() -> dict[str, Any]:
            return {**state_dict(), RECORD_KEY: randomness.state()}

        def wrapped_load_state_dict(saved: Mapping[str, Any]) -> Any:
            saved = dict(saved)
            record = saved.pop(RECORD_KEY, None)
            if record is not None:
                randomness.restore(record)
            return load_state_dict(saved)

        object.__setattr__(loader, "state_dict", wrapped_state_dict)
        object.__setattr__(loader, "load_state_dict", wrapped_load_state_dict)
    discard_unused_iterator(loader)
    return randomness


def discard_unused_iterator(loader: Any) -> None:
    """Drop the iterator torchdata's ``state_dict()`` starts on a loader never iterated.

    Asked for its state before any ``iter()`` (Accelerate's ``prepare`` asks), a
    StatefulDataLoader creates an iterator, and its first ``iter()`` then hands out that one. It
    was created before spotckpt looked (its draws are not recorded, its workers not shielded),
    and nothing was taken from it, so it is shut down: the first ``iter()`` creates a new one.
    """
    if not getattr(loader, "_initial_iter_for_state_dict", False):
        return
    unused = loader._iterator
    loader._iterator = None
    loader._initial_iter_for_state_dict = False
    shut_down = getattr(unused, "_shutdown_workers", None)
    if callable(shut_down):
        shut_down()


def take_pending_record(loader: Any) -> None:
    """Apply a record that reached the loader's state before `loader_randomness` was installed.

    Lightning loads its loops' loader states while it sets up the loaders, before any callback
    can install the hook; torchdata then keeps the whole dict, record included, as the state of
    its next iterator (``next_iter_state``, a public attribute). Taking the record out of it
    there, before the first iterator is created, gives the same resume as a hooked load.
    """
    randomness = loader_randomness(loader)
    pending = getattr(loader, "next_iter_state", None)
    if isinstance(pending, dict) and RECORD_KEY in pending:
        randomness.restore(pending.pop(RECORD_KEY))
