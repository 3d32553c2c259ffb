"""The engine's options that users set, declared once and torch-free: `replica_check` and
`health_check` (the guards, `spotckpt.engine.guards`) and `async_mode` (where an asynchronous
save uploads, `spotckpt.engine.checkpointer`).

`spotckpt.config` annotates its settings with these types and checks values against them, so
that the engine and the settings name the same values without config importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

ReplicaCheck = Literal["all", "sample", "off"]
"""Which items that several ranks hold a save compares across them (see `SAMPLE_EVERY` in
`spotckpt.engine.guards`)."""
REPLICA_CHECKS: tuple[str, ...] = get_args(ReplicaCheck)

HealthCheckName = Literal["finite"]
"""The health gate a file or the environment can name: no NaN or infinity in floating tensors."""
HealthCheck = Callable[[dict[str, Any]], Any]
"""A callable health gate: receives the state; returning False (or raising) refuses the save."""

AsyncMode = Literal["thread", "process"]
"""Where an asynchronous save's upload runs: a background thread, or DCP's upload process."""
