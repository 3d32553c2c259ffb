"""What the goodput tests share."""

from __future__ import annotations

from torch import nn


def small_model() -> nn.Module:
    return nn.Linear(4, 2)
