"""Sizes, rates and durations as people read them: the one formatting every message uses."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_size(size: float) -> str:
    """A byte count for people: ``0 B``, ``12.3 KiB``, ``1.5 MiB``."""
    index = 0
    while abs(size) >= 1024 and index < len(_UNITS) - 1:
        size /= 1024
        index += 1
    return f"{size:.0f} B" if index == 0 else f"{size:.1f} {_UNITS[index]}"


def human_rate(bytes_per_s: float) -> str:
    """A transfer rate: ``48.2 MiB/s``."""
    return f"{human_size(bytes_per_s)}/s"


def human_duration(seconds: float) -> str:
    """A duration to the second: ``45 s``, ``3 min 20 s``, ``2 h 05 min``."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
