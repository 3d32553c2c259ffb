"""Per-sample seeding: randomness drawn in ``Dataset.__getitem__`` that survives a mid-epoch resume.

A resumed run re-creates its DataLoader workers with new base seeds, and their RNG streams start
over, so an augmentation drawn inside a worker would differ from the uninterrupted run's.
`SeededDataset` removes that state altogether: right before each sample it seeds torch's CPU
generator, Python's `random` and NumPy's legacy global RNG from `sample_seed` (a stable hash of
the run seed, the epoch and the sample index), so every sample's randomness is a pure function
of those three, whichever worker produces it and however often the run was interrupted.

The epoch travels with the index: `ResumableSampler` yields `SampleKey` values (ints that carry
``.epoch``). A sampler yielding plain ints (torch's samplers, torchdata's StatefulDataLoader)
uses the epoch set by `SeededDataset.set_epoch`.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator, Sized
from typing import Any, TypeVar, cast

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

T_co = TypeVar("T_co", covariant=True)


class SampleKey(int):
    """A sample index (usable as an int anywhere) that also carries the epoch it was drawn in."""

    epoch: int

    def __new__(cls, index: int, epoch: int) -> SampleKey:
        key = super().__new__(cls, index)
        key.epoch = int(epoch)
        return key

    def __reduce__(self) -> tuple[type[SampleKey], tuple[int, int]]:
        return (SampleKey, (int(self), self.epoch))

    def __repr__(self) -> str:
        return f"SampleKey({int(self)}, epoch={self.epoch})"


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for one sample: BLAKE2b of (seed, epoch, index), the same in every process.

    Stable across processes, runs and releases (Python's ``hash()`` is salted per process), so a
    checkpoint resumed by another interpreter reproduces the same randomness.
    """
    text = f"{int(seed)}:{int(epoch)}:{int(index)}".encode()
    digest = hashlib.blake2b(text, digest_size=8, person=b"spotckpt.sample").digest()
    return int.from_bytes(digest, "little")


def seed_sample_rngs(seed: int) -> None:
    """Seed torch's CPU generator, Python's `random` and NumPy's legacy global RNG from `seed`."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(np.array([seed & 0xFFFF_FFFF, seed >> 32], dtype=np.uint32))


@contextlib.contextmanager
def preserved_rngs() -> Iterator[None]:
    """Restore torch's CPU generator, Python's `random` and NumPy's legacy RNG on exit."""
    torch_state = torch.get_rng_state()
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


class SeededDataset(Dataset[T_co]):
    """Wraps a map-style dataset so each sample's randomness depends only on (seed, epoch, index).

    Before ``dataset[key]`` runs, torch's CPU generator, Python's `random` and NumPy's legacy
    global RNG are seeded from ``sample_seed(seed, epoch, key)``. The epoch is ``key.epoch`` for
    the `SampleKey` values a `ResumableSampler` yields, else the one given to `set_epoch`. In a
    worker process the generators are left as seeded (workers are disposable); in the main
    process (``num_workers=0``) they are restored afterwards, so the trainer's own streams
    (dropout, ...) are not disturbed. CUDA generators and ``np.random.Generator`` objects are not
    seeded: derive those from `sample_seed` yourself.
    """

    def __init__(self, dataset: Dataset[T_co], seed: int) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch for plain-int keys; set it before creating each epoch's loader iterator."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))

    def __getitem__(self, key: Any) -> T_co:
        epoch = key.epoch if isinstance(key, SampleKey) else self.epoch
        seed = sample_seed(self.seed, epoch, key)
        if get_worker_info() is not None:
            seed_sample_rngs(seed)
            return self.dataset[key]
        with preserved_rngs():
            seed_sample_rngs(seed)
            return self.dataset[key]
