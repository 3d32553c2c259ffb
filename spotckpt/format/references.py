"""References: object keys of a manifest that lie in an earlier step's folder of the same root.

An incremental save (`spotckpt.engine.incremental`) does not upload a chunk whose bytes did not
change; its manifest lists the object that holds them, written by an earlier step, under a key
relative to the root: ``step-000000007/a-<attempt>/r00000-000.safetensors``. Every other object key
of a manifest is relative to its own step folder and starts with the attempt folder (``a-``), so
the two never collide. A reference is valid only in a manifest whose format names the
``references`` feature, only into the canonical folder of a strictly earlier step (no cycles: a
step never references itself or a later one), and only into an attempt folder of that step (never
its manifest, a quarantine record or anything else); `check_key` has already refused ``..``,
schemes and empty segments.
"""

from __future__ import annotations

import re

from spotckpt.errors import ManifestError

FEATURE = "references"
"""The manifest feature name (`spotckpt.format.features`) of a manifest that holds references."""

_REFERENCE = re.compile(r"step-([0-9]{9,19})/a-[^/]+/.+")
_STEP_DIGITS = 9


def is_reference(key: str) -> bool:
    """Whether an object key of a manifest names an object in an earlier step's folder."""
    return key.startswith("step-")


def referenced_step(key: str, step: int) -> int:
    """The step whose folder holds referenced object `key` of step `step`'s manifest;
    ManifestError unless it is a canonical, strictly earlier step's attempt folder."""
    match = _REFERENCE.fullmatch(key)
    if match is None or match.group(1) != f"{int(match.group(1)):0{_STEP_DIGITS}d}":
        raise ManifestError(
            f"object {key!r} is neither in this step's folder nor in an attempt folder of an "
            "earlier step of the same root"
        )
    earlier = int(match.group(1))
    if earlier >= step:
        raise ManifestError(
            f"object {key!r} of step {step} references step {earlier}, which is not earlier: a "
            "step may only reference an earlier step's objects (no cycles)"
        )
    return earlier


def object_path(folder: str, key: str) -> str:
    """The key relative to the root of a manifest's object `key`, for the step in `folder`."""
    return key if is_reference(key) else f"{folder}/{key}"


def attempt_of(key: str) -> str:
    """The attempt folder (``step-N/a-<id>``) that holds referenced object `key`."""
    folder, _slash, rest = key.partition("/")
    return f"{folder}/{rest.partition('/')[0]}"
