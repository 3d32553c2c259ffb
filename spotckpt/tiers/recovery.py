"""Which fast-tier step the surviving copies can restore, and the jobs that bring each rank's
objects to its node. Pure functions of what every node reported: all ranks compute the same.

A node reports, per step of its tier that its `Scope` lets a restore use (this job's, not older
than the bucket's newest committed step), the manifest's digest and the objects it holds whole
(corrupt copies are left out once the step is chosen and read back for its CRC32Cs), and which
steps it found damaged (a manifest or tier record that does not parse or check). A damaged step,
or one whose nodes disagree on its tier record, is unusable on every node. A step is recoverable
when each of its objects is held by some node or, with erasure coding, when its group still has
K intact pieces. The newest recoverable step not older than the newest durable one wins. Then
every node gets the objects its ranks' load plans need and it lacks: a copy from a holder (in its
own zone first, then the least busy), or a rebuild from K pieces of its group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from spotckpt.tiers.exchange import PIECE_BYTES, Job, Piece, pieces_of
from spotckpt.tiers.record import GroupRecord, TierRecord


@dataclass(frozen=True)
class HeldStep:
    """One step of one node's tier: its manifest digest, objects and verified holdings."""

    step: int
    digest: str
    objects: dict[str, int]  # every data object of the step: key -> size
    held: frozenset[str]  # data and parity keys this node holds whole (CRC-checked once chosen)
    record: TierRecord
    crcs: dict[str, int] = field(default_factory=dict)  # expected CRC32C of each key
    sizes: dict[str, int] = field(default_factory=dict)  # expected size of each key


@dataclass(frozen=True)
class NodeReport:
    """What one node's leader found in its tier: usable steps, and damaged ones with why."""

    node: str
    zone: str
    leader: int
    steps: tuple[HeldStep, ...] = ()
    damaged: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Scope:
    """Which tier steps a restore may use: those of job `job` (the bucket's job identity; None:
    none at all) not older than `durable` (the bucket's newest committed step), and at `durable`
    itself only the very commit the bucket holds (`durable_attempt`), never another save of
    the same step number."""

    job: str | None
    durable: int | None = None
    durable_attempt: str | None = None

    def refusal(self, step: int, attempt: str, job: str | None) -> str | None:
        """Why a tier step (of `attempt`, written by `job`) may not be used; None if it may."""
        if self.job is None:
            return "the bucket has no job identity (job.json) to tell this job's steps by"
        if job is None:
            return "its tier record names no job (written by an older version)"
        if job != self.job:
            return f"it was written by another job ({job}, not {self.job})"
        if self.durable is not None and step < self.durable:
            return f"it is older than the newest committed step {self.durable}"
        if step == self.durable and attempt != self.durable_attempt:
            return (
                f"the bucket's step {step} is another commit (attempt {self.durable_attempt}, "
                f"not {attempt})"
            )
        return None


@dataclass(frozen=True)
class Copy:
    """Target action: write the piece at its offset into the object `key` of `size` bytes."""

    key: str
    size: int


@dataclass(frozen=True)
class Code:
    """Target action: compute block `index` of the stripe at `offset` from the given blocks and
    write it there into the object `key` of `size` bytes.

    `numbers` are the zfec block numbers of the job's inputs in order, `zeros` those of blocks
    known to be all zeros in this stripe (padding); `keep` is how many bytes of the result
    belong to the object; `parity` tells a parity block (save) from a data block (rebuild).
    """

    key: str
    size: int
    offset: int
    index: int
    data: int
    parity_count: int
    numbers: tuple[int, ...]
    zeros: tuple[int, ...]
    length: int
    keep: int
    parity: bool


@dataclass
class Choice:
    """A recoverable step: who holds what, and the manifest's source."""

    step: int
    digest: str
    objects: dict[str, int]
    record: TierRecord
    holders: dict[str, list[int]]  # key -> leader ranks holding a verified copy
    zones: dict[int, str] = field(default_factory=dict)  # leader rank -> zone

    @property
    def manifest_source(self) -> int:
        """A leader that holds the manifest (the lowest)."""
        return min(r for ranks in self.holders.values() for r in ranks)


def choose_step(
    reports: list[NodeReport], not_older_than: int | None
) -> tuple[Choice | None, list[str]]:
    """The newest recoverable step (or None) and, for each newer one passed over, why."""
    candidates: dict[tuple[int, str], list[tuple[NodeReport, HeldStep]]] = {}
    for report in reports:
        for held in report.steps:
            if not_older_than is None or held.step >= not_older_than:
                candidates.setdefault((held.step, held.digest), []).append((report, held))
    damaged = {step: (r.node, why) for r in reports for step, why in r.damaged}
    reasons: list[str] = []
    for step, digest in sorted(candidates, reverse=True):
        entries = candidates[(step, digest)]
        if step in damaged:
            node, why = damaged[step]
            reasons.append(f"fast-tier step {step} is damaged on node {node}: {why}")
            continue
        if len({held.record for _, held in entries}) > 1:
            reasons.append(f"fast-tier step {step}: its nodes hold different tier records")
            continue
        holders: dict[str, list[int]] = {}
        for report, held in entries:
            for key in held.held:
                holders.setdefault(key, []).append(report.leader)
        first = entries[0][1]
        lost = [k for k in sorted(first.objects) if k not in holders]
        unrecoverable = [k for k in lost if not _rebuildable(k, first.record, holders)]
        if not unrecoverable:
            zones = {report.leader: report.zone for report in reports}
            return Choice(step, digest, first.objects, first.record, holders, zones), reasons
        reasons.append(
            f"fast-tier step {step}: no intact copy survives of {_some(unrecoverable)} "
            f"({len(entries)} node(s) hold the step)"
        )
    return None, reasons


def _rebuildable(key: str, record: TierRecord, holders: dict[str, list[int]]) -> bool:
    group = _group_of(key, record)
    if group is None:
        return False
    present = sum(1 for k in group.data if k == "" or k in holders)
    present += sum(1 for p in group.parity if p.key in holders)
    return present >= len(group.data)


def _group_of(key: str, record: TierRecord) -> GroupRecord | None:
    return next((g for g in record.groups if key in g.data), None)


def _some(keys: list[str], limit: int = 4) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


Ranges = list[tuple[int, int]]
"""Byte ranges ``[start, end)`` of one object, sorted and not overlapping."""


def merge_ranges(ranges: Ranges) -> Ranges:
    """`ranges` sorted, with overlapping and touching ones joined."""
    merged: Ranges = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def restore_jobs(
    choice: Choice,
    node_needs: dict[int, dict[str, Ranges]],
    held_by_leader: dict[int, frozenset[str]],
    piece_bytes: int = PIECE_BYTES,
) -> list[Job]:
    """Jobs giving each node leader (key of `node_needs`) the byte ranges its ranks read.

    Only the ranges a node's load plans read travel (a rank that needs a few values from
    another rank's object gets those bytes, not the object). A needed object with no intact
    copy is first rebuilt whole, once, on the node that reads most of it; the jobs come first
    in the list, so the other nodes' copies from it start after it is written.
    """
    sent: dict[int, int] = {}
    jobs: list[Job] = []
    holders = {key: list(ranks) for key, ranks in choice.holders.items()}
    for key, builder in _builders(choice, node_needs).items():
        have = held_by_leader.get(builder, frozenset())
        whole = [(0, choice.objects[key])]
        jobs.extend(_rebuild_jobs(choice, key, whole, builder, have, sent, piece_bytes))
        holders[key] = [builder]
    for leader in sorted(node_needs):
        have = held_by_leader.get(leader, frozenset())
        for key in sorted(set(node_needs[leader]) - have):
            if holders[key] == [leader]:
                continue  # rebuilt here
            size = choice.objects[key]
            source = _nearest(holders[key], leader, choice.zones, sent)
            for start, end in merge_ranges(node_needs[leader][key]):
                sent[source] = sent.get(source, 0) + end - start
                jobs.extend(
                    Job(leader, (dataclasses.replace(p, offset=p.offset + start),), Copy(key, size))
                    for p in pieces_of(source, key, end - start, piece_bytes)
                )
    return jobs


def _builders(choice: Choice, node_needs: dict[int, dict[str, Ranges]]) -> dict[str, int]:
    """For each needed object without an intact copy: the node that rebuilds it whole (the one
    that reads most of it); the others then copy their ranges from there."""
    builders = {}
    lost = {k for needs in node_needs.values() for k in needs if not choice.holders.get(k)}
    for key in sorted(lost):
        wanted = {
            leader: sum(end - start for start, end in merge_ranges(needs[key]))
            for leader, needs in node_needs.items()
            if key in needs
        }
        builders[key] = max(sorted(wanted), key=lambda leader: wanted[leader])
    return builders


def _nearest(sources: list[int], target: int, zones: dict[int, str], sent: dict[int, int]) -> int:
    if target in sources:
        return target
    zone = zones.get(target, "")
    return min(sources, key=lambda s: (zones.get(s, "") != zone, sent.get(s, 0), s))


def _rebuild_jobs(
    choice: Choice,
    key: str,
    ranges: Ranges,
    target: int,
    have: frozenset[str],
    sent: dict[int, int],
    piece_bytes: int,
) -> list[Job]:
    group = _group_of(key, choice.record)
    if group is None:  # choose_step saw to it that there is one
        raise LookupError(key)
    data_count, parity_count = len(group.data), len(group.parity)
    blocks = list(group.data) + [p.key for p in group.parity]
    available = [n for n, k in enumerate(blocks) if k == "" or k in choice.holders]
    # Blocks already on the target first, then padding, then the least busy holders.
    available.sort(key=lambda n: (blocks[n] not in have, blocks[n] != "", n))
    chosen = available[:data_count]
    source = {
        n: _nearest(choice.holders[blocks[n]], target, choice.zones, sent)
        for n in chosen
        if blocks[n]
    }
    size = choice.objects[key]
    jobs = []
    for offset in range(0, max(group.block_size, 1), piece_bytes):
        length = max(0, min(piece_bytes, group.block_size - offset))
        if not any(start < offset + length and end > offset for start, end in ranges):
            continue
        inputs, numbers, zeros = [], [], []
        for n in chosen:
            stored = _stored_size(blocks[n], n, data_count, choice, group)
            if not blocks[n] or stored <= offset:
                zeros.append(n)
                continue
            take = min(length, stored - offset)
            inputs.append(Piece(source[n], blocks[n], offset, take))
            sent[source[n]] = sent.get(source[n], 0) + take
            numbers.append(n)
        keep = max(0, min(length, size - offset))
        code = Code(
            key,
            size,
            offset,
            group.data.index(key),
            data_count,
            parity_count,
            tuple(numbers),
            tuple(zeros),
            length,
            keep,
            parity=False,
        )
        jobs.append(Job(target, tuple(inputs), code))
    return jobs


def _stored_size(key: str, number: int, data_count: int, choice: Choice, group: GroupRecord) -> int:
    if not key:
        return 0
    if number < data_count:
        return choice.objects[key]
    return group.parity[number - data_count].size
