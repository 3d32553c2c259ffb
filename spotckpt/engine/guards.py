"""Checks that refuse a save before its commit point: replica agreement and the health gate.

A CRC32C proves the bytes read are the bytes written, not that the bytes written were right. Two
guards look at the state itself, inside DCP's own planning, so a refused save writes nothing:

- Replica agreement (`replica_check`). DCP writes an item that several ranks hold under the same
  name and offsets (DDP's parameters, the replicated dimension of HSDP, a tensor replicated in TP)
  once, from one rank. Each rank checksums its own copy of every item of its local plan (CRC32C,
  `Fingerprints`), carried to the coordinator in the plan's ``storage_data`` (no extra
  collective); the coordinator compares the items that several ranks hold
  (`check_replicas`, called from the writer's ``prepare_global_plan``) and refuses the save
  naming the tensor and the ranks of each copy (`ReplicaMismatchError`). A non-tensor value
  (a number, string, bytes, numpy array or scalar, nested list or dict, ...) is also written
  once under a shared name, so it is compared the same way: each rank checksums its canonical
  encoding (`value_digest`: equal values agree whatever objects hold them), in the same report.
  Per-rank state (RNG streams, data-loader positions, a TrainState's step and extras) is saved
  under per-rank names, so it is never compared. ``"sample"`` checks the items of one of
  `SAMPLE_EVERY` name classes per save (every item once in that many saves); ``"off"`` none. A
  job of one rank has no replicas: nothing is computed.
- The health gate (`health_check`): ``"finite"`` refuses a state with a NaN or infinity in a
  floating or complex tensor of any dtype torch has (float8 formats included: `holds_non_finite`
  says how each is checked; integer, bool, bits and quantized dtypes cannot hold either and are
  skipped); a callable receives the state as DCP saves it (Stateful objects already
  replaced by their state dicts) and refuses it by returning False or raising. Any rank's
  refusal fails the save on every rank (`HealthCheckError`).

The checks run where DCP plans: for an asynchronous save that is the background upload, on the
staged copy (what is written), so the training loop does not wait for them. The settings' values
(`ReplicaCheck`, `HealthCheck`) are declared torch-free in `spotckpt.engine.options`.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from spotckpt.checksum import crc32c
from spotckpt.engine.options import REPLICA_CHECKS, HealthCheck, ReplicaCheck
from spotckpt.engine.packing import PackingSavePlanner, members_of
from spotckpt.errors import (
    HealthCheckError,
    InvalidArgumentError,
    InvalidTypeError,
    ReplicaMismatchError,
)
from spotckpt.format.safetensors_io import tensor_bytes

SAMPLE_EVERY = 8
"""``replica_check="sample"`` checks one of this many classes of items per save, in turn."""
Fingerprints = dict[str, int]
"""One rank's checksums of its items (tensors and values), by item name (``fqn`` or
``fqn@offsets``)."""


@dataclass(frozen=True)
class Guard:
    """What a save checks before its commit point (see the module docstring)."""

    step: int
    replica_check: ReplicaCheck = "off"
    health_check: str | HealthCheck | None = None
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.replica_check not in REPLICA_CHECKS:
            raise InvalidArgumentError(
                f"replica_check must be one of {REPLICA_CHECKS}, got {self.replica_check!r}"
            )
        health = self.health_check
        if not (health is None or health == "finite" or callable(health)):
            raise InvalidArgumentError(
                f'health_check must be "finite", a callable or None, got {health!r}'
            )

    @property
    def active(self) -> bool:
        """Whether the save checks anything at all."""
        return self.compares_replicas or self.health_check is not None

    @property
    def compares_replicas(self) -> bool:
        """Whether ranks checksum their items (only several ranks can hold replicas)."""
        return self.replica_check != "off" and self.world_size > 1

    def selects(self, name: str) -> bool:
        """Whether this save compares the item `name` (all of them, or this save's sample)."""
        if self.replica_check == "all":
            return True
        return crc32c(name.encode()) % SAMPLE_EVERY == self.step % SAMPLE_EVERY

    def check_health(self, state_dict: dict[str, Any]) -> None:
        """HealthCheckError when the gate refuses `state_dict`."""
        if self.health_check is None:
            return
        if self.health_check == "finite":
            bad = _non_finite(state_dict)
            if bad is not None:
                raise HealthCheckError(
                    f'health_check="finite": tensor {bad!r} holds NaN or infinite values; the '
                    f"save of step {self.step} is refused"
                )
            return
        check = self.health_check
        assert callable(check)
        try:
            verdict = check(state_dict)
        except Exception as error:
            raise HealthCheckError(
                f"health_check {_name(check)} refused the save of step {self.step}: "
                f"{type(error).__name__}: {error}"
            ) from None
        if verdict is False:
            raise HealthCheckError(
                f"health_check {_name(check)} returned False: the save of step {self.step} is "
                "refused"
            )

    def fingerprints(self, planner: Any, plan: SavePlan) -> Fingerprints:
        """This rank's CRC32C of each item of `plan` that this save compares: a tensor's bytes (a
        pack's members each on their own, so that a mismatch names the tensor), a non-tensor
        value's canonical encoding (`value_digest`)."""
        found: Fingerprints = {}
        for item in plan.items:
            name = item_name(item)
            if not self.selects(name):
                continue
            if item.type == WriteItemType.BYTE_IO:  # a value (per-rank state has per-rank names)
                found[name] = value_digest(planner.lookup_object(item.index))
                continue
            data = tensor_bytes(_cpu(planner.resolve_data(item)))
            members = members_of(planner, item.index.fqn)
            if members is None:
                found[name] = crc32c(data)
                continue
            for member in members:
                found[member.fqn] = crc32c(data[member.offset : member.offset + member.nbytes])
        return found


def item_name(item: WriteItem) -> str:
    """A write item's name: its fqn, and its chunk's offsets when not at the origin."""
    offsets = item.tensor_data.chunk.offsets if item.tensor_data else ()
    if any(offsets):
        return f"{item.index.fqn}@{','.join(map(str, offsets))}"
    return item.index.fqn


def check_replicas(step: int, reports: list[Any]) -> None:
    """On the coordinator: ReplicaMismatchError naming the first item (tensor or value) whose
    copies on several ranks differ, with the ranks of each copy (the ranks holding a minority copy
    first)."""
    by_item: dict[str, dict[int, list[int]]] = {}
    for rank, report in enumerate(reports):
        if not isinstance(report, Mapping):
            continue
        for name, crc in report.items():
            by_item.setdefault(name, {}).setdefault(crc, []).append(rank)
    disagreeing = sorted(name for name, copies in by_item.items() if len(copies) > 1)
    if not disagreeing:
        return
    name = disagreeing[0]
    copies = sorted(by_item[name].values(), key=lambda ranks: (len(ranks), ranks))
    described = "; ".join(f"rank(s) {ranks} hold one copy" for ranks in copies)
    more = f" ({len(disagreeing) - 1} more items disagree)" if len(disagreeing) > 1 else ""
    raise ReplicaMismatchError(
        f"replicas of {name!r} disagree before the commit of step {step}: {described}"
        f"{more}; nothing was committed. Ranks {copies[0]} hold the rarest copy: suspect their "
        "host (silent data corruption) and drain it, or look for training that diverged"
    )


def value_digest(value: Any) -> int:
    """CRC32C of the canonical encoding of a non-tensor value (`_canonical`), which ranks compare
    like a tensor's bytes: equal values give one digest whichever objects hold them (a string
    shared or repeated, a set in another hash order), values that restore differently differ."""
    return crc32c(_canonical(value, ()))


def _canonical(value: Any, open_ids: tuple[int, ...]) -> bytes:
    """`value` as bytes that depend on nothing but what it restores as: its exact type, then for
    an atom its exact bits, a sequence its items in order, a mapping or set its entries sorted by
    their own encoding, a tensor its dtype, shape and bytes (numpy values are stored as tensors),
    and any other object what pickle stores of it (its ``__reduce_ex__``), encoded alike."""
    kind = type(value)
    tag = f"{kind.__module__}.{kind.__qualname__}"
    atom = _ATOMS.get(kind)
    if atom is not None:
        return _frame(tag, atom(value))
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        shape = f"{local.dtype}{tuple(local.shape)}".encode()
        return _frame(tag, shape + crc32c(tensor_bytes(_cpu(local))).to_bytes(4, "big"))
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return _frame("global", f"{value.__module__}.{value.__qualname__}".encode())
    if id(value) in open_ids:  # a container that holds itself: where its first copy opened
        return _frame("cycle", str(open_ids.index(id(value))).encode())
    inner = (*open_ids, id(value))
    if isinstance(value, Mapping):
        entries = [_canonical(k, inner) + _canonical(v, inner) for k, v in value.items()]
        return _frame(tag, b"".join(sorted(entries)))
    if isinstance(value, (set, frozenset)):
        return _frame(tag, b"".join(sorted(_canonical(v, inner) for v in value)))
    if isinstance(value, (list, tuple)):
        return _frame(tag, b"".join(_canonical(v, inner) for v in value))
    reduced = value.__reduce_ex__(4)
    if isinstance(reduced, str):  # stored by name (a torch.dtype, an Enum member, ...)
        return _frame(tag, reduced.encode())
    parts = [list(part) if i >= 3 and part is not None else part for i, part in enumerate(reduced)]
    return _frame(tag, _canonical(tuple(parts), inner))


def _frame(tag: str, payload: bytes) -> bytes:
    return tag.encode() + b"\0" + len(payload).to_bytes(8, "big") + payload


_ATOMS: dict[type, Callable[[Any], bytes]] = {
    type(None): lambda _: b"",
    bool: lambda v: b"1" if v else b"0",
    int: lambda v: str(v).encode(),
    float: lambda v: struct.pack("<d", v),
    complex: lambda v: struct.pack("<dd", v.real, v.imag),
    str: lambda v: v.encode("utf-8", "surrogatepass"),
    bytes: bytes,
    bytearray: bytes,
}
"""The exact bits of each atom type's values, by exact type."""


class _Guarded:
    """DCP save planning plus the guards: the health gate on the state as DCP saves it, then
    this rank's fingerprints in its local plan's ``storage_data``."""

    guard: Guard

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.guard.check_health(state_dict)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)  # type: ignore[misc]

    def create_local_plan(self) -> SavePlan:
        plan: SavePlan = super().create_local_plan()  # type: ignore[misc]
        if not self.guard.compares_replicas:
            return plan
        return dataclasses.replace(plan, storage_data=self.guard.fingerprints(self, plan))


class GuardedSavePlanner(_Guarded, DefaultSavePlanner):
    """DCP's default save planner with `Guard`'s checks."""

    def __init__(self, guard: Guard) -> None:
        super().__init__()
        self.guard = guard


class GuardedPackingSavePlanner(_Guarded, PackingSavePlanner):
    """`PackingSavePlanner` with `Guard`'s checks."""

    def __init__(self, guard: Guard) -> None:
        super().__init__()
        self.guard = guard


def _non_finite(state_dict: dict[str, Any]) -> str | None:
    """The name of the first tensor of `state_dict` holding a NaN or infinity."""
    for path, leaf in _named_tensors(state_dict):
        local = leaf.to_local() if hasattr(leaf, "to_local") else leaf
        if holds_non_finite(local.detach()):
            return path
    return None


_SUMMED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Floating dtypes that torch sums on every device: checked with one reduction first."""
FINITE_FLOATS = frozenset(
    dtype for dtype in (getattr(torch, "float4_e2m1fn_x2", None),) if dtype is not None
)
"""Floating dtypes with no encoding of NaN or infinity (and no arithmetic in torch): skipped."""
UPCAST_PIECE = 1 << 22
"""Elements of a narrower float (float8 and the like) converted to float32 at a time (16 MiB)."""


def holds_non_finite(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds a NaN or an infinity, for every dtype torch has: a complex tensor
    as its real and imaginary parts; a floating one with one sum first (memory bandwidth) when
    torch sums its dtype, else (float8 formats) converted to float32 in pieces of
    `UPCAST_PIECE` elements, which holds every value of a narrower float, NaN and infinities
    included. Integers, bool, bits, quantized integers and `FINITE_FLOATS` hold neither."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if not tensor.is_floating_point() or tensor.dtype in FINITE_FLOATS or not tensor.numel():
        return False
    if tensor.dtype in _SUMMED:
        # The exact check only when the sum is not finite (a NaN or infinity, or an overflow
        # of the sum itself).
        return not math.isfinite(float(tensor.sum())) and not bool(torch.isfinite(tensor).all())
    return any(not bool(torch.isfinite(piece.float()).all()) for piece in _pieces(tensor))


def _pieces(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of `tensor` that together cover it, of at most `UPCAST_PIECE` elements each (or
    one innermost row, when a row is longer), with no copy."""
    if tensor.numel() <= UPCAST_PIECE or tensor.dim() == 0:
        yield tensor
        return
    row = tensor.numel() // tensor.shape[0]
    if tensor.dim() == 1 or row <= UPCAST_PIECE:
        yield from tensor.split(max(1, UPCAST_PIECE // row))
        return
    for inner in tensor:
        yield from _pieces(inner)


def _named_tensors(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    if isinstance(state, Mapping):
        return [
            pair
            for key, value in state.items()
            for pair in _named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
        ]
    if isinstance(state, (list, tuple)):
        return [
            pair for i, value in enumerate(state) for pair in _named_tensors(value, f"{prefix}.{i}")
        ]
    return []


def _name(check: Callable[..., Any]) -> str:
    return getattr(check, "__qualname__", None) or type(check).__name__


def _cpu(data: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise InvalidTypeError(f"DCP resolved a tensor item to {type(data).__name__}")
    return data.detach().cpu() if data.device.type != "cpu" else data.detach()
