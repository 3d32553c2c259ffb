"""Standard DCP checkpoints, written by torch's own writers, read from every kind of spotckpt store:
this file covers docs/dcp.md's "Reading standard DCP checkpoints" section.

- Every store (a local folder, memory, S3 on moto, GCS on its emulator, Azure on Azurite, an
  fsspec filesystem): a checkpoint that ``FileSystemWriter`` wrote, uploaded as it is under
  ``step-7/``, loads bit-exact through ``dcp.load`` with `spotckpt.dcp_reader` (that step, and
  the newest one), through `spotckpt.open_checkpoint` and through `CheckpointManager.restore`.
- ``FsspecWriter`` writing straight into S3 (s3fs on moto), read back through `dcp_reader`.
- Two gloo ranks save DTensors sharded by rows with ``FileSystemWriter``; they load them through
  `dcp_reader` sharded by columns, one process loads the whole tensors, and the two ranks restore
  them through `CheckpointManager.restore(step=5)`.

Also the rank script of the two-rank test (run as ``__main__`` by `launch_ranks`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import spotckpt
from spotckpt import CheckpointManager, dcp_writer
from spotckpt.dcp_convert import import_dcp
from spotckpt.engine.dcp_standard import StandardDcpReader
from spotckpt.storage import open_store

from dist_worker import launch_ranks
from tests_support import assert_equal

SERVER = pytest.mark.process
"""The stores that run as servers (their fixtures are asked for by name, so marked here)."""


def _state(seed: int) -> dict[str, Any]:
    """A nested state of several dtypes, a 0-d tensor, non-contiguous views, a list of tensors
    and plain values."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.randn(6, 10, generator=g)
    return {
        "model": {
            "w": torch.randn(5, 7, generator=g),
            "w_bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
            "w_f16": torch.randn(9, generator=g).to(torch.float16),
            "w_f64": torch.randn(3, 2, generator=g, dtype=torch.float64),
            "q": torch.randint(-128, 128, (11,), generator=g, dtype=torch.int8),
            "ids": torch.randint(0, 1 << 40, (4,), generator=g),
            "mask": torch.randint(0, 2, (6,), generator=g).bool(),
            "scale": torch.tensor(3.25 + seed),
            "strided": grid[:, ::3],
            "transposed": grid.t(),
        },
        "layers": [torch.randn(2, 2, generator=g), torch.randn(3, generator=g).bfloat16()],
        "step": 7 + seed,
        "name": f"run-{seed}",
        "schedule": {"lr": 0.5 + seed, "milestones": [1, 2, 3], "kind": "cosine"},
        "history": [1, "two", 3.0],
    }


def _blank(state: Any) -> Any:
    """A destination of `state`'s structure whose every leaf differs from it."""
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, -1) if state.dtype != torch.bool else ~state
    if isinstance(state, dict):
        return {key: _blank(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_blank(value) for value in state]
    return type(state)()


def _tensors(state: Any) -> dict[str, torch.Tensor]:
    """The state's tensors by DCP's flattened names (``model.w``, ``layers.0``)."""
    if isinstance(state, torch.Tensor):
        return {"": state}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        if isinstance(value, (dict, list, torch.Tensor)):
            for name, tensor in _tensors(value).items():
                found[f"{key}.{name}" if name else str(key)] = tensor
    return found


def _upload(local: Path, uri: str, folder: str) -> int:
    """Put every file DCP wrote in `local` under `folder/` of the store at `uri`; the count."""
    store = open_store(uri)
    try:
        files = [p for p in sorted(local.rglob("*")) if p.is_file()]
        for path in files:
            store.put(f"{folder}/{path.relative_to(local).as_posix()}", path.read_bytes())
        return len(files)
    finally:
        store.close()


def _local(tmp_path: Path) -> str:
    return str(tmp_path / "local-root")


def _fsspec(tmp_path: Path) -> str:
    return f"fsspec+file://{tmp_path}/fsspec-root"


STORES: list[Any] = [
    pytest.param(_local, id="local"),
    pytest.param("memory_uri", id="memory"),
    pytest.param("s3_uri", id="s3", marks=SERVER),
    pytest.param("gcs_uri", id="gcs", marks=SERVER),
    pytest.param("az_uri", id="azure", marks=SERVER),
    pytest.param(_fsspec, id="fsspec"),
]


@pytest.fixture(params=STORES)
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The root of a fresh, empty store of each kind."""
    if callable(request.param):
        return str(request.param(tmp_path))
    return str(request.getfixturevalue(request.param))


@pytest.mark.timeout(120)
def test_a_standard_checkpoint_reads_bit_exact_from_every_store(
    store_uri: str, tmp_path: Path
) -> None:
    saved, older = _state(0), _state(1)
    for seed, state in ((7, saved), (3, older)):
        local = tmp_path / f"dcp-{seed}"
        dcp.save(state, storage_writer=FileSystemWriter(local, thread_count=2), no_dist=True)
        assert _upload(local, store_uri, f"step-{seed}") >= 3  # .metadata and two .distcp
    flat = _tensors(saved)

    # (a) dcp.load through dcp_reader(uri, 7); (b) the newest step, which is 7 and not 3.
    for step in (7, None):
        reader = spotckpt.dcp_reader(store_uri, step)
        assert isinstance(reader, StandardDcpReader)
        loaded = _blank(saved)
        dcp.load(loaded, storage_reader=reader, no_dist=True)
        assert_equal(loaded, saved, f"step {step}")
    third = _blank(older)
    dcp.load(third, storage_reader=spotckpt.dcp_reader(store_uri, 3), no_dist=True)
    assert_equal(third, older)

    # (c) open_checkpoint: whole tensors and slices.
    with spotckpt.open_checkpoint(store_uri, 7) as opened:
        assert sorted(opened.keys()) == sorted(flat)
        assert opened.metadata()["step"] == 7
        for name, tensor in flat.items():
            got = opened.get_tensor(name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
        assert torch.equal(opened.get_slice("model.w")[1:4, ::2], flat["model.w"][1:4, ::2])
        assert torch.equal(opened.get_slice("model.strided")[..., 1], flat["model.strided"][:, 1])
        assert torch.equal(opened.get_slice("model.w_bf16")[2], flat["model.w_bf16"][2])
        assert torch.equal(opened.get_slice("model.scale")[...], flat["model.scale"])

    # (d) CheckpointManager.restore of a plain dict, tensors and values alike.
    restored = _blank(saved)
    with CheckpointManager(store_uri, preemption=False) as manager:
        assert manager.restore(restored, step=7) == 7
    assert_equal(restored, saved)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_fsspec_writer_straight_to_s3_reads_back(
    s3_uri: str, s3_bucket: str, moto_endpoint: str
) -> None:
    saved = _state(2)
    writer = FsspecWriter(
        f"s3://{s3_bucket}/ck/step-3",
        key="testing",
        secret="testing",
        client_kwargs={"endpoint_url": moto_endpoint, "region_name": "us-east-1"},
        use_listings_cache=False,
        skip_instance_cache=True,
    )
    dcp.save(saved, storage_writer=writer, no_dist=True)
    loaded = _blank(saved)
    reader = spotckpt.dcp_reader(f"s3://{s3_bucket}/ck", 3)
    assert isinstance(reader, StandardDcpReader)
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert_equal(loaded, saved)


# Two ranks -------------------------------------------------------------------------------------

ROWS, COLUMNS = 5, 7
"""A global shape that splits unevenly over two ranks by rows and by columns."""


def _full(name: str) -> torch.Tensor:
    """The whole tensor `name` of the two-rank state (the same on every rank)."""
    g = torch.Generator().manual_seed(len(name))
    tensor = torch.randn(ROWS, COLUMNS, generator=g)
    return tensor.bfloat16() if name == "w_bf16" else tensor


def _rank_state(mesh: Any, placement: Any, blank: bool) -> dict[str, Any]:
    def full(name: str) -> torch.Tensor:
        return torch.zeros_like(_full(name)) if blank else _full(name)

    return {
        "w": distribute_tensor(full("w"), mesh, [placement]),
        "w_bf16": distribute_tensor(full("w_bf16"), mesh, [placement]),
        "replicated": torch.zeros(6) if blank else torch.arange(6.0) * 1.5,
        "epoch": 0 if blank else 12,
    }


def _check_rank_state(state: dict[str, Any], placement: Any, rank: int) -> None:
    for name in ("w", "w_bf16"):
        dtensor = state[name]
        assert isinstance(dtensor, DTensor) and dtensor.placements == (placement,), name
        expected = _full(name)
        if isinstance(placement, Shard):
            expected = torch.tensor_split(expected, 2, dim=placement.dim)[rank]
        local = dtensor.to_local()
        assert local.dtype == expected.dtype and torch.equal(local, expected), (name, rank)
    assert torch.equal(state["replicated"], torch.arange(6.0) * 1.5)
    assert state["epoch"] == 12


@pytest.mark.process
@pytest.mark.timeout(240)
def test_two_ranks_save_dtensors_and_read_them_resharded(tmp_path: Path) -> None:
    """Saved by two ranks with FileSystemWriter: read resharded through dcp_reader, restored by
    the manager, imported and restored resharded; and two ranks overwriting a spotckpt step
    (the third save, without overwrite, refused on every rank)."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    args = {
        "root": str(root),
        "out": str(out),
        "imported": str(tmp_path / "imported"),
        "overwritten": str(tmp_path / "overwritten"),
    }
    for rank, result in enumerate(launch_ranks(2, "ranks", args, timeout=180, worker=__file__)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    for rank in (0, 1):
        parts = json.loads((out / f"rank{rank}.json").read_text())
        assert set(parts.values()) == {"ok"} and len(parts) == 4, f"rank {rank}: {parts}"
    assert sorted(p.name for p in (root / "step-5").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    # (b) one process, no group: the whole tensors from the two ranks' shards.
    whole = {
        "w": torch.zeros(ROWS, COLUMNS),
        "w_bf16": torch.zeros(ROWS, COLUMNS, dtype=torch.bfloat16),
        "replicated": torch.zeros(6),
        "epoch": 0,
    }
    dcp.load(whole, storage_reader=spotckpt.dcp_reader(str(root), 5), no_dist=True)
    assert_equal(
        whole,
        {
            "w": _full("w"),
            "w_bf16": _full("w_bf16"),
            "replicated": torch.arange(6.0) * 1.5,
            "epoch": 12,
        },
    )


def _part(results: dict[str, str], name: str, run: Callable[[], None]) -> None:
    """Run one part of a rank's scenario, recording ``ok`` or its traceback (the next part
    still runs)."""
    try:
        run()
        results[name] = "ok"
    except Exception:
        results[name] = traceback.format_exc()[-3000:]


def ranks(rank: int, world: int, args: dict[str, Any]) -> None:
    """One rank: save the state sharded by rows with torch's FileSystemWriter into
    ``root/step-5``; (a) load it sharded by columns through dcp_reader; (c) restore it
    replicated through CheckpointManager.restore(step=5)."""
    mesh = init_device_mesh("cpu", (world,))
    root = Path(args["root"])
    dcp.save(
        _rank_state(mesh, Shard(0), blank=False), storage_writer=FileSystemWriter(root / "step-5")
    )
    dist.barrier()
    results: dict[str, str] = {}

    def resharded() -> None:
        state = _rank_state(mesh, Shard(1), blank=True)
        dcp.load(state, storage_reader=spotckpt.dcp_reader(str(root), 5))
        _check_rank_state(state, Shard(1), rank)

    def restored() -> None:
        state = _rank_state(mesh, Replicate(), blank=True)
        with CheckpointManager(str(root), preemption=False) as manager:
            if manager.restore(state, step=5) != 5:
                raise AssertionError("restore did not return step 5")
        _check_rank_state(state, Replicate(), rank)

    def imported() -> None:
        if rank == 0:
            import_dcp(open_store(str(root)), open_store(args["imported"]), step=5)
        dist.barrier()
        state = _rank_state(mesh, Shard(1), blank=True)
        with CheckpointManager(args["imported"], preemption=False) as manager:
            if manager.restore(state) != 5:
                raise AssertionError("the imported step did not restore")
        _check_rank_state(state, Shard(1), rank)

    def overwritten() -> None:
        uri = args["overwritten"]
        dcp.save(_rank_state(mesh, Shard(0), blank=True), storage_writer=dcp_writer(uri, 1))
        dcp.save(
            _rank_state(mesh, Shard(0), blank=False),
            storage_writer=dcp_writer(uri, 1, overwrite=True),
        )
        try:
            dcp.save(_rank_state(mesh, Shard(0), blank=True), storage_writer=dcp_writer(uri, 1))
        except CheckpointException as error:
            if "CheckpointAlreadyCommittedError" not in str(error):
                raise
        else:
            raise AssertionError("a third save without overwrite replaced the step")
        state = _rank_state(mesh, Shard(1), blank=True)
        dcp.load(state, storage_reader=spotckpt.dcp_reader(uri, 1))
        _check_rank_state(state, Shard(1), rank)

    for name, part in [
        ("resharded", resharded),
        ("restored", restored),
        ("imported", imported),
        ("overwritten", overwritten),
    ]:
        _part(results, name, part)
        dist.barrier()
    (Path(args["out"]) / f"rank{rank}.json").write_text(json.dumps(results))


def main() -> None:
    scenario, rank, world, port, raw = sys.argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    {"ranks": ranks}[scenario](int(rank), int(world), json.loads(raw))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
