"""The cells of the seam test (issue 44): a 2-way covering array of spotckpt's features against
the operations and the faults planted in the bucket, from a small deterministic greedy generator.

Every pair of values of any two factors (say signed with gc interleaved with a save, or indexed
with a damaged old manifest) is in at least one cell. A combination spotckpt refuses (the fast
tier with process-mode async) is no ordinary cell: it gets cells of its own, whose refusal is
checked. Pure Python (no torch): ``python tests/seams/seam_cells.py`` prints the table.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

FEATURES = ("incremental", "signed", "compressed", "indexed", "fast_tier", "process_async")
OPS = (
    "save",
    "restore",
    "retention_k1",
    "retention_k2",
    "gc_during_save",
    "verify",
    "export_hf",
    "reshard_restore",
    "notice_during_upload",
)
FAULTS = ("none", "damaged_object", "planted_step", "damaged_old_manifest")
FACTORS: tuple[tuple[str, tuple[object, ...]], ...] = (
    *((name, (False, True)) for name in FEATURES),
    ("op", OPS),
    ("fault", FAULTS),
)
REFUSED = (("fast_tier", True), ("process_async", True))
"""The pair spotckpt refuses at construction (docs/async-process.md)."""
COST = {("indexed", True): 3, ("process_async", True): 2, ("op", "reshard_restore"): 2}
"""Relative cost of a value (rank processes); the generator's tie-break prefers cheap cells."""
GENERATOR_SEED = 44
CANDIDATES = 24


@dataclass(frozen=True)
class Cell:
    """One cell: which features are on, the operation, and the fault planted in the bucket."""

    incremental: bool
    signed: bool
    compressed: bool
    indexed: bool
    fast_tier: bool
    process_async: bool
    op: str
    fault: str
    ranks: int = 0
    """World size of the save (0: the default for the features, see `save_world`)."""

    @property
    def refused(self) -> bool:
        return all(getattr(self, name) == value for name, value in REFUSED)

    @property
    def features(self) -> str:
        on = [name for name in FEATURES if getattr(self, name)]
        return "+".join(on) if on else "plain"

    @property
    def save_world(self) -> int:
        """Indexed saves run on 4 ranks (index parts forced on); a reshard saves on 2."""
        if self.ranks:
            return self.ranks
        if self.indexed:
            return 4
        return 2 if self.op == "reshard_restore" else 1

    @property
    def op_world(self) -> int:
        """The world size of the operation: another one for a reshard (4 -> 2, 2 -> 1)."""
        return self.save_world // 2 if self.op == "reshard_restore" else self.save_world

    @property
    def in_process(self) -> bool:
        """Whether the cell runs in the test's own process (no process group needed)."""
        return self.save_world == 1 and self.op_world == 1 and not self.process_async

    @property
    def id(self) -> str:
        ranks = f"-{self.save_world}r" if self.save_world > 1 else ""
        return f"{self.op}-{self.fault}-{self.features}{ranks}"


def _pairs(cell: dict[str, object]) -> Iterator[tuple[tuple[str, object], tuple[str, object]]]:
    for a, b in itertools.combinations(sorted(cell), 2):
        yield (a, cell[a]), (b, cell[b])


def _refused(cell: dict[str, object]) -> bool:
    return all(cell.get(name) == value for name, value in REFUSED)


def covering_array(seed: int = GENERATOR_SEED) -> list[Cell]:
    """Greedy (AETG-like): each new cell starts from an uncovered pair and adds, factor by factor
    in a seeded order, the value covering most new pairs (then the cheapest, then a seeded
    draw, so that features spread over the cells that complete the pairs); the best of
    `CANDIDATES` such cells is kept. Deterministic for a seed. The refused pair is covered by a
    cell of its own per operation, whose refusal is what is checked."""
    rng = random.Random(seed)
    names = [name for name, _ in FACTORS]
    values = dict(FACTORS)
    uncovered = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(sorted(names), 2)
        for va in values[a]
        for vb in values[b]
        if not _refused({a: va, b: vb})
    }
    rows: list[dict[str, object]] = []
    while uncovered:
        start = sorted(uncovered, key=repr)[0]
        best: tuple[int, int, dict[str, object]] | None = None
        for _ in range(CANDIDATES):
            cell = dict(start)
            order = [name for name in names if name not in cell]
            rng.shuffle(order)
            for name in order:

                def gain(
                    value: object,
                    name: str = name,
                    cell: dict[str, object] = cell,
                    uncovered: set[Any] = uncovered,
                ) -> int:
                    trial = {**cell, name: value}
                    if _refused(trial):
                        return -1
                    return sum(pair in uncovered for pair in _pairs(trial))

                ties = {value: rng.random() for value in values[name]}  # spread the free ones
                cell[name] = max(
                    values[name], key=lambda v: (gain(v), -COST.get((name, v), 0), ties[v])
                )
            score = sum(pair in uncovered for pair in _pairs(cell))
            cost = sum(COST.get(item, 0) for item in cell.items())
            if best is None or (score, -cost) > (best[0], -best[1]):
                best = (score, cost, cell)
        assert best is not None
        rows.append(best[2])
        uncovered -= set(_pairs(best[2]))
    cells = [Cell(**row) for row in rows]  # type: ignore[arg-type]
    refusals = [  # the refused pair, plain otherwise: the refusal is the cell's whole check
        Cell(False, False, False, False, True, True, op="save", fault="none"),
    ]
    return [*cells, *refusals]


def wide_cell() -> Cell:
    """The one indexed cell at 32 ranks (signed, a damaged newest object, restored)."""
    return Cell(
        incremental=False,
        signed=True,
        compressed=False,
        indexed=True,
        fast_tier=False,
        process_async=False,
        op="restore",
        fault="damaged_object",
        ranks=32,
    )


def missing_pairs(cells: list[Cell]) -> set[tuple[tuple[str, object], tuple[str, object]]]:
    """Pairs of values that no ordinary (not refused) cell holds, the refused one aside."""
    names = [name for name, _ in FACTORS]
    values = dict(FACTORS)
    wanted = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(sorted(names), 2)
        for va in values[a]
        for vb in values[b]
        if not _refused({a: va, b: vb})
    }
    for cell in cells:
        if not cell.refused:
            wanted -= set(_pairs({name: getattr(cell, name) for name in names}))
    return wanted


def table(cells: list[Cell], sampled: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    """The cells as a markdown table (a ``*`` marks the ones in `make test`'s sample)."""
    columns = [f.name for f in fields(Cell) if f.name != "ranks"]
    head = ["#", *columns, "ranks", "runs", "sample"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for number, cell in enumerate(cells, 1):
        flags = ["x" if getattr(cell, name) else "" for name in FEATURES]
        where = "refused" if cell.refused else ("in-process" if cell.in_process else "ranks")
        ranks = f"{cell.save_world}->{cell.op_world}" if cell.op == "reshard_restore" else ""
        ranks = ranks or str(cell.save_world)
        mark = "*" if cell.id in sampled else ""
        row = [str(number), *flags, cell.op, cell.fault, ranks, where, mark]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    every = [*covering_array(), wide_cell()]
    sys.stdout.write(table(every) + "\n")
