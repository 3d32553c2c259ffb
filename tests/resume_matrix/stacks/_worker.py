"""What every resume-matrix stack worker shares: the ``--describe`` answer, the case, the files
it writes, the state digests and the one pause (the contract is in ../harness.py).

Importing this module imports no torch, so that ``--describe`` stays fast; `sha` imports it
when first called.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

PAUSE_LIMIT_S = 300.0
HERE = Path(__file__).resolve().parent

# The loader set-ups of the core stacks (see _common.build_loader): those that give every rank
# the same batches, those that differ by rank, and a plain shuffled DataLoader, which
# `TrainState` must refuse.
SHARED_SEED_LOADERS = (
    "stateful",
    "stateful-nogen",
    "stateful-torch-sampler",
    "stateful-augment",
    "resumable",
    "resumable-augment",
)
PER_RANK_LOADERS = ("distributed", "per-rank-seed")
REFUSED_LOADER = "shuffle-plain"


def serve(description: dict[str, Any], run: Callable[[dict[str, Any]], int]) -> int:
    """A stack's ``main``: print `description` for ``--describe``, else run ``MATRIX_CASE``.

    Before running, this folder moves to the end of the import path: the stacks are named after
    the frameworks they drive (``lightning``, ``accelerate``, ``torchtitan``) and would shadow
    them, while their helpers (``_frameworks``, ``_common``) must stay importable.
    """
    if sys.argv[1:] == ["--describe"]:
        print(json.dumps(description))
        return 0
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != HERE]
    sys.path.append(str(HERE))
    return run(json.loads(os.environ["MATRIX_CASE"]))


def rank() -> int:
    """This process's rank as the launcher set it (0 in a single-process stack)."""
    return int(os.environ.get("RANK", "0"))


def write_json(path: Path, record: Any) -> None:
    """Write `record` as JSON, atomically: the harness polls these files and must never read
    half of one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(record, sort_keys=True))
    os.replace(temporary, path)


def sha(value: Any) -> str:
    """A digest of one state entry: a tensor's dtype, shape and bytes (a sharded tensor whole),
    anything else by its ``repr``."""
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensor = tensor.cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        head = f"{tensor.dtype}{list(tensor.shape)}".encode()
        return hashlib.sha256(head + raw).hexdigest()
    return hashlib.sha256(repr(value).encode()).hexdigest()


class Pause:
    """The run's one pause: armed by the restore (only when it restored a step before K), held
    at the first point of its kind at step K or later (exactly K for `exact` kinds) until this
    process is preempted, at most `PAUSE_LIMIT_S`."""

    def __init__(
        self,
        spec: dict[str, Any] | None,
        out: Path,
        rank: int,
        preempted: Callable[[], bool],
        exact: Collection[str] = (),
    ) -> None:
        self.kind = spec["kind"] if spec else None
        self.at = int(spec["at"]) if spec else 0
        self.out = out
        self.rank = rank
        self.preempted = preempted
        self.exact = exact
        self.armed = False

    def arm(self, restored: int | None) -> None:
        """Called once, after the restore (`restored` is its step, or None)."""
        self.armed = self.kind is not None and (restored is None or restored < self.at)

    def hold(self, kind: str, step: int) -> bool:
        """Pause here if this is the point; True when the process was preempted meanwhile."""
        if not self.armed or kind != self.kind or step < self.at:
            return False
        if kind in self.exact and step != self.at:
            return False
        self.armed = False
        marker = {"step": step, "kind": kind, "pid": os.getpid(), "pgid": os.getpgrp()}
        write_json(self.out / f"paused-rank{self.rank}", marker)
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while not self.preempted() and time.monotonic() < deadline:
            time.sleep(0.01)  # signal handlers run between these waits
        return self.preempted()
