"""Which node and zone this process runs on: the keys of copy placement and of `local_dir`.

The node id is ``SPOTCKPT_NODE`` when set, else the host name: what must stay the same across a
restart is the machine whose disk holds the copies, and the host name names it. (torchrun's
``GROUP_RANK`` is not used: an elastic restart may hand the same machine another node rank.)
``SPOTCKPT_ZONE`` (optional) names the failure domain, for example a cloud zone or spot pool:
placement puts a rank's copies in other zones first, since one reclaim often takes several
nodes of one pool at once.

A node id names one machine's folder: every rank that claims it must see the same tier folder
(each rank reads the folder's random id, `FastTier` compares them), or the job refuses to
start (`check_one_folder_per_node`). Two machines under one id (a reused host name such as
``localhost``) would each hold part of every tier step, and a restart would find no step whole.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from spotckpt.environment import NODE_VARIABLE, ZONE_VARIABLE
from spotckpt.errors import InvalidArgumentError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


@dataclass(frozen=True, order=True)
class NodeIdentity:
    """A process's node id and zone ("" when no zone is given)."""

    node: str
    zone: str = ""


def check_name(value: str, what: str) -> str:
    """`value` if it is a safe node or zone name (it becomes a folder name); else an error."""
    if not _NAME.fullmatch(value):
        shown = repr(value) if len(value) <= 80 else f"{value[:77]!r}..."
        raise InvalidArgumentError(
            f"{what} must be 1-63 letters, digits, '.', '_' or '-' starting with a letter or "
            f"digit, got {shown}; set it to a name of this machine that no other machine uses"
        )
    return value


def node_identity(environ: Mapping[str, str] | None = None) -> NodeIdentity:
    """This process's node and zone, from ``SPOTCKPT_NODE`` / ``SPOTCKPT_ZONE`` or the host."""
    environ = os.environ if environ is None else environ
    node = environ.get(NODE_VARIABLE) or socket.gethostname().split(".")[0]
    zone = environ.get(ZONE_VARIABLE, "")
    return NodeIdentity(
        check_name(node, NODE_VARIABLE if NODE_VARIABLE in environ else "the host name"),
        check_name(zone, ZONE_VARIABLE) if zone else "",
    )


def check_one_folder_per_node(identities: list[NodeIdentity], folders: list[str]) -> None:
    """InvalidArgumentError, the same on every rank, unless the ranks that claim one node id
    (`identities`, by rank) all see one tier folder (`folders`: the id each rank read there)."""
    seen: dict[str, tuple[int, str]] = {}
    for rank, (identity, folder) in enumerate(zip(identities, folders, strict=True)):
        first, theirs = seen.setdefault(identity.node, (rank, folder))
        if theirs != folder:
            raise InvalidArgumentError(
                f"ranks {first} and {rank} both claim node id {identity.node!r} but run on "
                "different machines (they see different folders at local_dir): a fast-tier step "
                "would be split between them and never restored whole. The node id is "
                f"{NODE_VARIABLE}, else the host name: set {NODE_VARIABLE} to a name of its own "
                "on each machine"
            )
