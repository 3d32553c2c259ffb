"""Checkpoints of FSDP2 models saved by 4 gloo ranks, shared by the export, verify/gc and CLI tests.

Each is made once per test session (`fsdp_checkpoint`, `tied_checkpoint`, ~5 s each) by forking
the ranks on the CPU; tests take private copies (the ``fsdp_copy`` and ``tied_copy`` fixtures of
this folder's conftest) before changing anything.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from spotckpt import CheckpointManager, TrainState

from tests_support import free_port

WORLD = 4
STEP = 7
SEED = 1234
VOCAB, DIM = 30, 16


def make_model() -> nn.Sequential:
    """Rows not divisible by 4 (uneven shards) and a 3-row layer (one rank holds nothing)."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 3), nn.LayerNorm(3))
    model.register_buffer("counts", torch.arange(10, dtype=torch.int64))
    return model


class TinyLM(nn.Module):
    """A causal LM named as Hugging Face names one; its head is its input embeddings when tied."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.model.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def full_weights() -> dict[str, torch.Tensor]:
    """The unsharded model's tensors by HF name (no ``model.`` prefix)."""
    return {k: v.detach().clone() for k, v in make_model().state_dict().items()}


def tied_weights() -> dict[str, torch.Tensor]:
    """What an export of `TinyLM` holds: every tensor but ``lm_head.weight``, as save_pretrained."""
    state = TinyLM().state_dict()
    return {k: v.detach().clone() for k, v in state.items() if k != "lm_head.weight"}


def _rank_main(rank: int, uri: str, port: int, tied: bool, world: int, indexed: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    if indexed:  # the indexed manifest without a thousand ranks (this forked process only)
        import spotckpt.engine.writer

        spotckpt.engine.writer.INDEX_MIN_RANKS = 1
    try:
        torch.set_num_threads(1)
        model: nn.Module
        if tied:  # a shared parameter must stay in one FSDP group: only the root is sharded
            model = TinyLM()
        else:
            model = make_model()
            for layer in model.children():
                if isinstance(layer, (nn.Linear, nn.LayerNorm)):
                    fully_shard(layer)
        fully_shard(model)
        manager = CheckpointManager(uri, preemption=False)
        manager.save(STEP, TrainState(model=model, rng=False))
        manager.close()
    finally:
        dist.destroy_process_group()


def save_fsdp_checkpoint(
    uri: str, tied: bool = False, world: int = WORLD, indexed: bool = False
) -> None:
    """Save `make_model()` (or a tied `TinyLM`) as step 7 from `world` FSDP2 ranks (gloo, CPU),
    with an indexed manifest when `indexed`.

    The ranks are forked, not spawned: four fresh interpreters importing torch at once cost tens
    of seconds on a 2-core machine; forked ones start at once with everything imported.
    """
    mp.start_processes(
        _rank_main,
        args=(uri, free_port(), tied, world, indexed),
        nprocs=world,
        join=True,
        start_method="fork",
    )


def _session_checkpoint(tied: bool) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="spotckpt-fsdp-"))
    atexit.register(shutil.rmtree, folder, True)
    save_fsdp_checkpoint(str(folder / "ckpt"), tied)
    return folder / "ckpt"


@functools.cache
def fsdp_checkpoint() -> Path:
    """A local folder holding the 4-rank checkpoint, made once per test session."""
    return _session_checkpoint(tied=False)


@functools.cache
def tied_checkpoint() -> Path:
    """A local folder holding a 4-rank checkpoint of a tied `TinyLM`, made once per session."""
    return _session_checkpoint(tied=True)


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bits."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(raw_bits(got[name]), raw_bits(tensor)), name
