"""The local store stays inside its root: links are never followed; a full disk leaves no temp."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spotckpt.storage import ObjectNotFoundError, StorageError, open_store
from spotckpt.storage.local import TEMP_MARKER, DiskFullError, LocalStore

SECRET = b"outside the root: never read, listed or deleted"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.bin").write_bytes(SECRET)
    (path / "empty-dir").mkdir()
    return path


def _link_warnings(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if f"/{key} is a symbolic link" in r.getMessage()
    ]


def _temps(folder: Path) -> list[str]:
    return [name for _, _, files in os.walk(folder) for name in files if TEMP_MARKER in name]


def test_link_to_a_file_outside_is_not_an_object(
    root: Path, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(str(root))
    store.put("step-1/real.bin", b"real")
    (root / "step-1" / "evil.bin").symlink_to(outside / "secret.bin")
    with pytest.raises(ObjectNotFoundError):
        store.get("step-1/evil.bin")
    with pytest.raises(ObjectNotFoundError):
        store.get_range("step-1/evil.bin", 0, 4)
    with pytest.raises(ObjectNotFoundError):
        store.get_range_into("step-1/evil.bin", 0, memoryview(bytearray(4)))
    assert store.head("step-1/evil.bin") is None
    assert not store.exists("step-1/evil.bin")
    with caplog.at_level(logging.WARNING, logger="spotckpt.storage"):
        assert [i.key for i in store.list("step-1/")] == ["step-1/real.bin"]
    assert len(_link_warnings(caplog, "step-1/evil.bin")) == 1
    store.delete_many(["step-1/evil.bin", "step-1/real.bin"])
    assert (outside / "secret.bin").read_bytes() == SECRET
    assert not store.exists("step-1/real.bin")


def test_linked_folder_pointing_outside(
    root: Path, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(str(root))
    (root / "step-2").symlink_to(outside)
    assert store.head("step-2/secret.bin") is None
    with pytest.raises(ObjectNotFoundError, match="symbolic link"):
        store.get("step-2/secret.bin")
    with pytest.raises(ObjectNotFoundError):
        store.get_range("step-2/secret.bin", 0, 10)
    with pytest.raises(ObjectNotFoundError):
        store.get_range_into("step-2/secret.bin", 0, memoryview(bytearray(10)))
    with caplog.at_level(logging.WARNING, logger="spotckpt.storage"):
        assert list(store.list()) == []
        assert store.list_uploads() == []
    assert len(_link_warnings(caplog, "step-2")) == 2  # one per listing
    # deleting an object under the link, and pruning its emptied folders, stays inside the root
    store.delete_many(["step-2/secret.bin", "step-2/empty-dir/gone.bin"])
    assert (outside / "secret.bin").read_bytes() == SECRET
    assert (outside / "empty-dir").is_dir()
    with pytest.raises(StorageError, match="symbolic link"):
        store.put("step-2/new.bin", b"x")
    assert sorted(p.name for p in outside.iterdir()) == ["empty-dir", "secret.bin"]


def test_dangling_link_is_reported_not_a_crash(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(str(root))
    store.put("a/kept.bin", b"k")
    (root / "a" / "dangling").symlink_to(root / "nowhere")
    (root / "dangling-dir").symlink_to(root / "nowhere-dir", target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="spotckpt.storage"):
        assert [i.key for i in store.list()] == ["a/kept.bin"]
    assert len(_link_warnings(caplog, "a/dangling")) == 1
    assert len(_link_warnings(caplog, "dangling-dir")) == 1
    assert store.head("a/dangling") is None
    with pytest.raises(ObjectNotFoundError):
        store.get("a/dangling")
    store.delete_many(["a/dangling", "dangling-dir/x"])
    assert store.get("a/kept.bin") == b"k"


def test_root_that_is_itself_a_link(tmp_path: Path, root: Path) -> None:
    (tmp_path / "alias").symlink_to(root, target_is_directory=True)
    store = open_store(str(tmp_path / "alias"))
    assert store.uri == root.resolve().as_uri()
    store.put("s/obj", b"data")
    assert store.get("s/obj") == b"data"
    assert [i.key for i in store.list()] == ["s/obj"]
    assert (root / "s" / "obj").read_bytes() == b"data"
    store.delete_many(["s/obj"])
    assert list(root.iterdir()) == []


def test_link_replaced_object_after_open_is_not_followed(root: Path, outside: Path) -> None:
    store = open_store(str(root))
    store.put("m.json", b"{}")
    (root / "m.json").unlink()
    (root / "m.json").symlink_to(outside / "secret.bin")
    assert not store.exists("m.json")
    store.put("m.json", b"new")  # replaces the link itself, never writes through it
    assert not (root / "m.json").is_symlink()
    assert store.get("m.json") == b"new"
    assert (outside / "secret.bin").read_bytes() == SECRET


# A full disk --------------------------------------------------------------------------------


def full_disk_scenario(mount: str) -> None:
    """On an empty 1 MiB tmpfs at `mount`: fill it, fail a write, free space, write again."""
    store = LocalStore(Path(mount) / "ck", fsync=True)
    store.put("fill.bin", os.urandom(700 << 10))
    with pytest.raises(DiskFullError) as caught, store.open_writer("step-1/big.bin") as writer:
        for _ in range(10):
            writer.write(os.urandom(64 << 10))
    message = str(caught.value)
    assert "ENOSPC" in message and "step-1/big.bin" in message, message
    assert _temps(Path(mount)) == []
    assert store.list_uploads() == []
    assert not store.exists("step-1/big.bin")
    with pytest.raises(DiskFullError, match=r"ENOSPC.*step-1/put\.bin"):
        store.put("step-1/put.bin", os.urandom(640 << 10))
    assert _temps(Path(mount)) == []
    store.delete_many(["fill.bin"])
    data = os.urandom(640 << 10)
    store.put("step-1/big.bin", data)
    assert store.get("step-1/big.bin") == data


def test_full_disk_leaves_no_temp_and_says_so(small_disk: Path | None, tmp_path: Path) -> None:
    if small_disk is not None:
        full_disk_scenario(str(small_disk))
        return
    assert shutil.which("unshare"), "neither mount nor unshare can make a small real disk here"
    target = tmp_path / "small-ns"
    target.mkdir()
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import test_local_store as t; t.full_disk_scenario({str(target)!r})"
    )
    script = 'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" -c "$3"'
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(target), sys.executable, code],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr  # also when a tmpfs is not permitted


def test_failed_fsync_and_rename_remove_the_temp(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit path's own failures (a real small disk fails earlier, at write)."""
    store = LocalStore(root, fsync=True)

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(DiskFullError, match=r"ENOSPC.*a/b\.bin"):
        store.put("a/b.bin", b"x" * 1000)
    assert _temps(root) == []
    monkeypatch.undo()

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(StorageError, match=r"a/c\.bin.*EIO") as caught:
        store.put("a/c.bin", b"y")
    assert not isinstance(caught.value, DiskFullError)
    assert _temps(root) == []
    monkeypatch.undo()
    store.put("a/c.bin", b"y")
    assert store.get("a/c.bin") == b"y"
