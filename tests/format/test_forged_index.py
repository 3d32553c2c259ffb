"""Forged indexed manifests (``spotckpt/2``): restore falls back, the CLI reports, memory stays
bounded.

Four forked gloo ranks save an FSDP2 model as steps 1 and 2 with the indexed manifest (its
threshold lowered to one rank); each test forges step 2's root or one of its index parts on
disk. The command line runs as child processes under a 3 GiB address-space limit; the restore
runs in this process (one rank), and on four ranks where only one of them needs the damaged part.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from spotckpt import CheckpointManager, TrainState
from spotckpt.checksum import crc32c
from spotckpt.format.index import MAX_PART_BYTES
from spotckpt.format.safetensors_io import block_crcs
from spotckpt.layout import manifest_key, step_folder

from tests_support import SCRIPT, free_port

WORLD = 4
MEMORY_LIMIT = 3 << 30
Document = dict[str, Any]


def make_model(step: int) -> nn.Sequential:
    """12 and 6 rows over 4 ranks: even shards, and uneven ones with an empty last shard."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 6))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(step)
    return model


def _sharded(step: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model(step)
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def _on_ranks(main: Callable[..., None], *args: Any) -> None:
    """`main(rank, *args)` on `WORLD` forked gloo ranks (forked: started at once, torch loaded)."""
    mp.start_processes(
        _rank, args=(main, free_port(), args), nprocs=WORLD, join=True, start_method="fork"
    )


def _rank(rank: int, main: Callable[..., None], port: int, args: tuple[Any, ...]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        torch.set_num_threads(1)
        main(rank, *args)
    finally:
        dist.destroy_process_group()


def _save_steps(_rank: int, uri: str) -> None:
    import spotckpt.engine.writer

    spotckpt.engine.writer.INDEX_MIN_RANKS = 1  # in this forked rank only
    with CheckpointManager(uri, preemption=False) as mgr:
        for step in (1, 2):
            mgr.save(step, TrainState(model=_sharded(step), rng=False))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 of `make_model`, saved by 4 FSDP2 ranks with indexed manifests."""
    folder = tmp_path_factory.mktemp("indexed") / "ck"
    _on_ranks(_save_steps, str(folder))
    return folder


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ck"))


# Forgeries of step 2 ------------------------------------------------------------------------------


def _root(folder: Path) -> Document:
    return dict(json.loads((folder / manifest_key(2)).read_bytes()))


def _put_root(folder: Path, document: Document) -> None:
    (folder / manifest_key(2)).write_bytes(json.dumps(document, separators=(",", ":")).encode())


def _part_path(folder: Path, document: Document, rank: int) -> Path:
    (entry,) = [p for p in document["parts"] if p["rank"] == rank]
    return folder / step_folder(2) / entry["key"]


def _put_part(folder: Path, document: Document, rank: int, part: Document) -> None:
    """Write a forged part, and the root's size and CRC32C of it to match."""
    data = json.dumps(part).encode()
    _part_path(folder, document, rank).write_bytes(data)
    (entry,) = [p for p in document["parts"] if p["rank"] == rank]
    entry.update(size=len(data), crc32c=crc32c(data))


def _crcs(folder: Path, key: str, offset: int, length: int) -> list[int]:
    """Block CRC32Cs of bytes of an object: what anyone who can read it can compute."""
    data = (folder / step_folder(2) / key).read_bytes()[offset : offset + length]
    return list(block_crcs(data, 1 << 16))


def _writer_without_part(folder: Path) -> None:
    document = _root(folder)
    document["parts"] = [p for p in document["parts"] if p["rank"] != 1]
    _put_root(folder, document)


def _writer_without_part_inside_a_run(folder: Path) -> None:
    """The same, with runs whose first and last ranks have parts: rank 1 lies inside."""
    document = _root(folder)
    document["parts"] = [p for p in document["parts"] if p["rank"] != 1]
    split = [t for t in document["tensors"].values() if t["writers"] == [[0, WORLD, 1]]]
    assert split
    for tensor in split:
        tensor["writers"] = [[0, WORLD - 1, 1], [WORLD - 1, 1, 0]]
    _put_root(folder, document)


def _part_deleted(folder: Path) -> None:
    _part_path(folder, _root(folder), 1).unlink()


def _part_in_another_object(folder: Path) -> None:
    """Rank 1's part locates its chunks at rank 0's chunks, in rank 0's object (CRCs copied)."""
    document = _root(folder)
    zero = json.loads(_part_path(folder, document, 0).read_bytes())
    one = json.loads(_part_path(folder, document, 1).read_bytes())
    one["object"] = zero["object"]
    for fqn, entries in one["chunks"].items():
        for entry, theirs in zip(entries, zero["chunks"][fqn], strict=True):
            entry[1:] = theirs[1:]
    _put_part(folder, document, 1, one)
    _put_root(folder, document)


def _chunk_onto_chunk(folder: Path) -> None:
    """In rank 0's part, model.0.bias's 12 bytes are pointed at model.0.weight's first 12."""
    document = _root(folder)
    part = json.loads(_part_path(folder, document, 0).read_bytes())
    ((_offsets, weight_at, _length, _crc),) = part["chunks"]["model.0.weight"]
    (bias,) = part["chunks"]["model.0.bias"]
    bias[1], bias[3] = weight_at, _crcs(folder, part["object"]["key"], weight_at, bias[2])
    _put_part(folder, document, 0, part)
    _put_root(folder, document)


def _value_onto_value(folder: Path) -> None:
    """Rank 1's stored step is pointed at rank 0's, in rank 0's object."""
    document = _root(folder)
    values = document["values"]
    values["train.rank_00001.step"] = dict(values["train.rank_00000.step"])
    _put_root(folder, document)


def _huge_parts(folder: Path) -> None:
    """Every part claimed to be as large as a part may be (256 MiB): read only once confirmed."""
    document = _root(folder)
    for entry in document["parts"]:
        entry["size"] = MAX_PART_BYTES
    _put_root(folder, document)


def _huge_chunk_count(folder: Path) -> None:
    """One tensor of 2**40 one-element chunks, all written by rank 0."""
    document = _root(folder)
    count = 1 << 40
    document["tensors"]["model.0.bias"] = {
        "dtype": "uint8",
        "shape": [count],
        "writers": [[0, count, 0]],
        "grid": [{"every": 1, "count": count}],
    }
    _put_root(folder, document)
    assert len((folder / manifest_key(2)).read_bytes()) < 4096


FORGERIES: dict[str, tuple[Callable[[Path], None], str]] = {
    "writer-without-part": (_writer_without_part, r"names 4 ranks, more than the 3 with an index"),
    "writer-without-part-inside-a-run": (
        _writer_without_part_inside_a_run,
        r"written by rank 1, which has no index part",
    ),
    "part-deleted": (
        _part_deleted,
        r"index part step-000000002/a-\w+/index-r00001\.json .*missing",
    ),
    "part-in-another-object": (_part_in_another_object, r"which is not rank 1's own"),
    "chunk-onto-chunk": (_chunk_onto_chunk, r"of tensor 'model.0.(bias|weight)' overlap bytes"),
    "value-onto-value": (_value_onto_value, r"of value 'train.rank_0000[01].step' overlap bytes"),
    "huge-parts": (_huge_parts, r"index part .+ has \d+ bytes, the manifest says 268435456"),
    "huge-chunk-count": (_huge_chunk_count, r"writer of 1099511627776 chunks, more than its"),
}


# The command line, as users run it, with bounded memory -------------------------------------------


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _cli(folder: Path, *commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """``spotckpt <command> <folder>`` for each command at once, each under `MEMORY_LIMIT`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    children = [
        (
            command,
            subprocess.Popen(
                [str(SCRIPT), command[0], str(folder), *command[1:]],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=_limit_memory,
            ),
        )
        for command in commands
    ]
    results = []
    for command, child in children:
        out, err = child.communicate()
        results.append(subprocess.CompletedProcess(command, child.returncode, out, err))
    return results


def _assert_reported(folder: Path, match: str) -> None:
    """verify fails with the problem, inspect reports it in one line, ls marks the step invalid
    and gc leaves it alone; nothing crashes."""
    verify, inspect, ls, gc = _cli(
        folder,
        ["verify", "--step", "2", "--json"],
        ["inspect", "--step", "2"],
        ["ls", "--json"],
        ["gc", "--dry-run", "--json"],
    )
    assert verify.returncode == 1, (verify.stdout, verify.stderr)
    (problem,) = json.loads(verify.stdout)["problems"]
    assert problem["kind"] == "manifest" and _search(match, problem["message"])
    assert inspect.returncode == 1 and "Traceback" not in inspect.stderr, inspect.stderr
    (line,) = inspect.stderr.strip().splitlines()
    assert line.startswith("spotckpt: error: ") and _search(match, line)
    assert ls.returncode == 0, ls.stderr
    rows = {row["step"]: row for row in json.loads(ls.stdout)["checkpoints"]}
    assert rows[1]["status"] == "committed" and rows[2]["status"] == "invalid"
    assert _search(match, rows[2]["error"])
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    assert report["actions"] == []  # gc needs only the root to know what the step holds


def _search(pattern: str, text: str) -> bool:
    return re.search(pattern, text) is not None


def _restores_step_1(folder: Path) -> None:
    target = make_model(0)
    with CheckpointManager(str(folder), preemption=False) as mgr:
        assert mgr.restore(TrainState(model=target, rng=False)) == 1
    for name, tensor in make_model(1).state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


@pytest.mark.process
def test_the_saved_steps_are_indexed_and_intact(copy: Path) -> None:
    """The control: step 2 is indexed, with an empty last shard (6 rows over 4 ranks), verifies
    and restores."""
    document = _root(copy)
    assert document["format"] == "spotckpt/2" and len(document["parts"]) == WORLD
    assert document["tensors"]["model.1.weight"]["grid"][0] == {"every": 2, "count": WORLD}
    (verify,) = _cli(copy, ["verify", "--step", "2"])
    assert verify.returncode == 0, (verify.stdout, verify.stderr)
    target = make_model(0)
    with CheckpointManager(str(copy), preemption=False) as mgr:
        assert mgr.restore(TrainState(model=target, rng=False)) == 2
    for name, tensor in make_model(2).state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


@pytest.mark.process
@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forged_indexed_step_is_reported_and_restore_falls_back(copy: Path, name: str) -> None:
    forge, match = FORGERIES[name]
    forge(copy)
    _assert_reported(copy, match)
    _restores_step_1(copy)


# Four ranks, of which one needs the missing part --------------------------------------------------


def _restore_on_ranks(rank: int, uri: str, out: str) -> None:
    model = _sharded(0)
    with CheckpointManager(uri, preemption=False) as mgr:
        step = mgr.restore(TrainState(model=model, rng=False))
    steps: list[Any] = [None] * WORLD
    dist.all_gather_object(steps, step)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if rank == 0:
        torch.save({"steps": steps, "state": state}, out)


@pytest.mark.process
def test_every_rank_falls_back_when_one_finds_its_part_missing(copy: Path, tmp_path: Path) -> None:
    """Each rank reads only its own part; rank 1's is gone. Every rank restores step 1, whole,
    never rank 1 step 1 and the others step 2."""
    _part_deleted(copy)
    out = tmp_path / "restored.pt"
    _on_ranks(_restore_on_ranks, str(copy), str(out))
    restored = torch.load(out, weights_only=True)
    assert restored["steps"] == [1] * WORLD
    for name, tensor in make_model(1).state_dict().items():
        assert torch.equal(restored["state"][name], tensor), name
