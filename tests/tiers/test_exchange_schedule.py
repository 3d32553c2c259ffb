"""The peer exchange's rounds (`spotckpt.tiers.exchange.schedule`): the nodes' links carry bytes
at once, and no piece is sent before the job that writes it completed."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from spotckpt.tiers.exchange import SENDS_PER_ROUND, Job, Piece, schedule

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class Write:
    key: str


def copy(holder: int, target: int, key: str, offset: int = 0, length: int = 8) -> Job:
    return Job(target, (Piece(holder, key, offset, length),), Write(key))


def round_of(rounds: list[list[Job]]) -> dict[int, int]:
    return {id(job): number for number, jobs in enumerate(rounds) for job in jobs}


def test_a_ring_of_copies_moves_in_one_round() -> None:
    jobs = [copy(rank, (rank + 1) % 4, f"r{rank}") for rank in range(4)]
    assert schedule(jobs) == [jobs]


def test_pieces_of_one_object_follow_each_other() -> None:
    jobs = [copy(0, 1, "r0", offset) for offset in (0, 8, 16)]
    assert schedule(jobs) == [[jobs[0]], [jobs[1]], [jobs[2]]]


def test_a_rank_feeds_several_peers_at_once() -> None:
    """Erasure coding's pattern: rank 0's data goes to two parity holders in the same round."""
    jobs = [
        Job(1, (Piece(0, "d0", 0, 8), Piece(2, "d2", 0, 8)), Write("p1")),
        Job(2, (Piece(0, "d0", 0, 8), Piece(1, "d1", 0, 8)), Write("p2")),
    ]
    assert schedule(jobs) == [jobs]


def test_a_rank_sends_for_at_most_so_many_jobs_per_round() -> None:
    jobs = [copy(0, target, "r0") for target in range(1, SENDS_PER_ROUND + 2)]
    rounds = schedule(jobs)
    assert [len(r) for r in rounds] == [SENDS_PER_ROUND, 1]


def test_a_rebuilt_object_is_sent_on_only_after_its_rebuild() -> None:
    rebuild = Job(2, (Piece(0, "d0", 0, 8), Piece(1, "p0", 0, 8)), Write("lost"))
    onward = copy(2, 3, "lost")
    unrelated = copy(3, 0, "other")
    rounds = schedule([rebuild, onward, unrelated])
    where = round_of(rounds)
    assert where[id(onward)] > where[id(rebuild)]
    assert where[id(unrelated)] == where[id(rebuild)] == 0


def random_jobs(rng: random.Random, ranks: int, count: int) -> list[Job]:
    jobs = []
    for number in range(count):
        target = rng.randrange(ranks)
        holders = rng.sample(range(ranks), rng.randint(1, min(3, ranks)))
        inputs = tuple(
            Piece(h, rng.choice([f"k{number}", f"k{rng.randrange(count)}"]), 0, rng.choice((0, 8)))
            for h in holders
        )
        jobs.append(Job(target, inputs, Write(f"k{number}")))
    return jobs


@pytest.mark.parametrize("seed", range(30))
def test_rounds_keep_each_pairs_order_and_every_write_apart_from_its_reads(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.randint(2, 6)
    jobs = random_jobs(rng, ranks, rng.randint(1, 40))
    rounds = schedule(jobs)
    assert sorted(map(id, itertools.chain(*rounds))) == sorted(map(id, jobs))
    where = round_of(rounds)
    for round_jobs in rounds:  # one gather and one send per rank and round
        targets = [job.target for job in round_jobs]
        senders = [
            h
            for job in round_jobs
            for h in {p.holder for p in job.inputs if p.length and p.holder != job.target}
        ]
        assert len(targets) == len(set(targets))
        assert all(senders.count(h) <= SENDS_PER_ROUND for h in senders)
    for first, later in itertools.combinations(jobs, 2):  # list order: `first` comes first
        a, b = where[id(first)], where[id(later)]
        if first.target == later.target:
            assert a < b
        reads_later = {(p.holder, p.key) for p in later.inputs if p.length}
        if (first.target, first.action.key) in reads_later:
            assert a < b  # read after it was written
        reads_first = {(p.holder, p.key) for p in first.inputs if p.length}
        if (later.target, later.action.key) in reads_first:
            assert a <= b  # written no sooner than read (a round reads before it writes)
