"""What the framework stacks (lightning, accelerate, hf) share once torch is imported: the loader
set-ups a user of a framework writes, a noisy augmentation, and the state digests.

Imported inside a stack's ``run`` (after `_worker.serve`), never at ``--describe``.
"""

from __future__ import annotations

from typing import Any

import torch
from _worker import sha
from torch.utils.data import Dataset, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from spotckpt import SeededDataset

# The loader set-ups, in the order the stacks list them.
STATEFUL_LOADERS = ("stateful-torch-sampler", "stateful", "stateful-nogen", "stateful-augment")


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random augmentation in ``__getitem__``: noise from the global torch RNG of the process
    that loads the sample (a loader worker, or the trainer with ``num_workers=0``)."""

    def __init__(self, base: Dataset[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        features, target = self.base[index]
        return features + 0.1 * torch.randn(features.shape), target


def stateful_loader(
    name: str, data: Dataset[Any], batch_size: int, workers: int, seed: int
) -> tuple[StatefulDataLoader[Any], SeededDataset[Any] | None]:
    """The loader set-up `name` over `data`, and the `SeededDataset` whose epoch the stack must
    set before each ``iter(loader)`` (``stateful-augment``; None for the others):

    - ``stateful-torch-sampler``: the documented set-up, ``sampler=torch RandomSampler(data,
      generator=g1), generator=g2``;
    - ``stateful``: ``shuffle=True, generator=g``: the sampler and the base seed share `g`;
    - ``stateful-nogen``: ``shuffle=True`` and no generator: both draw from the global RNG;
    - ``stateful-augment``: the documented set-up over ``SeededDataset(Noisy(data))``.
    """

    def own(offset: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed + offset)

    common: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers}
    if name == "stateful-torch-sampler":
        sampler = RandomSampler(data, generator=own(0))
        return StatefulDataLoader(data, sampler=sampler, generator=own(1), **common), None
    if name == "stateful":
        return StatefulDataLoader(data, shuffle=True, generator=own(0), **common), None
    if name == "stateful-nogen":
        return StatefulDataLoader(data, shuffle=True, **common), None
    if name == "stateful-augment":
        seeded = SeededDataset(Noisy(data), seed=seed)
        sampler = RandomSampler(seeded, generator=own(0))
        return StatefulDataLoader(seeded, sampler=sampler, generator=own(1), **common), seeded
    raise SystemExit(f"unknown loader set-up {name!r}")


def training_digests(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict[str, str]:
    """A sha256 per state entry: parameters, every optimizer moment, param groups, schedule."""
    found = {f"model/{name}": sha(value) for name, value in model.state_dict().items()}
    saved = optimizer.state_dict()
    for index, moments in saved["state"].items():
        for key, value in moments.items():
            found[f"optim/{index}/{key}"] = sha(value)
    found["optim/param_groups"] = sha(saved["param_groups"])
    found["scheduler"] = sha(scheduler.state_dict())
    return found
