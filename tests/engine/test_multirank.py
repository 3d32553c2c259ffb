"""Several ranks (gloo process groups on the CPU, one process each) against a moto S3 server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key, rank_object_key
from spotckpt.storage import open_store

from dist_worker import launch_ranks, make_model, run_ranks
from tests_support import assert_equal, load_saved

MIB = 1 << 20
OPTIONS = {"part_size": 5 * MIB}


@pytest.fixture(scope="module")
def fsdp_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[str, Path]:
    """A checkpoint of an FSDP2 model and AdamW saved by 4 ranks (prefix spreading on)."""
    import uuid

    import boto3

    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = f"fsdp-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    out = tmp_path_factory.mktemp("fsdp")
    uri = f"s3://{bucket}/run"
    import os

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    run_ranks(
        4, "fsdp_save", {"uri": uri, "out": str(out), "options": OPTIONS, "prefix_spread": True}
    )
    return uri, out


@pytest.mark.process
def test_fsdp2_save_on_4_and_continue_identically(fsdp_checkpoint: tuple[str, Path]) -> None:
    uri, out = fsdp_checkpoint
    assert_equal(load_saved(out / "continued.pt"), load_saved(out / "resumed-continued.pt"))
    manifest = Manifest.from_json(open_store(uri).get(manifest_key(2)))
    assert manifest.world_size == 4
    assert sorted(o.rank for o in manifest.objects.values()) == [0, 1, 2, 3]
    # prefix spreading: each rank's object sits under a hashed prefix of (attempt, rank), kept in
    # the manifest (4096 prefixes: two ranks may share one, so distinctness is not asserted)
    expected = {rank_object_key(manifest.attempt, rank, prefix_spread=True) for rank in range(4)}
    assert set(manifest.objects) == expected
    assert all(len(key.split("/")[1]) == 3 for key in manifest.objects)
    weight = manifest.tensors["model.0.weight"]
    assert len(weight.chunks) == 4 and weight.shape == (1024, 512)


@pytest.mark.process
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fsdp2_restores_on_any_world_size(fsdp_checkpoint: tuple[str, Path], world: int) -> None:
    uri, out = fsdp_checkpoint
    run_ranks(world, "fsdp_restore", {"uri": uri, "out": str(out), "options": OPTIONS})
    assert_equal(load_saved(out / "saved.pt"), load_saved(out / f"restored-{world}.pt"))
    stats = [json.loads((out / f"stats-{world}-{r}.json").read_text()) for r in range(world)]
    assert all(s == stats[0] for s in stats)  # last_read_stats is job-wide, the same everywhere
    read, needed = stats[0]["read"], stats[0]["needed"]
    print(f"reshard 4 -> {world}: read {read} bytes for {needed} needed, ratio {read / needed:.3f}")
    assert read <= 1.1 * needed


def test_ddp_writes_each_parameter_once(s3_uri: str, tmp_path: Path) -> None:
    run_ranks(3, "ddp_save", {"uri": s3_uri, "out": str(tmp_path), "options": OPTIONS})
    manifest = Manifest.from_json(open_store(s3_uri).get(manifest_key(1)))
    model_bytes = sum(p.numel() * p.element_size() for p in make_model().parameters())
    stored = sum(
        chunk.location.length
        for fqn, tensor in manifest.tensors.items()
        if fqn.startswith("model.")
        for chunk in tensor.chunks
    )
    assert stored == model_bytes
    assert all(len(t.chunks) == 1 for t in manifest.tensors.values())
    assert manifest.world_size == 3


def test_ddp_restore_reads_the_checkpoint_once(s3_uri: str, tmp_path: Path) -> None:
    """4 DDP replicas: each replicated tensor is read by one rank and broadcast to the others."""
    run_ranks(4, "ddp_save", {"uri": s3_uri, "out": str(tmp_path), "options": OPTIONS})
    manifest = Catalog(open_store(s3_uri)).read_manifest(1)
    stats = json.loads((tmp_path / "ddp-restore-stats.json").read_text())
    ratio = stats["read"] / manifest.total_bytes
    print(f"4-rank DDP restore read {stats['read']} bytes of {manifest.total_bytes}: {ratio:.3f}x")
    assert ratio <= 1.05  # each rank reading every replicated tensor would be about 4x


@pytest.mark.process
def test_a_piece_one_replica_cannot_read_fails_the_load_on_every_rank_not_a_hang(
    tmp_path: Path,
) -> None:
    """DDP: each piece is read by one rank and broadcast. A corrupt block makes one rank's own
    reads fail: its peers must not wait for its broadcasts; every rank falls back to step 1."""
    args = {"uri": str(tmp_path / "bucket"), "out": str(tmp_path)}
    run_ranks(2, "ddp_save_twice", args)
    (path,) = (tmp_path / "bucket").glob("step-000000002/a-*/r00000-000.safetensors")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one block of one piece
    path.write_bytes(bytes(data))
    run_ranks(2, "ddp_restore_outcome", args)
    outcomes = [json.loads((tmp_path / f"outcome-{r}.json").read_text()) for r in range(2)]
    assert outcomes == [{"step": 1}, {"step": 1}]


@pytest.mark.process
def test_async_saves_on_two_ranks_do_not_hang(tmp_path: Path) -> None:
    """An async upload's collectives and the training thread's agreement use separate groups."""
    uri = str(tmp_path / "ck")
    run_ranks(2, "async_saves", {"uri": uri, "out": str(tmp_path)})
    assert json.loads((tmp_path / "steps.json").read_text()) == [4, 6, 8]  # keep_last=3
    target = {"w0": torch.zeros(1 << 16), "w1": torch.zeros(1 << 16)}
    with CheckpointManager(uri, preemption=False) as mgr:
        assert mgr.restore(target) == 8
    assert torch.equal(target["w1"], torch.full((1 << 16,), 8.0))


def test_failing_rank_is_named_and_next_save_works(
    s3_uri: str, s3_client: Any, tmp_path: Path
) -> None:
    run_ranks(3, "failing_rank", {"uri": s3_uri, "out": str(tmp_path), "options": OPTIONS})
    for rank in range(3):
        assert "rank(s) [1]" in (tmp_path / f"error-{rank}.txt").read_text()
    store = open_store(s3_uri)
    assert not store.exists(manifest_key(5))
    assert store.exists(manifest_key(6))
    assert [i.key for i in store.list("step-000000005/")] == []
    assert "Uploads" not in s3_client.list_multipart_uploads(Bucket=s3_uri.split("/")[2])


def test_killed_rank_fails_the_others_within_the_bound(
    s3_uri: str, s3_client: Any, tmp_path: Path
) -> None:
    bound = 20
    args = {"uri": s3_uri, "out": str(tmp_path), "options": OPTIONS, "timeout": bound}
    results = launch_ranks(3, "killed_rank", args)
    assert results[2].returncode == -9
    for rank in (0, 1):
        assert results[rank].returncode == 0, results[rank].stdout[-3000:]
        report = json.loads((tmp_path / f"error-{rank}.txt").read_text())
        assert "rank(s) [2] did not finish writing" in report["error"]
        assert not any(raw in report["error"] for raw in ("gloo", "GLHF", "Connection", "[/"))
        # The collective timeout, the marker grace (30 s) and a margin for a loaded machine.
        assert report["seconds"] < bound + 30 + 30
    store = open_store(s3_uri)
    assert not store.exists(manifest_key(5))
    assert "Uploads" not in s3_client.list_multipart_uploads(Bucket=s3_uri.split("/")[2])
