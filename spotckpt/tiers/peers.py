"""`Peers`: the collectives of one fast-tier operation, which turn a lost peer into a
`PeerLostError` that names it, on every rank.
"""

from __future__ import annotations

from typing import Any

from spotckpt.distributed import Collective, RankProgress
from spotckpt.errors import PeerLostError
from spotckpt.tiers.exchange import Job, Outcome, run_jobs
from spotckpt.tiers.redundancy import Placement


class Peers:
    """The collectives of one tier operation (`what`), with rank markers that name a rank lost
    on the way: a broken connection (gloo's RuntimeError) becomes a `PeerLostError` on every
    rank that meets it, never a raw error."""

    def __init__(
        self,
        rank: int,
        placement: Placement,
        collective: Collective,
        what: str,
        progress: RankProgress,
    ) -> None:
        self.rank = rank
        self.placement = placement
        self.collective = collective
        self.what = what
        self.progress = progress

    def gather(self, value: Any) -> list[Any]:
        """`Collective.gather`, or PeerLostError."""
        try:
            return self.collective.gather(value)
        except RuntimeError as error:
            raise self.lost(error) from None

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """`Collective.broadcast`, or PeerLostError."""
        try:
            return self.collective.broadcast(value, src=src)
        except RuntimeError as error:
            raise self.lost(error) from None

    def walk(self, jobs: list[Job], read: Any, complete: Any) -> Outcome:
        """This rank's part of `jobs` (`run_jobs`), marked done for the lost-rank markers."""
        outcome = run_jobs(jobs, self.rank, self.collective.group, read, complete)
        self.progress.mark_written()
        return outcome

    def check_lost(self, lost: set[int]) -> None:
        """After the walk's outcomes were shared: PeerLostError on every rank if any rank lost
        a peer during its walk; else this rank's marker is no longer needed (cleared)."""
        if lost:
            raise self.lost(None, lost)
        self.progress.clear()

    def lost(self, error: BaseException | None, seen: set[int] | None = None) -> PeerLostError:
        """The error of a lost peer, naming it: from the rank markers (every rank that is still
        there leaves one), else from the connections this rank saw break."""
        silent = self.progress.silent_ranks() if error is not None else None
        ranks = sorted(silent or seen or ())
        named = ", ".join(f"{r} (node {self.placement.node_of(r)})" for r in ranks)
        cause = f" ({str(error).splitlines()[0][:200]})" if error is not None else ""
        return PeerLostError(
            f"{self.what}: rank(s) {named or '(which could not be told)'} left the job (the "
            f"process died or stopped answering){cause}; the process group is broken: restart "
            "the job, which resumes from the newest step that survives"
        )
