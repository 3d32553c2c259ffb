"""Flat states (issue 48): a big plain state dict reaches DCP under one top-level key, and what is
written and restored is exactly what the unwrapped dict gives.

Also the rank script of the two-rank tests (run as ``__main__`` by `launch_ranks`).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import spotckpt.engine.checkpointer as checkpointer
from spotckpt import CheckpointManager
from spotckpt.engine import flat_state
from spotckpt.engine.flat_state import (
    FLAT_KEY,
    FLAT_MIN_KEYS,
    FlatLoadPlanner,
    FlatSavePlanner,
    for_load,
    for_save,
    is_stateful,
)
from spotckpt.engine.packing import PackingSavePlanner
from spotckpt.engine.planners import CheckedLoadPlanner
from spotckpt.errors import InvalidArgumentError
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key, step_key
from spotckpt.storage import open_store

from dist_worker import launch_ranks
from tests_support import HeldStore, assert_equal

NEVER = 1 << 40
"""`FLAT_MIN_KEYS` that no state reaches: DCP gets every dict as it is."""


def _state(seed: int, prefix: str = "", tensors: int = 40) -> dict[str, Any]:
    """A flat dict of small tensors (several dtypes) with plain values among them."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {
        f"{prefix}t{i}": torch.randn(3 + i % 5, generator=g).to(
            (torch.float32, torch.bfloat16, torch.float64)[i % 3]
        )
        for i in range(tensors)
    }
    state[f"{prefix}ids"] = torch.randint(0, 1 << 30, (7,), generator=g)
    state[f"{prefix}count"] = 7 + seed
    state[f"{prefix}name"] = f"run-{seed}"
    state[f"{prefix}blob"] = bytes([seed % 256, 0, 255])
    state[f"{prefix}nested"] = {"lr": 0.5 + seed, "w": torch.randn(4, generator=g)}
    return state


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    """A destination of `state`'s keys whose every value differs from it."""
    blank: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            blank[key] = torch.full_like(value, -1)
        elif isinstance(value, dict):
            blank[key] = _blank(value)
        elif isinstance(value, bytes):
            blank[key] = b""
        else:
            blank[key] = type(value)()
    return blank


def _spy(seen: list[int], call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` (`for_save` or `for_load`), recording how many top-level keys DCP was given."""

    def spied(state_dict: dict[str, Any], planner: Any) -> Any:
        result = call(state_dict, planner)
        seen.append(len(result[0]))
        return result

    return spied


def _normalized(uri: str, step: int) -> dict[str, Any]:
    """A step's manifest as written, less what differs between two saves of the same state:
    the attempt id (in the object names too) and the time."""
    raw = open_store(uri).get(manifest_key(step))
    attempt = Manifest.from_json(raw).attempt
    written = json.loads(raw.decode().replace(attempt, "ATTEMPT"))
    del written["created_at"]
    return dict(written)


def _objects(uri: str, step: int) -> list[bytes]:
    manifest = Manifest.from_json(open_store(uri).get(manifest_key(step)))
    return [open_store(uri).get(step_key(step, key)) for key in sorted(manifest.objects)]


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Top-level key counts DCP was handed, by ``save`` (both kinds) and ``load``."""
    counts: dict[str, list[int]] = {"save": [], "load": []}
    monkeypatch.setattr(checkpointer, "for_save", _spy(counts["save"], for_save))
    monkeypatch.setattr(checkpointer, "for_load", _spy(counts["load"], for_load))
    return counts


# The wrap itself -------------------------------------------------------------------------------


class _StatefulDict(dict[str, Any]):
    def state_dict(self) -> dict[str, Any]:
        return dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.update(state)


def test_plain_values_are_told_from_stateful_ones_exactly() -> None:
    plain = [torch.zeros(2), nn.Parameter(torch.zeros(2)), {}, [], (), 1, 1.5, "s", b"b", True]
    assert not any(is_stateful(v) for v in [*plain, None])
    # a subclass of a plain type is checked as DCP checks it
    assert is_stateful(_StatefulDict()) and is_stateful(nn.Linear(1, 1))


def test_only_big_plain_states_are_wrapped() -> None:
    planner = PackingSavePlanner()
    small = {f"k{i}": torch.zeros(1) for i in range(FLAT_MIN_KEYS - 1)}
    assert for_save(small, planner) == (small, planner)
    big = {**small, "last": 3}
    wrapped, flat = for_save(big, planner)
    assert list(wrapped) == [FLAT_KEY] and wrapped[FLAT_KEY] is big
    assert isinstance(flat, FlatSavePlanner) and flat.inner is planner
    with_stateful = {**big, "module": nn.Linear(1, 1)}
    assert for_save(with_stateful, planner) == (with_stateful, planner)
    loader = CheckedLoadPlanner(False, False)
    wrapped, flat_load = for_load(big, loader)
    assert wrapped[FLAT_KEY] is big and isinstance(flat_load, FlatLoadPlanner)


def test_the_planners_set_up_with_the_callers_dict_and_pickle() -> None:
    state = _state(0)
    wrapped, flat = for_save(state, PackingSavePlanner())
    flat.set_up_planner(wrapped, None, True)
    assert set(flat.inner.state_dict) >= {"count", "name", "nested.lr"}  # flattened as unwrapped
    assert flat.packs and flat.packs is flat.inner.packs  # the wrapped planner's, read through
    copy = pickle.loads(pickle.dumps(FlatSavePlanner(PackingSavePlanner())))  # process mode
    assert isinstance(copy.inner, PackingSavePlanner)
    loader = CheckedLoadPlanner(False, False)
    wrapped, flat_load = for_load(state, loader)
    flat_load.set_up_planner(wrapped, None, False)
    assert loader.original_state_dict is state
    with pytest.raises(InvalidArgumentError, match="one key"):
        flat_load.set_up_planner(state, None, False)


# Through a manager, one process ----------------------------------------------------------------


def test_a_wrapped_save_writes_exactly_what_an_unwrapped_one_writes(
    tmp_path: Path, seen: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    uris = {}
    for label, least in (("wrapped", FLAT_MIN_KEYS), ("unwrapped", NEVER)):
        monkeypatch.setattr(flat_state, "FLAT_MIN_KEYS", least)
        uris[label] = str(tmp_path / label)
        with CheckpointManager(uris[label], preemption=False) as mgr:
            mgr.save(1, _state(1), blocking=True)
    assert seen["save"][0] == 1 and seen["save"][1] > FLAT_MIN_KEYS
    wrapped, unwrapped = _normalized(uris["wrapped"], 1), _normalized(uris["unwrapped"], 1)
    assert wrapped["planner_data"]["nested.lr"] == ["nested", "lr"]
    assert wrapped == unwrapped  # FQNs, tensors, values, DCP's planner data
    assert _objects(uris["wrapped"], 1) == _objects(uris["unwrapped"], 1)


def test_a_wrapped_restore_is_bit_exact_and_in_place(
    tmp_path: Path, seen: dict[str, list[int]]
) -> None:
    saved = _state(2)
    with CheckpointManager(str(tmp_path / "ck"), preemption=False) as mgr:
        mgr.save(1, saved, blocking=True)
        restored = _blank(saved)
        tensor, nested = restored["t0"], restored["nested"]
        assert mgr.restore(restored) == 1
    assert seen["load"] == [1]
    assert_equal(restored, saved)
    assert restored["t0"] is tensor and restored["nested"] is nested  # loaded in place
    assert type(restored["count"]) is int and restored["blob"] == saved["blob"]


def test_an_async_save_writes_the_staged_copy(tmp_path: Path, seen: dict[str, list[int]]) -> None:
    """The upload is held until the state changed under it: what it writes is the copy staged
    when ``save`` returned, unwrapped by the planner."""
    uri = str(tmp_path / "ck")
    store = HeldStore(open_store(uri))
    saved = _state(3)
    with CheckpointManager(uri, store=store, async_save=True, preemption=False) as mgr:
        store.hold = True
        mgr.save(1, saved)
        for value in [*saved.values(), *saved["nested"].values()]:
            if isinstance(value, torch.Tensor):
                value.zero_()
        saved["count"] = -5
        store.gate.set()
        mgr.wait()
        restored = _blank(saved)
        assert mgr.restore(restored) == 1
    assert seen["save"] == [1] and store.waiting.is_set()
    assert_equal(restored, _state(3))


def test_a_state_with_a_stateful_value_is_not_wrapped(
    tmp_path: Path, seen: dict[str, list[int]]
) -> None:
    torch.manual_seed(0)
    saved = {**_state(4), "model": nn.Linear(3, 2)}
    with CheckpointManager(str(tmp_path / "ck"), preemption=False) as mgr:
        mgr.save(1, saved, blocking=True)
        torch.manual_seed(1)
        restored = {**_blank(_state(4)), "model": nn.Linear(3, 2)}
        assert mgr.restore(restored) == 1
    assert seen["save"][0] > FLAT_MIN_KEYS and seen["load"][0] > FLAT_MIN_KEYS
    assert_equal(restored["model"].state_dict(), saved["model"].state_dict())
    assert_equal({k: v for k, v in restored.items() if k != "model"}, _state(4))


# Two ranks -------------------------------------------------------------------------------------


def _run_ranks(tmp_path: Path, label: str, least: int) -> tuple[str, list[dict[str, Any]]]:
    out = tmp_path / label
    out.mkdir()
    uri = str(tmp_path / f"ck-{label}")
    args = {"uri": uri, "out": str(out), "least": least}
    for rank, result in enumerate(launch_ranks(2, "ranks", args, worker=__file__)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    return uri, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.process
@pytest.mark.timeout(400)
def test_two_ranks_write_and_restore_the_same_through_the_wrap(tmp_path: Path) -> None:
    """Each rank's own keys and replicated ones (written once), saved blocking, then in process
    mode; restored bit-exact on both ranks; the manifests equal those of unwrapped saves."""
    uri, ranks = _run_ranks(tmp_path, "wrapped", FLAT_MIN_KEYS)
    plain_uri, plain_ranks = _run_ranks(tmp_path, "unwrapped", NEVER)
    assert all(r["save"] == [1, 1] and r["load"] == [1, 1] for r in ranks)
    assert all(min(r["save"]) > FLAT_MIN_KEYS for r in plain_ranks)
    assert all(r["restored"] == [True, True] for r in [*ranks, *plain_ranks])
    for step in (1, 2):
        assert _normalized(uri, step) == _normalized(plain_uri, step)
        manifest = Manifest.from_json(open_store(uri).get(manifest_key(step)))
        assert {"r0.t0", "r1.t0", "shared.t0", "shared.count"} <= set(manifest.tensors) | set(
            manifest.values
        )
        assert len(manifest.tensors["shared.t0"].chunks) == 1  # the replicas' one copy


def _rank_state(rank: int, step: int) -> dict[str, Any]:
    return {**_state(10 * step + rank, f"r{rank}."), **_state(step, "shared.", tensors=8)}


def ranks(rank: int, world: int, args: dict[str, Any]) -> None:
    """One rank: save step 1 blocking and step 2 in process mode, then restore both into blank
    states; records the key counts DCP got and whether each restore was bit-exact."""
    flat_state.FLAT_MIN_KEYS = args["least"]
    seen: dict[str, list[int]] = {"save": [], "load": []}
    checkpointer.for_save = _spy(seen["save"], for_save)  # type: ignore[assignment]
    checkpointer.for_load = _spy(seen["load"], for_load)  # type: ignore[assignment]
    restored = []
    with CheckpointManager(
        args["uri"], async_save=True, async_mode="process", preemption=False, keep_last=None
    ) as mgr:
        mgr.save(1, _rank_state(rank, 1), blocking=True)
        mgr.save(2, _rank_state(rank, 2))
        mgr.wait()
        for step in (1, 2):
            state = _blank(_rank_state(rank, step))
            mgr.restore(state, step)
            try:
                assert_equal(state, _rank_state(rank, step))
                restored.append(True)
            except AssertionError:
                restored.append(False)
    result = {**seen, "restored": restored}
    (Path(args["out"]) / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    scenario, rank, world, port, raw = sys.argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    {"ranks": ranks}[scenario](int(rank), int(world), json.loads(raw))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
