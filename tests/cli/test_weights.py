"""`open_checkpoint` and `load_weights`: lazy, verified reads of a checkpoint, no training job.

Checkpoints come from real FSDP2 saves on gloo ranks (`fsdp_checkpoints`: 4 ranks, shared per
session; 2 ranks with an indexed manifest on S3, made here) and from one process; the S3 store is
the moto server of tests/conftest.py. Bytes read are counted by a store that wraps the real one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import spotckpt
from spotckpt import CheckpointManager, TrainState
from spotckpt.catalog import Catalog
from spotckpt.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    KeyMismatchError,
    NoCheckpointError,
)
from spotckpt.format.index import INDEXED_FORMAT
from spotckpt.layout import step_folder
from spotckpt.storage import open_store
from spotckpt.storage.base import ObjectStore

from fsdp_checkpoints import (
    STEP,
    assert_same,
    fsdp_checkpoint,
    full_weights,
    make_model,
    save_fsdp_checkpoint,
)
from tests_support import free_port

pytestmark = pytest.mark.process  # its tests start processes or servers


class CountingStore:
    """Passes every call to a real store; counts the bytes its ranged reads return, and the keys."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.bytes_read = 0
        self.keys: list[str] = []

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self.inner.get_range(key, start, length)
        self.bytes_read += len(data)
        self.keys.append(key)
        return data

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        placed = self.inner.get_range_into(key, start, buffer)
        self.bytes_read += placed
        self.keys.append(key)
        return placed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _weights(checkpoint: spotckpt.weights.CheckpointFile) -> dict[str, torch.Tensor]:
    return {
        k[len("model.") :]: checkpoint.get_tensor(k) for k in checkpoint if k.startswith("model.")
    }


def _zeroed() -> nn.Module:
    model = make_model()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    return model


def test_tensors_of_a_4_rank_fsdp_save_are_assembled_whole() -> None:
    with spotckpt.open_checkpoint(str(fsdp_checkpoint())) as checkpoint:
        assert checkpoint.step == STEP
        meta = checkpoint.metadata()
        assert meta["step"] == STEP and meta["world_size"] == 4
        assert set(meta) >= {"created_at", "user_metadata", "versions", "format"}
        names = checkpoint.keys()
        assert "model.0.weight" in names and "model.0.weight" in checkpoint
        assert_same(_weights(checkpoint), full_weights())
        assert checkpoint.shape("model.0.weight") == (30, 16)
        assert checkpoint.dtype("model.counts") == torch.int64


@pytest.mark.parametrize(
    "index",
    [
        (slice(3, 17),),  # rows across the ranks' shards (rows 0-7, 8-15, 16-23, 24-29)
        (slice(None), slice(2, 5)),  # columns: every shard, a part of each
        (Ellipsis, 7),
        (-1,),
        (slice(1, None, 4), slice(None, None, 3)),
        (slice(5, 5),),  # nothing
    ],
)
def test_slices_match_the_tensor(index: tuple[Any, ...]) -> None:
    want = full_weights()["0.weight"]
    with spotckpt.open_checkpoint(str(fsdp_checkpoint())) as checkpoint:
        part = checkpoint.get_slice("model.0.weight")
        assert part.get_shape() == [30, 16] and part.get_dtype() == torch.float32
        got = part[index]
    assert torch.equal(got, want[index])


def test_load_weights_fills_a_plain_model_from_4_ranks() -> None:
    model = _zeroed()
    report = spotckpt.load_weights(str(fsdp_checkpoint()), model)
    assert report.step == STEP and report.missing == [] and report.unexpected == []
    assert sorted(report.loaded) == sorted(full_weights())
    assert_same({k: v for k, v in model.state_dict().items()}, full_weights())


def test_load_weights_names_missing_and_unexpected_keys() -> None:
    model = nn.Sequential(make_model(), nn.Linear(2, 2))  # other names: 0.0.weight, ..., 1.weight
    with pytest.raises(KeyMismatchError) as caught:
        spotckpt.load_weights(str(fsdp_checkpoint()), model)
    message = str(caught.value)
    assert "missing from the checkpoint (as 'model.' + key): '0.0.bias', '0.0.weight'" in message
    assert "in the checkpoint but not in the module: '0.bias', '0.weight'" in message
    assert "and 2 more (pass strict=False" in message
    with pytest.raises(KeyMismatchError, match=r"no tensor starts with 'net\.'"):
        spotckpt.load_weights(str(fsdp_checkpoint()), make_model(), prefix="net.")

    loose = make_model()
    loose.extra = nn.Linear(2, 2)  # one module more: its keys are missing, the rest load
    report = spotckpt.load_weights(str(fsdp_checkpoint()), loose, strict=False)
    assert report.missing == ["extra.bias", "extra.weight"] and report.unexpected == []
    assert sorted(report.loaded) == sorted(full_weights())


def test_load_weights_refuses_another_shape_and_casts_dtypes() -> None:
    model = make_model()
    model[0] = nn.Linear(16, 31)
    wrong = r"'model\.0\.bias' has shape \[30\] in step 7, the module's has \[31\]"
    with pytest.raises(InvalidArgumentError, match=wrong):
        spotckpt.load_weights(str(fsdp_checkpoint()), model)
    half = _zeroed().to(torch.bfloat16)
    spotckpt.load_weights(str(fsdp_checkpoint()), half)
    want = full_weights()["0.weight"].to(torch.bfloat16)
    assert torch.equal(half.state_dict()["0.weight"], want)


def test_unknown_names_and_steps_are_refused(tmp_path: Path) -> None:
    with spotckpt.open_checkpoint(str(fsdp_checkpoint())) as checkpoint:
        with pytest.raises(KeyMismatchError, match=r"no tensor 'model\.nope'"):
            checkpoint.get_tensor("model.nope")
        with pytest.raises(InvalidArgumentError, match="out of range"):
            checkpoint.get_slice("model.0.weight")[30]
        with pytest.raises(InvalidArgumentError, match="2 dimensions"):
            checkpoint.get_slice("model.0.weight")[0, 0, 0]
    with pytest.raises(NoCheckpointError, match="step 8 has no committed checkpoint"):
        spotckpt.open_checkpoint(str(fsdp_checkpoint()), step=8)
    with pytest.raises(NoCheckpointError):
        spotckpt.open_checkpoint(str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="storage options go with a URI"):
        spotckpt.open_checkpoint(open_store(str(tmp_path)), endpoint_url="http://x")


def test_a_corrupt_byte_is_a_checksum_error(fsdp_copy: Path) -> None:
    location = Catalog(open_store(str(fsdp_copy))).read_manifest(STEP).tensors["model.0.weight"]
    chunk = location.chunks[1].location  # rank 1's rows
    path = fsdp_copy / step_folder(STEP) / chunk.key
    data = bytearray(path.read_bytes())
    data[chunk.offset + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with spotckpt.open_checkpoint(str(fsdp_copy)) as checkpoint:
        with pytest.raises(ChecksumMismatchError, match=r"model\.0\.weight"):
            checkpoint.get_tensor("model.0.weight")
        assert torch.equal(
            checkpoint.get_slice("model.0.weight")[:8], full_weights()["0.weight"][:8]
        )
    with pytest.raises(CorruptCheckpointError):
        spotckpt.load_weights(str(fsdp_copy), make_model())


def test_a_truncated_object_is_refused(fsdp_copy: Path) -> None:
    record = Catalog(open_store(str(fsdp_copy))).read_manifest(STEP).tensors["model.0.weight"]
    path = fsdp_copy / step_folder(STEP) / record.chunks[2].location.key
    path.write_bytes(path.read_bytes()[:-10])
    with (
        spotckpt.open_checkpoint(str(fsdp_copy)) as checkpoint,
        pytest.raises(CorruptCheckpointError, match="truncated"),
    ):
        checkpoint.get_tensor("model.0.weight")


# One process, a tensor of many CRC blocks: what a slice costs ------------------------------------


@pytest.fixture(params=["local", "s3"])
def big_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, nn.Module]]:
    """A 2 MiB weight (and the rest of a small model) saved by one process as step 3."""
    uri = str(tmp_path / "ckpt") if request.param == "local" else request.getfixturevalue("s3_uri")
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 4))
    manager = CheckpointManager(uri, preemption=False)
    manager.save(3, TrainState(model=model, rng=False), blocking=True)
    manager.close()
    yield uri, model


def test_a_slice_reads_only_its_blocks(big_root: tuple[str, nn.Module]) -> None:
    uri, model = big_root
    weight = model[0].weight.detach()
    store = CountingStore(open_store(uri))
    try:
        with spotckpt.open_checkpoint(store) as checkpoint:  # type: ignore[arg-type]
            manifest_bytes = store.bytes_read
            rows = checkpoint.get_slice("model.0.weight")[100:110]
            sliced = store.bytes_read - manifest_bytes
            whole = checkpoint.get_tensor("model.0.weight")
            read_whole = store.bytes_read - manifest_bytes - sliced
    finally:
        store.inner.close()
    assert torch.equal(rows, weight[100:110]) and torch.equal(whole, weight)
    assert read_whole == weight.numel() * 4
    assert 10 * 512 * 4 <= sliced <= 2 * (64 << 10)  # 20 KiB asked, within at most two blocks
    assert sliced * 10 < read_whole


def test_load_weights_from_s3_and_local(big_root: tuple[str, nn.Module]) -> None:
    uri, model = big_root
    fresh = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 4))
    report = spotckpt.load_weights(uri, fresh, step=3)
    assert report.step == 3
    for (name, got), want in zip(
        fresh.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name


# FSDP2 on 2 ranks: an indexed save to S3, and a load into sharded parameters ---------------------


def _load_sharded(rank: int, uri: str, port: int, world: int) -> None:
    """Each rank loads only its shards into an FSDP2 model; rank 0 checks the whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        model = _zeroed()
        for layer in model.children():
            if isinstance(layer, (nn.Linear, nn.LayerNorm)):
                fully_shard(layer)
        fully_shard(model)
        assert isinstance(model[0].weight, DTensor)
        spotckpt.load_weights(uri, model)
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            assert_same(dict(full), full_weights())
    finally:
        dist.destroy_process_group()


def test_load_weights_into_fsdp_on_2_ranks_from_a_4_rank_save() -> None:
    mp.start_processes(
        _load_sharded,
        args=(str(fsdp_checkpoint()), free_port(), 2),
        nprocs=2,
        join=True,
        start_method="fork",
    )


def test_indexed_2_rank_save_on_s3(s3_uri: str) -> None:
    save_fsdp_checkpoint(s3_uri, world=2, indexed=True)
    store = CountingStore(open_store(s3_uri))
    try:
        with spotckpt.open_checkpoint(store) as checkpoint:  # type: ignore[arg-type]
            assert checkpoint.metadata()["format"] == INDEXED_FORMAT
            assert checkpoint.metadata()["world_size"] == 2
            assert [key.rsplit("/", 1)[-1] for key in store.keys] == ["manifest.json"]
            want = full_weights()["0.weight"]  # rows 0-14 on rank 0, 15-29 on rank 1
            assert torch.equal(checkpoint.get_slice("model.0.weight")[20:], want[20:])
            read = {key.rsplit("/", 1)[-1] for key in store.keys}
            assert read == {"manifest.json", "index-r00001.json", "r00001-000.safetensors"}
            assert_same(_weights(checkpoint), full_weights())
    finally:
        store.inner.close()
    model = _zeroed()
    spotckpt.load_weights(s3_uri, model)
    assert_same(dict(model.state_dict()), full_weights())
