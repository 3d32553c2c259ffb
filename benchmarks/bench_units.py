"""Plain data shared by the orchestrator and the children (no torch: the parent stays light)."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
REGION = "us-east-1"
S3_METHODS = (
    "spotckpt",
    "dcp_fsspec",
    "torch_save_boto3",
    "s3torchconnector",
    "raw_boto3",
    "raw_boto3_single",
)
"""The ways of checkpointing to S3 that every run measures, in report order."""


VARIED_SEED = 63
"""Seed of the `varied` state's sizes: its 20,000 tensors come to 890.9 MiB (issue 48's ~891)."""
VARIED_MIN_ELEMENTS = 256  # 1 KiB of float32
VARIED_MAX_ELEMENTS = 65536  # 256 KiB of float32


def varied_elements(count: int) -> list[int]:
    """Element counts of the `varied` state's float32 tensors: log-uniform over 1-256 KiB.

    Drawn from a fixed seed with the standard library, so the orchestrator (no torch) and every
    child agree; a smaller count is the first tensors of the full shape, same distribution.
    """
    draw = random.Random(VARIED_SEED)
    low, high = math.log(VARIED_MIN_ELEMENTS), math.log(VARIED_MAX_ELEMENTS)
    return [round(math.exp(draw.uniform(low, high))) for _ in range(count)]


@dataclass
class StateSpec:
    """A synthetic state dict: `large` (big float32 tensors, of `tensor_bytes` each when set),
    `small` (many 4 KiB ones) or `varied` (`count` tensors of 1-256 KiB, `varied_elements`)."""

    kind: str
    size_bytes: int = 0
    count: int = 0
    tensor_bytes: int = 0

    @property
    def label(self) -> str:
        if self.kind == "small":
            return f"small-{self.count}"
        if self.kind == "varied":
            return f"varied-{self.count}"
        if self.tensor_bytes:
            count = self.size_bytes // self.tensor_bytes
            return f"large-{count}x{_size_label(self.tensor_bytes)}"
        return f"large-{_size_label(self.size_bytes)}"

    @property
    def approx_bytes(self) -> int:
        """The state's size in bytes (exact for `large` and `varied`)."""
        if self.kind == "small":
            return self.count * 4096
        if self.kind == "varied":
            return 4 * sum(varied_elements(self.count))
        return self.size_bytes


def _size_label(size: int) -> str:
    return f"{size // GIB}GiB" if size % GIB == 0 else f"{size // MIB}MiB"


@dataclass
class Unit:
    """One method, one operation, one state, one store; what a child process runs."""

    uid: str
    group: str
    server: str
    method: str
    op: str
    state: StateSpec
    reps: int
    endpoint: str = ""
    bucket: str = ""
    prefix: str = ""
    workdir: str = ""
    part_size: int = 16 * MIB
    concurrency: int = 8
    timeout_s: float = 600.0
    location: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rep:
    """One repetition's measurements."""

    seconds: float
    cpu_s: float
    peak_extra_bytes: int
    rss_before_bytes: int
    cpu_user_s: float = 0.0
    cpu_sys_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


def summarize(reps: list[dict[str, Any]]) -> dict[str, float]:
    """Median time and CPU, and the largest peak, over repetitions."""
    if not reps:
        return {}
    return {
        "median_s": statistics.median(r["seconds"] for r in reps),
        "min_s": min(r["seconds"] for r in reps),
        "max_s": max(r["seconds"] for r in reps),
        "cpu_s": statistics.median(r["cpu_s"] for r in reps),
        "cpu_sys_s": statistics.median(r.get("cpu_sys_s", 0.0) for r in reps),
        "peak_extra_bytes": max(r["peak_extra_bytes"] for r in reps),
    }
