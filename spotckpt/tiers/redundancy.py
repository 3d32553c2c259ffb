"""Where each rank's copies go, for a redundancy spec (``replicate:F``, ``ec:K+M``, parsed by
`spotckpt.redundancy`).

Placement is a pure function of the spec and of every rank's `NodeIdentity`, so every rank
computes the same answer without a message. Nodes are put on a ring that alternates zones
(``a1 b1 a2 b2 ...``), so the next node on the ring is in another zone whenever there is one.

- ``replicate:F``: rank *r*, the *j*-th rank of its node, also has its object kept by the
  *j*-th rank (modulo its size) of the next F-1 nodes on the ring.
- ``ec:K+M``: for each local rank index *j*, the nodes with a *j*-th rank are cut into groups
  of K consecutive nodes on the ring (the last group wraps around); the M nodes after a group
  hold its M parity pieces. Any M lost nodes of a group are recovered from the other K pieces.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from spotckpt.errors import InvalidArgumentError
from spotckpt.redundancy import Redundancy
from spotckpt.tiers.node import NodeIdentity


@dataclass(frozen=True)
class ErasureGroup:
    """K data ranks whose objects are protected by parity pieces held by M parity ranks."""

    data: tuple[int, ...]
    parity: tuple[int, ...]


class Placement:
    """Where copies go for one job: built from every rank's identity, the same on all ranks."""

    def __init__(self, redundancy: Redundancy, identities: list[NodeIdentity]) -> None:
        self.redundancy = redundancy
        self.identities = identities
        self.node_ranks: dict[str, list[int]] = {}
        for rank, identity in enumerate(identities):
            self.node_ranks.setdefault(identity.node, []).append(rank)
        self.ring = _zone_ring(identities, list(self.node_ranks))
        if len(self.ring) < redundancy.nodes_needed:
            raise InvalidArgumentError(
                f"redundancy {redundancy} needs at least {redundancy.nodes_needed} nodes; this "
                f"job runs on {len(self.ring)} ({', '.join(self.ring)}); set SPOTCKPT_NODE per "
                "node, or choose a smaller spec"
            )
        self.groups = self._erasure_groups() if redundancy.erasure else []

    def node_of(self, rank: int) -> str:
        """The node id of `rank`."""
        return self.identities[rank].node

    def leader(self, node: str) -> int:
        """The lowest rank on `node`: it writes the node's manifests and serves its copies."""
        return self.node_ranks[node][0]

    def is_leader(self, rank: int) -> bool:
        """Whether `rank` is its node's leader."""
        return self.leader(self.node_of(rank)) == rank

    def replica_holders(self, rank: int) -> list[int]:
        """The ranks (on other nodes) that keep a copy of `rank`'s object."""
        node = self.node_of(rank)
        local_index = self.node_ranks[node].index(rank)
        position = self.ring.index(node)
        holders = []
        for distance in range(1, self.redundancy.copies):
            ranks = self.node_ranks[self.ring[(position + distance) % len(self.ring)]]
            holders.append(ranks[local_index % len(ranks)])
        return holders

    def survives(self, lost: Collection[str]) -> bool:
        """Whether every rank's object can still be read or rebuilt once the nodes in `lost`
        are gone (their disks with them): a replica outside them, or at most as many members
        of each erasure group inside them as the group has parity."""
        if self.redundancy.erasure:
            return all(
                sum(self.node_of(r) in lost for r in group.data + group.parity) <= len(group.parity)
                for group in self.groups
            )
        return all(
            any(self.node_of(holder) not in lost for holder in [rank, *self.replica_holders(rank)])
            for rank in range(len(self.identities))
        )

    def _erasure_groups(self) -> list[ErasureGroup]:
        data, parity = self.redundancy.data, self.redundancy.parity
        groups = []
        deepest = max(len(ranks) for ranks in self.node_ranks.values())
        for local_index in range(deepest):
            nodes = [n for n in self.ring if len(self.node_ranks[n]) > local_index]
            if len(nodes) < data + parity:
                raise InvalidArgumentError(
                    f"redundancy {self.redundancy} needs every node to run as many ranks, or "
                    f"{data + parity} nodes with a rank number {local_index}; only "
                    f"{len(nodes)} have one"
                )
            ranks = [self.node_ranks[n][local_index] for n in nodes]
            for first in range(0, len(ranks), data):
                members = [ranks[(first + i) % len(ranks)] for i in range(data + parity)]
                groups.append(ErasureGroup(tuple(members[:data]), tuple(members[data:])))
        return groups


def _zone_ring(identities: list[NodeIdentity], nodes: list[str]) -> list[str]:
    """Nodes in first-rank order, interleaved by zone: a1 b1 c1 a2 b2 ..."""
    zones: dict[str, list[str]] = {}
    zone_of = {identity.node: identity.zone for identity in identities}
    for node in nodes:
        zones.setdefault(zone_of[node], []).append(node)
    ring: list[str] = []
    for depth in range(max(len(members) for members in zones.values())):
        ring.extend(members[depth] for members in zones.values() if depth < len(members))
    return ring
