"""The fsspec store beyond the contract: what each filesystem's create guarantees decides what a
commit does, through the checkpoint manager too; leftovers and credentials."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.errors import InvalidArgumentError
from spotckpt.gc import collect_garbage
from spotckpt.storage import AlreadyExistsError, open_store
from spotckpt.storage.fsspec import FsspecStore


def _dir_uri(tmp_path: Path) -> str:
    """A root on fsspec's ``dir`` filesystem (a folder seen through another filesystem), which
    has no exclusive create."""
    (tmp_path / "dir-root").mkdir(exist_ok=True)
    return "fsspec+dir://runs/exp1"


def _dir_options(tmp_path: Path) -> dict[str, str]:
    return {"path": str(tmp_path / "dir-root"), "target_protocol": "file"}


def test_a_filesystem_without_exclusive_create_refuses_the_commit(tmp_path: Path) -> None:
    store = open_store(_dir_uri(tmp_path), **_dir_options(tmp_path))
    store.put("data.bin", b"plain writes work")
    assert store.get("data.bin") == b"plain writes work"
    with pytest.raises(InvalidArgumentError, match="cannot create a file exclusively"):
        store.put("step/manifest.json", b"{}", create_only=True)
    assert not store.exists("step/manifest.json")
    with (
        CheckpointManager(
            _dir_uri(tmp_path), preemption=False, storage_options=_dir_options(tmp_path)
        ) as manager,
        pytest.raises(Exception, match="unsafe_create_only=True"),
    ):
        manager.save(1, {"w": torch.ones(4)})


def test_the_weaker_mode_commits_after_a_check(tmp_path: Path) -> None:
    options = {**_dir_options(tmp_path), "unsafe_create_only": "true"}
    with CheckpointManager(_dir_uri(tmp_path), preemption=False, storage_options=options) as mgr:
        mgr.save(1, {"w": torch.full((4,), 3.0)})
        target = {"w": torch.zeros(4)}
        assert mgr.restore(target) == 1
        assert torch.equal(target["w"], torch.full((4,), 3.0))
        mgr.store.put("k", b"0")
        with pytest.raises(AlreadyExistsError):  # seen by the check, not by the filesystem
            mgr.store.put("k", b"1", create_only=True)
        assert mgr.store.get("k") == b"0"


@pytest.mark.process
@pytest.mark.parametrize("kind", ["file", "memory", "s3"])
def test_save_and_restore_through_the_manager(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "file":
        uri = f"fsspec+file://{tmp_path}/ck"
    elif kind == "memory":
        uri = f"fsspec+memory://manager-{tmp_path.name}/ck"
    else:
        uri = request.getfixturevalue("s3_uri").replace("s3://", "fsspec+s3://", 1)
    with CheckpointManager(uri, preemption=False) as manager:
        manager.save(1, {"w": torch.arange(1000.0)})
        manager.save(2, {"w": torch.arange(1000.0) * 2})
        assert manager.steps() == [1, 2]
    target = {"w": torch.zeros(1000)}
    with CheckpointManager(uri, preemption=False) as manager:
        assert manager.restore(target) == 2
        with pytest.raises(AlreadyExistsError):  # the commit point is create-only there
            manager.store.put("step-000000002/manifest.json", b"{}", create_only=True)
    assert torch.equal(target["w"], torch.arange(1000.0) * 2)


def test_a_dead_writers_temporary_file_is_left_to_gc(tmp_path: Path) -> None:
    uri = f"fsspec+file://{tmp_path}/ck"
    with CheckpointManager(uri, preemption=False) as manager:
        manager.save(1, {"w": torch.ones(4)})
        store = manager.store
        writer = store.open_writer("step-000000002/a-x/data.bin")
        writer.write(b"half")  # the process dies here: nothing calls commit or abort
        assert [o.key for o in store.list("step-000000002/")] == []
        leftovers = store.list_uploads()
        assert len(leftovers) == 1 and leftovers[0].key.startswith("step-000000002/a-x/.data")
        report = collect_garbage(store, safety_age_s=0.0)
        assert [a.kind for a in report.actions] == ["upload"]
        assert store.list_uploads() == []
        assert manager.steps() == [1]


def test_credentials_in_options_cross_only_into_child_processes(s3_uri: str) -> None:
    store = open_store(
        s3_uri.replace("s3://", "fsspec+s3://", 1), key="testing", secret="testing-secret"
    )
    assert isinstance(store, FsspecStore)
    with pytest.raises(InvalidArgumentError, match="never pickled otherwise"):
        pickle.dumps(store)
    copy = pickle.loads(ForkingPickler.dumps(store))
    copy.put("k", b"v")
    assert store.get("k") == b"v"


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("fsspec+://x", "fsspec\\+<protocol>"),
        ("fsspec+memory://u:p@x/y", "must not carry credentials"),
        ("fsspec+memory://x/y?token=1", "must not carry credentials"),
        ("fsspec+nosuchprotocol://x", "no usable 'nosuchprotocol' filesystem"),
    ],
)
def test_bad_uris_are_refused(uri: str, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        open_store(uri)
    assert "token=1" not in str(caught.value)


def test_a_memory_filesystem_is_not_sent_to_another_process(tmp_path: Path) -> None:
    from spotckpt.storage.base import check_portable

    store = open_store("fsspec+memory://portable/x")
    with pytest.raises(InvalidArgumentError, match="this process only"):
        check_portable(store)
    check_portable(open_store(f"fsspec+file://{tmp_path}/ck"))
