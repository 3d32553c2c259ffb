"""A node's fast-tier folder on its disk: `local_dir` resolved for the node
(`resolve_local_dir`) and the random id that tells one machine's folder from another's
(`folder_id`), which `spotckpt.tiers.node.check_one_folder_per_node` compares across ranks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
import time
import uuid
from pathlib import Path

from spotckpt.errors import InvalidArgumentError

NODE_FIELD = "{node}"
"""Where a `local_dir` template puts the node's id."""
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
"""Files in a tier folder are opened with these: never through a symbolic link."""
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
FOLDER_ID_NAME = ".spotckpt-folder-id"
_FOLDER_ID = re.compile(r"[0-9a-f]{32}")


def resolve_local_dir(template: str, node: str) -> Path:
    """`template` with ``{node}`` replaced, created below its existing part, writable, and with
    a folder id (`folder_id`).

    The part before ``{node}`` (the whole path without it) must exist: a missing mount is an
    error at start-up, not a folder quietly created on the root disk.
    """
    base = Path(template.partition(NODE_FIELD)[0] or ".") if NODE_FIELD in template else None
    root = Path(template.replace(NODE_FIELD, node))
    must_exist = base if base is not None else root
    if not must_exist.is_dir():
        raise InvalidArgumentError(
            f"local_dir {template!r}: {str(must_exist)!r} does not exist or is not a folder"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".spotckpt-probe-") as probe:
            probe.write(uuid.uuid4().hex.encode())
            probe.flush()
            with contextlib.suppress(FileExistsError):  # the folder keeps the id it has
                _place_id(Path(probe.name), root / FOLDER_ID_NAME)
    except OSError as error:
        raise InvalidArgumentError(
            f"local_dir {str(root)!r} is not writable: {error.strerror or error}"
        ) from None
    return root


_NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK})
"""What `os.link` raises where a file system has no hard links (vfat, some FUSE mounts)."""
ID_WAIT_S = 5.0
"""How long `folder_id` waits for the bytes of an id file another rank is still writing."""


def _place_id(written: Path, target: Path) -> None:
    """Put the id file `written` in place as `target`, whole and first one wins (FileExistsError
    when another rank's is there): a hard link; where the file system has none, an exclusive
    create written in one call (`folder_id` waits the moment until its bytes are there)."""
    try:
        os.link(written, target)
        return
    except OSError as error:
        if isinstance(error, FileExistsError) or error.errno not in _NO_LINKS:
            raise
    fd = os.open(target, WRITE_FLAGS | os.O_EXCL, 0o644)
    try:
        os.write(fd, written.read_bytes())
        os.fsync(fd)
    finally:
        os.close(fd)


def folder_id(root: Path) -> str:
    """The random id of the tier folder `root`: ranks that read the same one see one folder
    (one machine's disk). It appears whole, first one wins (`_place_id`), so the ranks sharing
    the folder never read different ones."""
    path = root / FOLDER_ID_NAME
    deadline = time.monotonic() + ID_WAIT_S
    while True:
        try:
            fd = os.open(path, READ_FLAGS)
            try:
                data = os.read(fd, 64)
            finally:
                os.close(fd)
        except OSError as error:
            raise InvalidArgumentError(
                f"cannot read {str(path)!r}: {error.strerror or error}"
            ) from None
        if data or time.monotonic() > deadline:
            break
        time.sleep(0.01)  # created, not yet written, by another rank (`_place_id`)
    text = data.decode("ascii", "replace")
    if not _FOLDER_ID.fullmatch(text):
        raise InvalidArgumentError(
            f"{str(path)!r} is not a folder id written by spotckpt: remove it (a new one is "
            "written at the next start)"
        )
    return text
