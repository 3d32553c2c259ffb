"""Flat states: a big plain state dict handed to DCP under one top-level key.

DCP spends some 27 us on each TOP-LEVEL key of the dict it saves or loads, whatever the value:
``dcp.save`` and ``dcp.async_save`` call each value's ``state_dict()`` through a logging
decorator (a uuid, a message dict, two log records) after a runtime ``Protocol`` check for
`Stateful` (5-14 us), and ``dcp.load`` makes that check twice per key. A flat dict of 20,000
small tensors pays that half a second per save and per restore. Keys below the top level cost
none of it.

So `for_save` and `for_load` give DCP such a dict (`FLAT_MIN_KEYS` keys or more, no `Stateful`
value) as ``{FLAT_KEY: state_dict}``, with a planner (`FlatSavePlanner`, `FlatLoadPlanner`)
that hands the inner dict itself (the same object) to the planner it wraps at the start of
``set_up_planner``. From there on nothing differs from an unwrapped call: the wrapped planner
flattens, plans and writes the same FQNs, metadata (planner data included) and manifests, and
a load sets non-tensor values in the caller's dict (`DefaultLoadPlanner` sets them in the dict it
was set up with; DCP's own write-back only replaces ``FLAT_KEY`` in the wrapper). A staged
asynchronous save stages the wrapper (DCP's stager copies nested dicts), and the planner unwraps
the staged copy. The choice is each rank's own: nothing another rank sees depends on it.

A `Stateful` value keeps DCP's own path (DCP must call its ``state_dict()`` and
``load_state_dict()``), and so does a small dict, whose keys cost little.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.stateful import Stateful

from spotckpt.errors import InvalidArgumentError

FLAT_KEY = "\0spotckpt.flat-state"
"""The wrapper's one key: a NUL never starts a key a user or DCP writes, and the key never
reaches a plan (the planner unwraps before it flattens)."""

FLAT_MIN_KEYS = 32
"""Top-level keys from which a plain state dict is wrapped."""

_PLAIN_TYPES = frozenset(
    {
        torch.Tensor,
        torch.nn.Parameter,
        dict,
        list,
        tuple,
        int,
        float,
        str,
        bytes,
        bool,
        type(None),
    }
)
"""Exact types that are never `Stateful`: checked by a set lookup (some 50 ns) instead of the
runtime Protocol check (5-14 us). Subclasses, which could define ``state_dict()`` and
``load_state_dict()``, take the Protocol check, and so does a DTensor: importing
``torch.distributed.tensor`` with spotckpt made forked DataLoader workers fail their first import
(numpy.random) in tests/state/test_loader_rng.py."""


def is_stateful(value: Any) -> bool:
    """Whether DCP treats `value` as `Stateful` (``isinstance(value, Stateful)``), cheaply for
    the plain types a state dict is made of."""
    return type(value) not in _PLAIN_TYPES and isinstance(value, Stateful)


def _wraps(state_dict: dict[str, Any]) -> bool:
    return len(state_dict) >= FLAT_MIN_KEYS and not any(map(is_stateful, state_dict.values()))


def _inner(state_dict: dict[str, Any]) -> dict[str, Any]:
    inner = state_dict.get(FLAT_KEY) if len(state_dict) == 1 else None
    if not isinstance(inner, dict):
        raise InvalidArgumentError(
            f"a flat-state planner was given a state without its one key {FLAT_KEY!r}"
        )
    return inner


def for_save(
    state_dict: dict[str, Any], planner: SavePlanner
) -> tuple[dict[str, Any], SavePlanner]:
    """The state and planner to hand DCP's save: `state_dict` wrapped with a `FlatSavePlanner`
    around `planner` when it is big and plain (module docstring), else both as they are."""
    if not _wraps(state_dict):
        return state_dict, planner
    return {FLAT_KEY: state_dict}, FlatSavePlanner(planner)


def for_load(
    state_dict: dict[str, Any], planner: LoadPlanner
) -> tuple[dict[str, Any], LoadPlanner]:
    """The state and planner to hand DCP's load: `state_dict` wrapped with a `FlatLoadPlanner`
    around `planner` when it is big and plain, else both as they are."""
    if not _wraps(state_dict):
        return state_dict, planner
    return {FLAT_KEY: state_dict}, FlatLoadPlanner(planner)


class _Forwarding:
    """What DCP, the storage writer or reader ask of the wrapped planner beyond its abstract
    methods (a `PackingSavePlanner`'s ``packs``, ``lookup_object``, ...) is the wrapped
    planner's own."""

    inner: Any

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":  # pickling, copying: the object's own
            raise AttributeError(name)
        return getattr(self.inner, name)


class FlatSavePlanner(_Forwarding, SavePlanner):
    """`inner`, set up with the state inside `FLAT_KEY` (the staged copy, for an asynchronous
    save). Picklable, for DCP's upload process (``async_mode="process"``)."""

    def __init__(self, inner: SavePlanner) -> None:
        self.inner = inner

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.inner.set_up_planner(_inner(state_dict), storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        return self.inner.create_local_plan()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return self.inner.create_global_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return self.inner.finish_plan(new_plan)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self.inner.resolve_data(write_item)


class FlatLoadPlanner(_Forwarding, LoadPlanner):
    """`inner`, set up with the caller's state inside `FLAT_KEY`: the same dict, so that the
    values it loads land there."""

    def __init__(self, inner: LoadPlanner) -> None:
        self.inner = inner

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.inner.set_up_planner(_inner(state_dict), metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        return self.inner.create_local_plan()

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return self.inner.create_global_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return self.inner.finish_plan(central_plan)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.inner.load_bytes(read_item, value)

    def resolve_bytes(self, read_item: ReadItem) -> io.BytesIO:
        return self.inner.resolve_bytes(read_item)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.inner.resolve_tensor(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.inner.commit_tensor(read_item, tensor)
