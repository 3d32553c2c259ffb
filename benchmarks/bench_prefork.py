"""Imported last by the fork server, after torch and the clients: freeze its heap.

Without this, the first full garbage collection in each forked child walks (and so writes to)
every object inherited from the fork server, copying hundreds of MiB of pages: a third of a
second per child, and noise in the measured peak memory. ``gc.freeze`` moves those objects out
of the collector's reach (what pre-forking servers do).
"""

from __future__ import annotations

import gc

gc.collect()
gc.freeze()
