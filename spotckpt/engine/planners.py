"""Planning: which keys a restore reads, checked, with runs of small tensors adopted; a save's
global plan at thousands of ranks.

`CheckedLoadPlanner` is DCP's default load planner plus clear errors that name missing and
unexpected keys, and the adoption of runs of small tensors (`spotckpt.engine.packing`).
`local_plan` is one rank's plan of a manifest as DCP would make it (the fast tier uses it to learn
which byte ranges a restore needs before it has them), and `wanted_boxes` what a state's load
reads, for the partial manifest of an indexed checkpoint. `ScalingSavePlanner` is the save
planner of indexed saves (many ranks): compact plans, a fast check, unchanged plans not gathered
again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan

from spotckpt.engine.flat_state import is_stateful
from spotckpt.engine.global_plan import PlanCache, apply_global, plan_global, summarize
from spotckpt.engine.packing import RUN_PREFIX, Run, Unpack, adopt_runs
from spotckpt.errors import InvalidArgumentError, KeyMismatchError
from spotckpt.format.index import Box
from spotckpt.format.manifest import Manifest

KeyRule = Callable[[str], bool]
"""A rule about flattened state keys (``model.layer.weight``), given to the planner."""


def _no_key(fqn: str) -> bool:
    return False


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus clear errors naming missing and unexpected keys.

    Missing keys are checked on each rank; unexpected ones on the coordinator against the union
    of what all ranks asked for (ranks may legitimately own different keys). Two rules come from
    the caller, as values: `optional` keys (state that older checkpoints lack) are left out of the
    load when the checkpoint has none, and `unread_ok` stored keys are never unexpected (per-rank
    state of ranks a restore on fewer ranks does not have).

    With the reader's `runs` (`spotckpt.engine.packing`), small tensors stored back to back are
    loaded as one item each run, where every member's destination fits, and unpacked when
    committed.
    """

    def __init__(
        self,
        allow_missing: bool,
        allow_unexpected: bool,
        runs: Mapping[str, Run] | None = None,
        *,
        optional: KeyRule = _no_key,
        unread_ok: KeyRule = _no_key,
    ) -> None:
        super().__init__(allow_partial_load=allow_missing)
        self.allow_unexpected = allow_unexpected
        self.runs = dict(runs or {})
        self.optional = optional
        self.unread_ok = unread_ok
        self.wanted: list[str] = []
        self.unpacks: dict[str, Unpack] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """DCP's set-up, then runs of small tensors (`spotckpt.engine.packing`) adopted where the
        destination can take them whole."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        stored = metadata.state_dict_metadata if metadata else {}
        for fqn in [k for k in self.state_dict if k not in stored and self.optional(k)]:
            del self.state_dict[fqn]  # the destination keeps what it offered
        self.wanted = sorted(self.state_dict)
        self.state_dict, self.unpacks = adopt_runs(self.state_dict, self.runs)

    def take_run(self, name: str) -> Unpack | None:
        """Hand the reader the destinations of adopted run `name`, which it then fills itself
        (`spotckpt.engine.packing.RunDestinations`); committing the run copies nothing."""
        return self.unpacks.pop(name, None)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """A loaded run goes to its members' destinations (unless the reader took them)."""
        unpack = self.unpacks.get(read_item.dest_index.fqn)
        if unpack is not None:
            unpack(tensor)

    def create_local_plan(self) -> LoadPlan:
        stored = set(self.metadata.state_dict_metadata) if self.metadata else set()
        missing = sorted(set(self.wanted) - stored)
        if missing and not self.allow_partial_load:
            raise KeyMismatchError(
                f"missing from the checkpoint: {_some(missing)} (pass strict=False to restore() "
                "to allow this)"
            )
        # DCP's own create_local_plan re-flattens the whole state when checkpoint keys are not
        # in the state (for checkpoints of torch < 2.4, which spotckpt never wrote): that would
        # undo the adopted runs, whose members are such keys.
        if self.metadata is None:
            raise InvalidArgumentError("the load planner was not set up with metadata")
        plan = create_default_local_load_plan(
            self.state_dict, self.metadata, not self.allow_partial_load
        )
        return dataclasses.replace(plan, planner_data=self.wanted)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        wanted = {key for plan in global_plan for key in (plan.planner_data or ())}
        stored = set(self.metadata.state_dict_metadata) if self.metadata else set()
        unexpected = sorted(
            k for k in stored - wanted if not (self.unread_ok(k) or k.startswith(RUN_PREFIX))
        )
        if unexpected and not self.allow_unexpected:
            raise KeyMismatchError(
                f"in the checkpoint but not in the state: {_some(unexpected)} (pass "
                "strict=False to restore() to allow this)"
            )
        return super().create_global_plan(global_plan)


def _some(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def local_plan(
    state_dict: dict[str, Any], manifest: Manifest, planner: CheckedLoadPlanner
) -> LoadPlan:
    """This rank's load plan of `manifest`, as DCP's own local planning makes it."""
    metadata, _ = manifest.to_dcp()
    planner.set_up_planner(plain_state(state_dict), metadata, False)
    return planner.create_local_plan()


def plain_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The dict DCP plans a load of: each Stateful replaced by its state_dict() (plain values
    told apart without the runtime Protocol check, `spotckpt.engine.flat_state.is_stateful`)."""
    return {k: v.state_dict() if is_stateful(v) else v for k, v in state_dict.items()}


def wanted_boxes(state_dict: dict[str, Any]) -> tuple[dict[str, list[Box]], set[str]]:
    """What loading `state_dict` reads, as DCP's load planning sees it: the box (offsets,
    sizes) of each local tensor shard by flattened name, and the names of the other values."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, None, False)
    boxes: dict[str, list[Box]] = {}
    values: set[str] = set()
    for fqn, value in planner.state_dict.items():
        if hasattr(value, "__create_chunk_list__"):  # DTensor, or anything planned like it
            chunks = value.__create_chunk_list__()
            boxes[fqn] = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
        elif isinstance(value, torch.Tensor):
            boxes[fqn] = [((0,) * value.dim(), tuple(value.shape))]
        else:
            values.add(fqn)
    return boxes, values


class ScalingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner with a global plan that scales to thousands of ranks.

    Each rank sends a compact summary of its plan (`spotckpt.engine.global_plan`), or only its
    digest when the coordinator accepted the same plan last time (`cache`, kept by the caller
    across saves); the coordinator deduplicates, builds DCP's metadata and checks the plan with
    every rule of DCP's check in O(n log n) per tensor (`spotckpt.engine.plan_check`), on arrays.
    """

    def __init__(self, cache: PlanCache | None = None) -> None:
        super().__init__()
        self.cache = cache if cache is not None else PlanCache()
        self.local: SavePlan | None = None
        self.digest = b""

    def create_local_plan(self) -> SavePlan:
        self.local = super().create_local_plan()
        summary = summarize(self.local)
        self.digest = summary.digest
        return SavePlan([], planner_data=self.cache.to_send(summary))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = plan_global([p.planner_data for p in all_plans], self.cache)
        self.metadata = metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if self.local is None:
            raise InvalidArgumentError("finish_plan before create_local_plan")
        self.plan = apply_global(self.local, new_plan)
        self.cache.promote(self.digest)
        return self.plan
