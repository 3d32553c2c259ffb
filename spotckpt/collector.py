"""Pausing Python's cyclic garbage collector while a save or a restore runs in the caller.

A save or restore of a state with many tensors allocates hundreds of thousands of small objects
(DCP's plans, write items, manifest records). Each allocation burst triggers the cyclic
collector, and its full collections walk every live object of the process, the training state
included: measured on 20,000 small tensors, that was about half of a save's and of a restore's
time. Reference counting still frees everything acyclic while the collector is paused, and the
pause covers only the time the caller is blocked in spotckpt anyway (never a background upload),
so the process's garbage is collected as before once the call returns.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector inside the block; restore its state afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
