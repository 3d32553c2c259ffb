"""`FastTier`: one node's `local_dir` and the job-wide protocol over the nodes' tiers.

A fast save, on every rank (the manager calls these in order; collectives run on `group`):

1. `writer(step)`: each rank's object goes to its node's folder through DCP (`TierWriter`);
   the coordinator builds the manifest but commits nothing.
2. `complete(...)`: the manifest is shared; the copies are made over the process group
   (replicas, or parity pieces for erasure coding); all ranks agree that every copy is written;
   then every node leader writes the tier record and the manifest (create-only, the same
   commit discipline as the bucket) and applies the tier's retention. A step is visible in a
   node's tier only once all copies exist.
3. `drain(...)` (a durable save): each rank streams its own object from its tier to the bucket,
   checking its CRC32C on the way; once all ranks uploaded, the coordinator commits the same
   manifest to the bucket. The state is staged once, for the tier.

A restore (`recover`): node leaders verify what their tier holds (size and CRC32C of every
object) among the steps a `Scope` admits (this job's, as new as the bucket), all ranks share
those reports and their load plans' needs, choose the newest step the union can restore
(`spotckpt.tiers.recovery`), bring each node the objects it lacks from peers or by rebuilding
them from parity, and load it from the node's folder. A step that then fails to load is set
aside on every node (`set_aside`) and the next one chosen.

Start-up: every rank shares its node id and the id of the folder it sees (`folder_id`); ranks
that claim one node id on different machines are refused (`check_one_folder_per_node`), since
their node's steps would be split between the machines and never restored whole.

Failures: a rank's own trouble (a full disk, an unreadable file, a damaged record) is shared
through the collectives, so every rank reaches the same verdict; a peer lost in the middle (its
connection broke) is a `PeerLostError` naming it, on every rank. The tier record and the
manifest are written to a temporary name, fsynced, renamed and their folder fsynced; objects are
not fsynced (a restore checks their CRC32Cs). Each node's folder holds this job's steps only:
retention (`spotckpt.tiers.retention`) removes any other step folder (unreadable, uncommitted,
another job's, stale), never the one a save is writing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spotckpt.catalog import Catalog
from spotckpt.checksum import crc32c
from spotckpt.distributed import THIS_RANK, Collective, RankProgress
from spotckpt.engine.cancel import CancellableWriter, Cancellation
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.errors import (
    AlreadyExistsError,
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    SaveCancelledError,
    TierSaveError,
)
from spotckpt.format.manifest import Manifest, ObjectRecord
from spotckpt.format.signing import Keyring
from spotckpt.layout import (
    MANIFEST_NAME,
    STEP_PREFIX,
    parity_object_key,
    parse_step_folder,
    step_folder,
    step_key,
    tier_record_key,
)
from spotckpt.policy import RetentionPolicy
from spotckpt.redundancy import Redundancy
from spotckpt.storage.base import ObjectStore
from spotckpt.storage.local import LocalStore
from spotckpt.tiers.copies import Sink, complete_into, parity_jobs, parity_records
from spotckpt.tiers.exchange import Job, Piece, pieces_of
from spotckpt.tiers.folder import folder_id, resolve_local_dir
from spotckpt.tiers.node import NodeIdentity, check_one_folder_per_node, node_identity
from spotckpt.tiers.peers import Peers
from spotckpt.tiers.record import GroupRecord, ParityRecord, TierRecord
from spotckpt.tiers.recovery import (
    Choice,
    Copy,
    HeldStep,
    NodeReport,
    Ranges,
    Scope,
    choose_step,
    restore_jobs,
)
from spotckpt.tiers.redundancy import Placement
from spotckpt.tiers.retention import TierReadings, read_record

log = logging.getLogger("spotckpt")
SPACE_MARGIN = 1.10  # free space wanted beyond the estimate of what a fast save writes


class TierWriter(ObjectStoreWriter):
    """`ObjectStoreWriter` into a node's tier: `finish` builds the manifest (`built`) and
    commits nothing; `FastTier.complete` commits it on every node once the copies exist. A
    step already in the tier is a stale cache entry, not a commit to protect."""

    built: Manifest | None = None

    def check_step_free(self) -> None:
        return None

    def finish(self, metadata: Any, results: Any) -> None:
        self.built = self.build_manifest(metadata, results)


@dataclass(frozen=True)
class FastSave:
    """A fast save after its copy phase: the manifest (and its encoding, what the bucket's
    commit writes unchanged), and why the copies failed (None: committed in the tier)."""

    manifest: Manifest
    data: bytes
    failure: str | None = None


class FastTier:
    """This node's fast tier and the protocol with the other nodes'; see the module docstring."""

    def __init__(
        self,
        local_dir: str,
        *,
        redundancy: Redundancy,
        keep_last: int,
        collective: Collective,
        prefix_spread: bool = False,
        keyring: Keyring | None = None,
    ) -> None:
        self.rank = collective.rank
        identity, folder, problem = None, None, None
        try:
            identity = node_identity()
            self.root: Path = resolve_local_dir(local_dir, identity.node)
            folder = folder_id(self.root)
        except InvalidArgumentError as error:
            problem = f"rank {self.rank}: {error}"
        # All fail, or none: every rank decides from the same shared facts.
        shared = collective.gather((identity, folder, problem, uuid.uuid4().hex))
        problems = [p for _, _, p, _ in shared if p is not None]
        if problems:
            raise InvalidArgumentError(f"the fast tier cannot start: {'; '.join(problems)}")
        identities = [identity for identity, _, _, _ in shared]
        check_one_folder_per_node(identities, [folder for _, folder, _, _ in shared])
        self.identity: NodeIdentity = identities[self.rank]
        self.token: str = shared[0][3]  # names this tier's rank markers, the same on every rank
        self._operations = 0
        self._unusable: set[int] = set()  # tier steps that failed to load: never chosen again
        self.placement = Placement(redundancy, identities)
        self.redundancy = redundancy
        self.is_leader = self.placement.is_leader(self.rank)
        self.store = LocalStore(self.root, fsync=False)  # objects: checked by CRC32C on restore
        self.catalog = Catalog(LocalStore(self.root, fsync=True))  # records and manifests
        self.keep_last = keep_last
        self.prefix_spread = prefix_spread
        # With any key configured, a tier step's manifest must be signed for the bucket's job and
        # its step, as the bucket's are: a copy on a node's disk is trusted no more than one in
        # the bucket (it is the same bytes when it was written by this job).
        self.keyring = keyring if keyring is not None and keyring.enforcing else None
        whole_here = len(self.placement.node_ranks) == 1
        self.readings = TierReadings(self.catalog, self.keyring, whole_here=whole_here)

    def _peers(self, collective: Collective, what: str) -> Peers:
        """The collectives of one operation, with rank markers of its own (every rank counts
        its operations in the same order, so the names agree)."""
        self._operations += 1
        prefix = f"spotckpt/tier-{self.token}-{self._operations}"
        return Peers(
            self.rank, self.placement, collective, what, RankProgress(prefix, collective.world_size)
        )

    # Saving -----------------------------------------------------------------------------------

    def has_room(self, state_bytes: int) -> bool:
        """Whether this node's disk can take a fast save of `state_bytes` per rank (with copies)."""
        ranks = len(self.placement.node_ranks[self.identity.node])
        wanted = state_bytes * ranks * self.redundancy.storage_factor * SPACE_MARGIN
        return shutil.disk_usage(self.root).free >= wanted

    def survives(self, evicted: Collection[int]) -> bool:
        """Whether a step saved now would still be whole on the nodes that remain once the
        nodes of the `evicted` ranks (those that got a notice) are gone with their disks."""
        return self.placement.survives({self.placement.node_of(rank) for rank in evicted})

    def writer(self, step: int, **options: Any) -> TierWriter:
        """The DCP writer of a fast save of `step` (a stale copy of the step is removed first,
        on every rank: deletes are idempotent, and no rank waits on its leader for them)."""
        self._remove_folder(step)
        return TierWriter(  # one manifest document: the tier shares and re-reads it whole
            self.store,
            step,
            WriterOptions(prefix_spread=self.prefix_spread, index_parts=False, **options),
        )

    def complete(self, step: int, writer: TierWriter, collective: Collective, job: str) -> FastSave:
        """Share the manifest, make the copies, then commit on every node for job `job`.

        A rank's own failure in the copy phase is shared, so every rank returns the same
        `FastSave.failure` and nothing is committed in the tier (its objects stay, for a drain
        to the bucket; `discard` removes them). A lost peer is a PeerLostError on every rank.
        """
        peers = self._peers(collective, f"fast-tier copies of step {step}")
        data = peers.broadcast(writer.encode(writer.built) if writer.built is not None else None)
        if data is None:
            raise TierSaveError(f"fast save of step {step}: the coordinator built no manifest")
        manifest = Manifest.from_json(data, expected_step=step)
        sink = Sink(self.store, step)
        jobs = self._copy_jobs(manifest)
        try:
            outcome = peers.walk(jobs, self._read(step), complete_into(sink))
        finally:
            sink.close()
        failure = None if outcome.failure is None else f"rank {self.rank}: {outcome.failure}"
        records = parity_records(sink, manifest, jobs, self.rank)
        outcomes = peers.gather((failure, outcome.lost, records))
        peers.check_lost({rank for _, lost, _ in outcomes for rank in lost})
        failures = [f for f, _, _ in outcomes if f is not None]
        if failures:
            return FastSave(
                manifest, data, f"fast save of step {step} failed: {'; '.join(failures)}"
            )
        if self.is_leader:
            parity = {record.key: record for _, _, records in outcomes for record in records}
            self._commit(manifest, data, self._record(manifest, parity, job))
        self._retain(job, newest=step)
        return FastSave(manifest, data)

    def _copy_jobs(self, manifest: Manifest) -> list[Job]:
        objects = sorted(manifest.objects.values(), key=lambda r: r.rank)
        if not self.redundancy.erasure:
            return [
                Job(holder, (piece,), Copy(record.key, record.size))
                for record in objects
                for holder in self.placement.replica_holders(record.rank)
                for piece in pieces_of(record.rank, record.key, record.size)
            ]
        jobs = []
        for index, group in enumerate(self._groups(manifest)):
            jobs.extend(parity_jobs(manifest, index, group, self.placement.groups[index].parity))
        return jobs

    def _groups(self, manifest: Manifest) -> list[GroupRecord]:
        """The erasure-coded groups of a save, without parity checksums yet."""
        by_rank = {record.rank: record for record in manifest.objects.values()}
        groups = []
        for index, group in enumerate(self.placement.groups):
            records = [by_rank.get(rank) for rank in group.data]
            block = max((r.size for r in records if r is not None), default=0)
            parity = tuple(
                ParityRecord(parity_object_key(manifest.attempt, index, j), block, 0)
                for j in range(len(group.parity))
            )
            keys = tuple(r.key if r is not None else "" for r in records)
            groups.append(GroupRecord(keys, parity, block))
        return groups

    def _record(self, manifest: Manifest, parity: dict[str, ParityRecord], job: str) -> TierRecord:
        groups: tuple[GroupRecord, ...] = ()
        if self.redundancy.erasure:
            groups = tuple(
                dataclasses.replace(g, parity=tuple(parity[p.key] for p in g.parity))
                for g in self._groups(manifest)
            )
        return TierRecord(manifest.step, manifest.attempt, str(self.redundancy), groups, job)

    def _commit(self, manifest: Manifest, data: bytes, record: TierRecord) -> None:
        """The record, then the manifest (each fsynced, create-only; the same bytes already
        there count as written). A node holds only its share of the objects (its ranks',
        replicas, parity), which every rank has agreed is written, so the manifest's other
        objects are not looked for here (the bucket's commit checks them all). A node that
        cannot write them lacks the step, like a lost node: a warning, and its folder removed
        unless the step is committed there."""
        step = manifest.step
        try:
            self._put_record(step, record.to_json())
            self.catalog.commit_bytes(step, manifest.attempt, data, referenced={})
        except (CheckpointError, OSError) as error:
            log.warning(
                "fast tier: node %s could not commit step %d (%s); the other nodes hold it",
                self.identity.node,
                step,
                error,
                extra=THIS_RANK,
            )
            if self.catalog.committed_attempt(step) != manifest.attempt:
                self._remove_folder(step)

    def _put_record(self, step: int, data: bytes) -> None:
        key = tier_record_key(step)
        try:
            self.catalog.store.put(key, data, create_only=True)
        except AlreadyExistsError:
            if self.store.get(key) != data:
                raise

    def prune(self, job: str) -> None:
        """Before a fast save: keep this job's newest `keep_last` committed steps and delete
        every other step folder of this rank's node (`_retain`), so that stale folders never
        take the room a save needs."""
        self._retain(job)

    def _retain(self, job: str, newest: int | None = None) -> None:
        """Keep `newest` (the step just saved) and this job's newest committed steps before it,
        `keep_last` in all; delete every other step folder of this rank's node: older steps,
        uncommitted ones (a rank whose folder is not its node leader's never commits there),
        another job's, stale newer ones. Every rank runs it (deletes are idempotent); no save
        of this job is writing any other step meanwhile, and `newest` is never touched.
        Which of ours stay is the bucket's retention rule (`spotckpt.policy.RetentionPolicy`)
        over the steps as `TierReadings` reads them, with ``delete_unreadable``: an unreadable
        step takes no slot and goes (`spotckpt.tiers.retention`), as under
        ``gc --delete-unreadable``; a step whose tier record cannot be read goes too."""
        try:
            ours = self.readings.read(job, below=newest)
            room = self.keep_last - (newest is not None)
            policy = RetentionPolicy(room, delete_unreadable=True) if room > 0 else None
            keep = set(policy.decide(ours).kept) if policy is not None else set()
            keep.update([newest] if newest is not None else [])
            for reading in ours:
                if not reading.readable:
                    log.warning(
                        "fast-tier step %d on node %s cannot be read and is removed: %s",
                        reading.step,
                        self.identity.node,
                        reading.problem,
                        extra=THIS_RANK,
                    )
            for step in self._folders():
                if step not in keep:
                    self._remove_folder(step)
        except (CheckpointError, OSError) as error:
            log.warning("fast-tier retention on node %s failed: %s", self.identity.node, error)

    def discard(self, step: int) -> None:
        """Remove this node's folder of a fast save that did not commit in the tier."""
        try:
            self._remove_folder(step)
        except (CheckpointError, OSError) as error:
            log.warning("could not remove fast-tier step %d: %s", step, error, extra=THIS_RANK)

    def drain(
        self,
        manifest: Manifest,
        bucket: Catalog,
        collective: Collective,
        data: bytes,
        cancellation: Cancellation,
    ) -> None:
        """Upload this rank's object from the tier, then commit `manifest` to the bucket.

        A `cancellation` set meanwhile (a notice left the upload no time) stops it on every rank
        with `SaveCancelledError`; the step stays committed in the tier."""
        peers = self._peers(collective, f"upload of step {manifest.step} from the fast tier")
        failure: str | None = None
        stopped = False
        try:
            for record in manifest.objects.values():
                if record.rank == self.rank:
                    self._upload(manifest.step, record, bucket.store, cancellation)
        except (CheckpointError, OSError) as error:
            failure = f"rank {self.rank}: {error}"
            stopped = isinstance(error, SaveCancelledError)
        outcomes = peers.gather((failure, stopped))
        failures = [f for f, _ in outcomes if f is not None]
        if any(cancelled for _, cancelled in outcomes):
            raise SaveCancelledError(
                f"upload of step {manifest.step} from the fast tier cancelled at a preemption "
                "notice; the step stays in the fast tier"
            )
        if failures:
            raise TierSaveError(
                f"upload of step {manifest.step} from the fast tier failed: {'; '.join(failures)}"
            )
        collective.run_on_coordinator(lambda: bucket.commit(manifest, data))

    def _upload(
        self, step: int, record: ObjectRecord, bucket: ObjectStore, cancellation: Cancellation
    ) -> None:
        """Stream one object from the tier to the bucket; refused if its CRC32C changed."""
        crc, key, size, expected = 0, record.key, record.size, record.crc32c
        target = bucket.open_writer(step_key(step, key))
        with CancellableWriter(target, cancellation, step) as writer:  # commits on a clean exit
            for piece in pieces_of(self.rank, key, size):
                data = self.store.get_range(step_key(step, key), piece.offset, piece.length)
                crc = crc32c(data, crc)
                writer.write(data)
            if crc != expected:
                raise CorruptCheckpointError(
                    f"fast-tier copy of {key} changed since it was written (CRC32C {crc:08x}, "
                    f"manifest {expected:08x}); not uploaded"
                )

    # Restoring --------------------------------------------------------------------------------

    def recover(
        self,
        collective: Collective,
        scope: Scope,
        needs: Callable[[Manifest], dict[str, Ranges]],
    ) -> tuple[Manifest, int] | None:
        """Make the newest step of `scope` the tiers can restore whole on this node; None if
        none can (every rank agrees), with the reasons as warnings.

        `needs(manifest)` gives the byte ranges, per object key, that this rank's load plan reads
        (or raises). Returns the manifest to load from `store`, and the bytes moved between
        nodes (job-wide). A lost peer is a PeerLostError on every rank.
        """
        peers = self._peers(collective, "fast-tier restore")
        choice, reports = self._choose(peers, scope)
        if choice is None:
            return None
        mine = self._manifest_of(choice) if self.rank == choice.manifest_source else None
        data = peers.broadcast(mine, src=choice.manifest_source)
        if data is None:
            log.warning("fast-tier restore of step %d: its manifest could not be read", choice.step)
            return None
        manifest = Manifest.from_json(data, expected_step=choice.step)
        failure, wanted = None, {}
        try:
            wanted = needs(manifest)
        except CheckpointError as error:
            failure = f"{type(error).__name__}: {error}"
        shared = peers.gather((failure, wanted))
        if any(f is not None for f, _ in shared):
            log.warning(
                "fast-tier restore of step %d: %s", choice.step, next(f for f, _ in shared if f)
            )
            return None
        moved = self._gather_objects(choice, [w for _, w in shared], reports, peers)
        return (manifest, moved) if moved is not None else None

    def _choose(self, peers: Peers, scope: Scope) -> tuple[Choice | None, list[NodeReport]]:
        """The newest step whose surviving copies are intact, checked lazily: every node lists
        what it holds (by size), and only the step chosen from that is read back for its CRC32Cs;
        when that rules it out, the next candidate is checked, and so on."""
        report = self._inventory(scope) if self.is_leader else None
        reports = [r for r in peers.gather(report) if r is not None]
        checked: set[int] = set()
        while True:
            choice, reasons = choose_step(reports, scope.durable)
            if choice is None or choice.step in checked:
                break
            mine = self._checked(report, choice.step) if report is not None else None
            updates = {r.leader: r for r in peers.gather(mine) if r is not None}
            reports = [updates.get(r.leader, r) for r in reports]
            report = updates.get(self.rank, report)
            checked.add(choice.step)
        for reason in reasons:
            log.warning("%s; trying older copies", reason)
        return choice, reports

    def _checked(self, report: NodeReport, step: int) -> NodeReport:
        """`report` with its holdings of `step` narrowed to the objects whose CRC32C matches."""
        steps = []
        for held in report.steps:
            if held.step == step:
                intact = frozenset(
                    k for k in held.held if self._intact(step, k, held.sizes[k], held.crcs[k])
                )
                for key in sorted(held.held - intact):
                    log.warning(
                        "fast-tier step %d: %s is corrupt on node %s",
                        step,
                        key,
                        report.node,
                        extra=THIS_RANK,
                    )
                held = dataclasses.replace(held, held=intact)
            steps.append(held)
        return dataclasses.replace(report, steps=tuple(steps))

    def _gather_objects(
        self,
        choice: Choice,
        wanted: list[dict[str, Ranges]],
        reports: list[NodeReport],
        peers: Peers,
    ) -> int | None:
        node_needs: dict[int, dict[str, Ranges]] = {}
        for rank, ranges in enumerate(wanted):
            needs = node_needs.setdefault(self.placement.leader(self.placement.node_of(rank)), {})
            for key, spans in ranges.items():
                needs.setdefault(key, []).extend(spans)
        held = {
            r.leader: next((h.held for h in r.steps if h.digest == choice.digest), frozenset())
            for r in reports
        }
        jobs = restore_jobs(choice, node_needs, held)
        sink = Sink(self.store, choice.step)
        try:
            outcome = peers.walk(jobs, self._read(choice.step), complete_into(sink))
        finally:
            sink.close()
        failure = None if outcome.failure is None else f"rank {self.rank}: {outcome.failure}"
        outcomes = peers.gather((failure, outcome.lost, outcome.incomplete, outcome.received))
        peers.check_lost({rank for _, lost, _, _ in outcomes for rank in lost})
        failures = [f for f, _, _, _ in outcomes if f is not None]
        if failures or any(incomplete for _, _, incomplete, _ in outcomes):
            log.warning(
                "fast-tier restore of step %d failed while copying: %s",
                choice.step,
                "; ".join(failures) or "a peer could not serve its bytes",
            )
            return None
        return sum(received for _, _, _, received in outcomes)

    def _manifest_of(self, choice: Choice) -> bytes | None:
        """The chosen step's manifest as this node holds it, if it is still the one reported."""
        try:
            data = self.catalog.manifest_bytes(choice.step)
        except (CheckpointError, OSError) as error:
            log.warning("fast-tier step %d: %s", choice.step, error, extra=THIS_RANK)
            return None
        return data if hashlib.sha256(data).hexdigest() == choice.digest else None

    def _inventory(self, scope: Scope) -> NodeReport:
        """This node's tier steps that `scope` admits and the objects it holds whole (by size;
        `_checked` reads them back for their CRC32Cs), and the steps it found damaged."""
        steps, damaged = [], []
        try:
            committed = self.catalog.steps()
        except (CheckpointError, OSError) as error:
            log.warning("fast tier on node %s unreadable: %s", self.identity.node, error)
            committed = []
        for step in reversed(committed):
            if scope.durable is not None and step < scope.durable:
                break
            if step in self._unusable:
                continue
            try:
                held = self._held_step(step, scope)
            except (CheckpointError, OSError) as error:
                log.warning(
                    "fast-tier step %d on node %s is damaged and not used: %s",
                    step,
                    self.identity.node,
                    error,
                    extra=THIS_RANK,
                )
                damaged.append((step, str(error)))
                continue
            if held is not None:
                steps.append(held)
        return NodeReport(
            self.identity.node, self.identity.zone, self.rank, tuple(steps), tuple(damaged)
        )

    def _held_step(self, step: int, scope: Scope) -> HeldStep | None:
        """What this node holds of `step`; None if `scope` refuses it; raises if it is damaged
        (its manifest is not signed as `keyring` requires, or it or the tier record does not
        parse or does not fit the manifest)."""
        data = self.catalog.manifest_bytes(step)
        if self.keyring is not None:  # a SignatureError: damaged, as the bucket treats it
            self.keyring.check(data, step=step, job=scope.job, what=f"tier step {step}'s manifest")
        manifest = Manifest.from_json(data, expected_step=step)
        record = read_record(self.store, step, manifest.attempt)
        record.check({k: r.size for k, r in manifest.objects.items()})
        refusal = scope.refusal(step, manifest.attempt, record.job)
        if refusal is not None:
            log.info(
                "fast-tier step %d on node %s is not used: %s", step, self.identity.node, refusal
            )
            return None
        expected = {k: (r.size, r.crc32c) for k, r in manifest.objects.items()}
        expected.update({p.key: (p.size, p.crc32c) for g in record.groups for p in g.parity})
        held = frozenset(k for k, (size, _) in expected.items() if self._whole(step, k, size))
        return HeldStep(
            step,
            hashlib.sha256(data).hexdigest(),
            {k: r.size for k, r in manifest.objects.items()},
            held,
            record,
            {k: crc for k, (_, crc) in expected.items()},
            {k: size for k, (size, _) in expected.items()},
        )

    def _whole(self, step: int, key: str, size: int) -> bool:
        info = self.store.head(step_key(step, key))
        return info is not None and info.size == size

    def _intact(self, step: int, key: str, size: int, expected: int) -> bool:
        """Whether the tier's `key` of `step` has `size` bytes whose CRC32C is `expected`."""
        try:
            if not self._whole(step, key, size):
                return False
            crc = 0
            for piece in pieces_of(self.rank, key, size):
                data = self.store.get_range(step_key(step, key), piece.offset, piece.length)
                crc = crc32c(data, crc)
        except (CheckpointError, OSError) as error:
            log.warning("fast-tier step %d: %s unreadable: %s", step, key, error, extra=THIS_RANK)
            return False
        return crc == expected

    def set_aside(self, step: int, reason: str) -> None:
        """Never use tier `step` again: its load failed on every rank (bytes that pass the
        whole-object CRC32C but not the load's block checks), and the next restart must not
        meet it again. Every rank calls it; the node leader moves the step's manifest aside in
        its folder (`Catalog.quarantine`: under ``quarantined-<stamp>/`` with `reason`), so the
        step is no longer committed there and retention removes its folder. A node that cannot
        move it warns; this process still never chooses the step again."""
        self._unusable.add(step)
        if not self.is_leader:
            return
        try:
            self.catalog.quarantine(step, reason)
        except (CheckpointError, OSError) as error:
            log.warning(
                "could not set fast-tier step %d aside on node %s: %s",
                step,
                self.identity.node,
                error,
                extra=THIS_RANK,
            )

    def discard_newer(self, step: int | None) -> None:
        """After a restore of `step` (None: from nothing): newer tier steps are stale; drop them
        (on every rank: deletes are idempotent, and no rank waits on its leader for them)."""
        for folder_step in self._folders():
            if step is None or folder_step > step:
                self._remove_folder(folder_step)

    # Plumbing ---------------------------------------------------------------------------------

    def _read(self, step: int) -> Any:
        def read(piece: Piece) -> bytes:
            return self.store.get_range(step_key(step, piece.key), piece.offset, piece.length)

        return read

    def _folders(self) -> list[int]:
        """Steps with a folder in this node's tier, committed or not, or holding nothing but
        the temporary files of interrupted writes."""
        folders = set(self.store.list_delimited(STEP_PREFIX, "/").prefixes)
        folders.update(u.key.partition("/")[0] + "/" for u in self.store.list_uploads(STEP_PREFIX))
        steps = (parse_step_folder(prefix.removesuffix("/")) for prefix in folders)
        return sorted(step for step in steps if step is not None)

    def _remove_folder(self, step: int) -> None:
        """Delete a tier step, manifest first (never half-visible), then everything else in its
        folder, temporary files of interrupted writes included."""
        folder = step_folder(step)
        self.readings.forget(step)
        self.store.delete_many([f"{folder}/{MANIFEST_NAME}"])
        self.store.delete_many([info.key for info in self.store.list(f"{folder}/")])
        for upload in self.store.list_uploads(f"{folder}/"):
            self.store.abort_upload(upload)


def state_bytes(value: Any) -> int:
    """Bytes of the tensors in a (nested) state dict, local shards only."""
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return int(local.numel() * local.element_size())
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_bytes(v) for v in value)
    return 0
