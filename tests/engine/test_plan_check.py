"""The O(n log n) global-plan check refuses exactly the plans DCP's own check refuses.

Random layouts (1-D sharding, 2-D grids as FSDP x TP makes them, replicated and irregular
chunks, with pieces moved, grown, dropped, doubled or emptied) are judged by both checks; for
every tensor they must agree on each kind of error (out of bounds, overlap, fill).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from spotckpt.engine.plan_check import global_plan_errors

KINDS = ("out of bounds", "overlapping", "invalid fill")


def _kinds(errors: list[str]) -> set[tuple[str, str]]:
    found = set()
    for message in errors:
        key = message.split(" ", 1)[0].removeprefix("key:")
        kinds = [kind for kind in KINDS if kind in message]
        assert len(kinds) == 1, message
        found.add((key, kinds[0]))
    return found


def _cuts(extent: int, pieces: int) -> list[tuple[int, int]]:
    """torch.chunk's pieces of one dimension (trailing ones empty, placed at the end)."""
    rows = -(-extent // pieces)
    return [
        (
            min(i * rows, extent) if min(rows, extent - i * rows) > 0 else extent,
            max(0, min(rows, extent - i * rows)),
        )
        for i in range(pieces)
    ]


def _grid(shape: tuple[int, ...], pieces: tuple[int, ...]) -> list[list[tuple[int, int]]]:
    boxes: list[list[tuple[int, int]]] = [[]]
    for extent, count in zip(shape, pieces, strict=True):
        boxes = [[*box, cut] for box in boxes for cut in _cuts(extent, count)]
    return boxes


def _mutate(rng: random.Random, boxes: list[list[tuple[int, int]]], shape: tuple[int, ...]) -> None:
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        action = rng.choice(["move", "grow", "drop", "double", "empty", "outside", "split"])
        at = rng.randrange(len(boxes))
        d = rng.randrange(len(shape))
        box = [list(p) for p in boxes[at]]
        if action == "move":
            box[d][0] = max(0, box[d][0] + rng.choice([-2, -1, 1, 2]))
        elif action == "grow":
            box[d][1] += rng.choice([1, 2])
        elif action == "drop" and len(boxes) > 1:
            del boxes[at]
            continue
        elif action == "double":
            boxes.append([tuple(p) for p in box])  # type: ignore[misc]
            continue
        elif action == "empty":
            box[d][1] = 0
            box[d][0] = rng.randrange(shape[d] + 1)
        elif action == "outside":
            box[d][0] = shape[d] + rng.choice([0, 1])
            box[d][1] = 1
        elif action == "split" and box[d][1] > 1:
            half = box[d][1] // 2
            other = [list(p) for p in box]
            box[d][1] = half
            other[d] = [other[d][0] + half, other[d][1] - half]
            boxes.append([tuple(p) for p in other])  # type: ignore[misc]
        boxes[at] = [tuple(p) for p in box]  # type: ignore[misc]


def _random_tensor(rng: random.Random) -> tuple[tuple[int, ...], list[list[tuple[int, int]]]]:
    dims = rng.choice([1, 2, 2, 3])
    shape = tuple(rng.randint(1, 9) for _ in range(dims))
    style = rng.choice(["1d", "2d", "replicated", "irregular"])
    if style == "1d":
        pieces = [1] * dims
        pieces[rng.randrange(dims)] = rng.randint(1, 12)
    elif style == "2d" and dims > 1:
        pieces = [1] * dims
        a, b = rng.sample(range(dims), 2)
        pieces[a], pieces[b] = rng.randint(1, 6), rng.randint(1, 4)
    else:
        pieces = [rng.randint(1, 3) for _ in range(dims)]
    boxes = _grid(shape, tuple(pieces))
    if style == "replicated":
        boxes = boxes * rng.randint(1, 3)
    if style == "irregular":
        for _ in range(rng.randint(1, 4)):
            _mutate(rng, boxes, shape)
    _mutate(rng, boxes, shape)
    return shape, boxes


def _metadata(tensors: dict[str, tuple[tuple[int, ...], list[list[tuple[int, int]]]]]) -> Metadata:
    return Metadata(
        {
            fqn: TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size(shape),
                [
                    ChunkStorageMetadata(
                        torch.Size(p[0] for p in box), torch.Size(p[1] for p in box)
                    )
                    for box in boxes
                ],
            )
            for fqn, (shape, boxes) in tensors.items()
        }
    )


@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_dcp_on_random_layouts(seed: int) -> None:
    rng = random.Random(seed)
    tensors = {f"t{i}": _random_tensor(rng) for i in range(400)}
    metadata = _metadata(tensors)
    for ranks in (1, 4):
        plans = [SavePlan([])] * ranks
        ours = _kinds(global_plan_errors(metadata, ranks))
        dcp = _kinds(_validate_global_plan(plans, metadata))
        assert ours == dcp
    kinds = {kind for _, kind in _kinds(global_plan_errors(metadata, 4))}
    assert kinds == set(KINDS), "the random layouts must exercise every kind of error"


def test_valid_fsdp_and_2d_layouts_pass() -> None:
    tensors = {
        "fsdp": ((16, 40), _grid((16, 40), (64, 1))),  # trailing empty shards
        "wide": ((6, 40), _grid((6, 40), (6, 1))),  # sharded along the shorter dimension
        "fsdp_tp": ((12, 20), _grid((12, 20), (4, 3))),
        "scalar_like": ((1,), _grid((1,), (8,))),
    }
    assert global_plan_errors(_metadata(tensors), 8) == []
    assert _validate_global_plan([SavePlan([])] * 8, _metadata(tensors)) == []


def test_an_empty_chunk_inside_another_is_an_overlap_as_in_dcp() -> None:
    tensors = {"t": ((4,), [[(0, 4)], [(2, 0)]])}
    ours = global_plan_errors(_metadata(tensors), 2)
    assert _kinds(ours) == {("t", "overlapping")}
    assert _kinds(_validate_global_plan([SavePlan([])] * 2, _metadata(tensors))) == _kinds(ours)
