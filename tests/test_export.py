"""export_hf: weights saved sharded by 4 FSDP2 ranks come out as Hugging Face safetensors whole.

The 4-rank checkpoint is made once per session (`fsdp_checkpoint`, ~5 s) by spawning gloo ranks
on the CPU; tests copy it before changing anything. test_verify_gc and test_cli use it too.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load, load_file
from torch import nn

from spotckpt import CheckpointManager, CorruptCheckpointError, NoCheckpointError, TrainState
from spotckpt.catalog import manifest_key
from spotckpt.export import export_hf, plan_shards, shard_names
from spotckpt.format.dtypes import BY_NAME
from spotckpt.format.manifest import Manifest
from spotckpt.format.safetensors_io import TensorSpec
from spotckpt.storage import AlreadyExistsError, open_store

WORLD = 4
STEP = 7
SEED = 1234


def make_model() -> nn.Sequential:
    """Rows not divisible by 4 (uneven shards) and a 3-row layer (one rank holds nothing)."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 3), nn.LayerNorm(3))
    model.register_buffer("counts", torch.arange(10, dtype=torch.int64))
    return model


def full_weights() -> dict[str, torch.Tensor]:
    """The unsharded model's tensors by HF name (no ``model.`` prefix)."""
    return {k: v.detach().clone() for k, v in make_model().state_dict().items()}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, uri: str, port: int) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        torch.set_num_threads(1)
        model = make_model()
        for layer in model:
            if isinstance(layer, (nn.Linear, nn.LayerNorm)):
                fully_shard(layer)
        fully_shard(model)
        manager = CheckpointManager(uri, preemption=False)
        manager.save(STEP, TrainState(model=model, rng=False))
        manager.close()
    finally:
        dist.destroy_process_group()


def save_fsdp_checkpoint(uri: str) -> None:
    """Save `make_model()` as step 7 from 4 FSDP2 ranks (gloo, CPU).

    The ranks are forked, not spawned: four fresh interpreters importing torch at once cost tens
    of seconds on a 2-core machine; forked ones start at once with everything imported.
    """
    mp.start_processes(
        _rank_main, args=(uri, _free_port()), nprocs=WORLD, join=True, start_method="fork"
    )


@functools.cache
def fsdp_checkpoint() -> Path:
    """A local folder holding the 4-rank checkpoint, made once per test session."""
    folder = Path(tempfile.mkdtemp(prefix="spotckpt-fsdp-"))
    atexit.register(shutil.rmtree, folder, True)
    save_fsdp_checkpoint(str(folder / "ckpt"))
    return folder / "ckpt"


@pytest.fixture
def fsdp_copy(tmp_path: Path) -> Path:
    """A private copy of the 4-rank checkpoint."""
    return Path(shutil.copytree(fsdp_checkpoint(), tmp_path / "ckpt"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bits."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(_bits(got[name]), _bits(tensor)), name


def test_checkpoint_really_is_sharded_by_four_ranks(fsdp_copy: Path) -> None:
    manifest = Manifest.from_json((fsdp_copy / manifest_key(STEP)).read_bytes())
    assert manifest.world_size == WORLD
    assert len({o.rank for o in manifest.objects.values()}) == WORLD
    weight = manifest.tensors["model.0.weight"]
    assert weight.shape == (30, 16)
    assert sorted(c.sizes[0] for c in weight.chunks) == [6, 8, 8, 8]


def test_export_single_file_matches_unsharded_model(fsdp_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    seen: list[tuple[int, int]] = []
    report = export_hf(
        open_store(str(fsdp_copy)), STEP, str(out), progress=lambda d, t: seen.append((d, t))
    )
    assert report.files == ["model.safetensors"] and report.index is None
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    want = full_weights()
    assert_same(load_file(out / "model.safetensors"), want)
    assert report.total_size == sum(t.numel() * t.element_size() for t in want.values())
    assert seen[-1] == (report.total_size, report.total_size)


def test_sharded_export_writes_index(fsdp_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    report = export_hf(open_store(str(fsdp_copy)), STEP, str(out), max_shard_size=1000)
    count = len(report.files)
    assert count >= 3
    expected = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert report.files == expected
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([*expected, "model.safetensors.index.json"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    want = full_weights()
    assert index["metadata"] == {
        "total_size": sum(t.numel() * t.element_size() for t in want.values())
    }
    assert sorted(index["weight_map"]) == sorted(want)
    loaded: dict[str, torch.Tensor] = {}
    for name in expected:
        part = load_file(out / name)
        assert all(index["weight_map"][k] == name for k in part)
        nbytes = sum(t.numel() * t.element_size() for t in part.values())
        assert nbytes <= 1000 or len(part) == 1
        loaded.update(part)
    assert_same(loaded, want)


def test_dtype_cast_touches_floats_only(fsdp_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_hf(open_store(str(fsdp_copy)), STEP, str(out), dtype=torch.bfloat16)
    want = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full_weights().items()
    }
    got = load_file(out / "model.safetensors")
    assert got["counts"].dtype == torch.int64
    assert_same(got, want)


def test_keep_prefix_and_unknown_prefix(fsdp_copy: Path, tmp_path: Path) -> None:
    store = open_store(str(fsdp_copy))
    export_hf(store, STEP, str(tmp_path / "kept"), strip_prefix=False)
    got = load_file(tmp_path / "kept" / "model.safetensors")
    assert sorted(got) == sorted(f"model.{k}" for k in full_weights())
    with pytest.raises(ValueError, match=r"no tensor of step 7 starts with 'encoder\.'.*model\."):
        export_hf(store, STEP, str(tmp_path / "none"), prefix="encoder.")
    with pytest.raises(NoCheckpointError, match="step 8"):
        export_hf(store, 8, str(tmp_path / "none"))


def test_corrupt_chunk_is_refused(fsdp_copy: Path, tmp_path: Path) -> None:
    manifest = Manifest.from_json((fsdp_copy / manifest_key(STEP)).read_bytes())
    chunk = next(c for c in manifest.tensors["model.0.weight"].chunks if c.sizes[0])
    path = fsdp_copy / f"step-{STEP:09d}" / chunk.location.key
    data = bytearray(path.read_bytes())
    data[chunk.location.offset + 5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"CRC32C mismatch.*model\.0\.weight"):
        export_hf(open_store(str(fsdp_copy)), STEP, str(tmp_path / "hf"))


def test_existing_export_needs_overwrite(fsdp_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    store = open_store(str(fsdp_copy))
    export_hf(store, STEP, str(out), max_shard_size=1000)
    with pytest.raises(AlreadyExistsError, match="overwrite"):
        export_hf(store, STEP, str(out))
    export_hf(store, STEP, str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert_same(load_file(out / "model.safetensors"), full_weights())


def test_export_to_s3(fsdp_copy: Path, s3_uri: str, s3_client: Any, s3_bucket: str) -> None:
    out = open_store(f"{s3_uri}-hf")
    report = export_hf(open_store(str(fsdp_copy)), STEP, out, max_shard_size=1000)
    key = f"runs/exp1-hf/{report.files[0]}"
    part = load(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    want = full_weights()
    for name, tensor in part.items():
        assert torch.equal(_bits(tensor), _bits(want[name]))
    index = s3_client.get_object(Bucket=s3_bucket, Key="runs/exp1-hf/model.safetensors.index.json")
    assert sorted(json.loads(index["Body"].read())["weight_map"]) == sorted(want)


def test_plan_shards_is_greedy_and_isolates_big_tensors() -> None:
    f32 = BY_NAME["float32"]
    specs = [TensorSpec(n, f32, (s,)) for n, s in [("a", 10), ("b", 10), ("c", 100), ("d", 1)]]
    shards = plan_shards(specs, 80)
    assert [[s.name for s in shard] for shard in shards] == [["a", "b"], ["c"], ["d"]]
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(2) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
