"""`StepRemoval`: carries out the retention rule (`spotckpt.policy.RetentionPolicy`) on a
checkpoint root: the job's retention after each commit (`spotckpt.catalog.Catalog.retire`), a
requested deletion (`Catalog.delete_step`) and gc's (`spotckpt.gc`) all delete through
`StepRemoval.remove_steps` and `may_delete_key`, manifests first, so no checkpoint is ever
half-visible.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from spotckpt.errors import CheckpointError, NoCheckpointError
from spotckpt.layout import (
    ATTEMPT_PREFIX,
    STEP_PREFIX,
    manifest_key,
    parse_step_folder,
    step_folder,
)
from spotckpt.policy import RetentionDecision, RetentionPolicy, StepReading
from spotckpt.step_readings import StepReadings
from spotckpt.storage.base import ObjectInfo, ObjectStore

log = logging.getLogger("spotckpt")

RETIRE_FOLDER_LISTINGS = 16
"""Up to this many retired folders, `Catalog.retire` lists each on its own."""


def may_delete_key(key: str, decision: RetentionDecision) -> bool:
    """Whether the object `key` (relative to the root, inside a step folder) may be deleted
    under `decision`: an attempt folder's object as `RetentionDecision.may_delete` says, any
    other object of a step folder unless its step's objects are held back."""
    folder, _, rest = key.partition("/")
    step = parse_step_folder(folder)
    if step is None:
        return False
    head, slash, _tail = rest.partition("/")
    if slash and head.startswith(ATTEMPT_PREFIX):
        return decision.may_delete(f"{folder}/{head}", step)
    return decision.holds_back(step) is None


class StepRemoval:
    """Deletes committed steps of the root of `store` under the retention rule, from what
    `readings` reads; `listed(prefix)` lists the keys spotckpt may touch, and `reported` holds
    what was warned about once already (shared with the catalog)."""

    def __init__(
        self,
        store: ObjectStore,
        readings: StepReadings,
        listed: Callable[[str], Iterable[ObjectInfo]],
        reported: set[str],
    ) -> None:
        self.store = store
        self._readings = readings
        self._listed = listed
        self._reported = reported

    @property
    def uri(self) -> str:
        """The root's URI."""
        return self.store.uri

    def delete_step(self, step: int, *, newest: int | None = None) -> None:
        """Delete a committed checkpoint on request, manifest first (never half-visible), under
        the retention rule (`spotckpt.policy`): the objects that other steps need outlive it.

        Refuses the newest readable committed step (`newest`, if the caller knows it, is taken
        as the newest step). An unreadable step may be deleted this way: it is an explicit
        request.
        """
        readings = self._readings.read()
        if newest is None:
            readable = [r.step for r in readings if r.readable]
            newest = max(readable) if readable else None
        mine = [r for r in readings if r.step == step]
        if not mine:
            raise NoCheckpointError(f"step {step} has no committed checkpoint at {self.uri}")
        if newest is not None and step >= newest and mine[0].readable:
            raise CheckpointError(
                f"refusing to delete step {step}: it is the newest committed checkpoint at "
                f"{self.uri}"
            )
        others = RetentionPolicy(None).decide(r for r in readings if r.step != step)
        self.remove_steps([step], others, mine)

    def retire(self, keep_last: int) -> list[int]:
        """Delete committed checkpoints beyond the newest `keep_last` readable ones under the
        retention rule (`spotckpt.policy`); returns their steps.

        Every retired manifest goes first (no checkpoint is ever half-visible), then the objects
        of the retired step folders that no kept step needs, and the folders of earlier steps
        that only the retired ones still needed; nothing else: no other folder, look-alike or
        event. An unreadable step is left alone, with a warning. Cost: the step listing, a GET
        of each manifest not read before by this catalog (`read_steps`), then one listing per
        retired folder or, when more than `RETIRE_FOLDER_LISTINGS` retire at once, one listing
        that stops past the last of them.
        """
        readings = self._readings.read()
        decision = RetentionPolicy(keep_last).decide(readings)
        for reading in readings:
            if not reading.readable:
                self._report_unreadable(reading, decision)
        retired = [r for r in readings if r.step in decision.retired]
        self.remove_steps(list(decision.retired), decision, retired)
        return list(decision.retired)

    def remove_steps(
        self, steps: list[int], decision: RetentionDecision, readings: list[StepReading]
    ) -> None:
        """Delete the manifests of `steps`, then the objects of their folders that `decision`
        (`spotckpt.policy`) lets go, then the folders of other steps that only they needed
        (their `readings`; gc passes none and collects those folders itself)."""
        if not steps:
            return
        self._readings.forget(steps)
        self.store.delete_many([manifest_key(step) for step in steps])
        keys = self._folder_keys({step_folder(s) for s in steps})
        self.store.delete_many([k for k in keys if may_delete_key(k, decision)])
        released = {f for r in readings for f in r.needs or ()} - decision.needed
        going = set(steps)
        for folder in sorted(released):
            step = parse_step_folder(folder.partition("/")[0])
            if step is None or step in going or not decision.may_delete(folder, step):
                continue
            self.store.delete_many([info.key for info in self._listed(f"{folder}/")])

    def _report_unreadable(self, reading: StepReading, decision: RetentionDecision) -> None:
        """Warn, once per step, that retention leaves an unreadable step alone."""
        if f"unreadable {reading.step}" in self._reported:
            return
        self._reported.add(f"unreadable {reading.step}")
        log.warning(
            "retention leaves checkpoint step %d under %s alone: its manifest cannot be read "
            "(%s). It takes no slot of keep_last, and neither its objects nor those of older "
            "steps (%s) are deleted while it is there; `spotckpt gc --delete-unreadable` "
            "removes it",
            reading.step,
            self.uri,
            reading.problem,
            "none older" if decision.shield is None else f"before step {decision.shield}",
        )

    def _folder_keys(self, folders: set[str]) -> list[str]:
        """Every key under the given step folders (``<folder>/...``), from as few listings as
        `retire` describes."""
        if len(folders) <= RETIRE_FOLDER_LISTINGS:
            return [info.key for f in sorted(folders) for info in self._listed(f"{f}/")]
        end = f"{max(folders)}0"  # "0" follows "/": past every key of the last folder
        keys = []
        for info in self._listed(STEP_PREFIX):
            if info.key >= end:
                break
            folder, slash, _rest = info.key.partition("/")
            if slash and folder in folders:
                keys.append(info.key)
        return keys
