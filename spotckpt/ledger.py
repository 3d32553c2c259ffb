"""`Ledger`: what a job records of its saves and restores, in one place for the save and restore
paths: goodput events (`spotckpt.tracker.GoodputTracker`) carrying the requests every rank's store
counted since the last event, and the ``"auto"`` interval every rank adopts from the coordinator.

Every method but `recorded` may be a collective: every rank calls it at the same point.
"""

from __future__ import annotations

import logging

from spotckpt.distributed import Collective
from spotckpt.storage import ObjectStore
from spotckpt.storage.requests import RequestTally, store_tally
from spotckpt.tracker import GoodputTracker

log = logging.getLogger("spotckpt")


class Ledger:
    """What the job records of its saves and restores: goodput events (`GoodputTracker`) with
    the requests every rank's store counted, and the ``"auto"`` interval every rank agrees on."""

    def __init__(self, goodput: GoodputTracker, store: ObjectStore, collective: Collective):
        self.goodput = goodput
        self.store = store
        self.collective = collective
        self._requests_mark = store_tally(store)

    def requests(self, local: bool = False) -> RequestTally | None:
        """The requests every rank's store counted since the last call, summed over the job
        (a collective: every rank calls it at the same point); `local`: this rank's alone (an
        emergency, where no extra collective should stand between the save and the deadline).
        None for a store that does not count. The event's own PUT is counted in it, and
        `recorded` leaves it out of the next."""
        now = store_tally(self.store)
        if now is None or self._requests_mark is None:
            return None
        since, self._requests_mark = now.minus(self._requests_mark), now
        if self.collective.rank == 0:  # the event about to be written: one PUT, counted in it
            since = since.plus(RequestTally(write=1))
        if local or self.collective.group is None:
            return since
        fields = list(since.to_dict().values())
        try:
            totals = self.collective.sum(fields)
        except RuntimeError as error:  # a rank died after the commit: the save stands regardless
            log.warning("request counts of the other ranks are lost (%s): this rank's only", error)
            return since
        return RequestTally.from_dict(dict(zip(since.to_dict(), totals, strict=True)))

    def recorded(self) -> None:
        """After an event with requests was written: its PUT, counted in it already, is left
        out of the next one (see `requests`)."""
        if self._requests_mark is not None and self.collective.rank == 0:
            self._requests_mark = self._requests_mark.plus(RequestTally(write=1))

    def agree_interval(self) -> None:
        """Recompute the ``"auto"`` interval; every rank takes the coordinator's choice."""
        if not self.goodput.auto:
            return
        self.goodput.recompute()
        if self.collective.group is not None:
            self.goodput.adopt(self.collective.broadcast(self.goodput.interval_steps))

    def restored(self, step: int | None, seconds: float) -> None:
        """A restore of `step` (None: nothing to restore) took `seconds`: its event, then the
        ``"auto"`` interval."""
        self.goodput.restored(step, seconds, self.requests())
        self.recorded()
        self.agree_interval()
