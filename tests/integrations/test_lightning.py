"""`SpotckptCallback` with the real Lightning: SIGTERM, restart, and a bit-identical end.

Each run is `lightning_worker.py` as a child process: a reference run trains uninterrupted; a
second run is sent SIGTERM once it reports a chosen step (mid-epoch), must exit with status 75
after committing that step, and a third run of the same command must resume there and end with
the reference's parameters, optimizer state (every AdamW moment, under the same integer keys),
scheduler state and RNG, bit for bit. Gradient accumulation and a loader whose sampler shares
its generator run in-process.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.integrations.lightning import (
    pack_checkpoint,
    unpack_checkpoint,
)
from spotckpt.values import UnsupportedValueError

from lightning_worker import run
from tests_support import TESTS

WORKER = TESTS / "lightning_worker.py"
TIMEOUT_S = 600  # a guard against hangs only: runs take seconds
STEPS = 20  # 8 batches an epoch: resumes cross two epoch boundaries


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}


def _start(uri: str, out: Path, *args: str, group: bool = False) -> subprocess.Popen[bytes]:
    """The worker; with `group`, in a process group of its own (its loader workers too)."""
    command = [sys.executable, str(WORKER), uri, str(out), "--steps", str(STEPS), *args]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_env(),
        cwd=WORKER.parent,
        start_new_session=group,
    )


def _read_until(process: subprocess.Popen[bytes], marker: bytes) -> bytes:
    """The worker's output up to `marker` (which it prints once it reached the step)."""
    assert process.stdout is not None
    seen = b""
    deadline = time.monotonic() + TIMEOUT_S
    while marker not in seen:
        ready, _, _ = select.select([process.stdout], [], [], deadline - time.monotonic())
        chunk = os.read(process.stdout.fileno(), 1 << 16) if ready else b""
        if not chunk:
            process.kill()
            process.wait()
            raise AssertionError(f"the worker never printed {marker!r}:\n{seen.decode()}")
        seen += chunk
    return seen


def _finish(process: subprocess.Popen[bytes], expected: int) -> str:
    output, _ = process.communicate(timeout=TIMEOUT_S)
    text = output.decode(errors="replace")
    assert process.returncode == expected, text
    return text


def _load(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _losses(out: Path) -> list[tuple[int, int, str]]:
    """(step, epoch, loss) of each batch."""
    lines = (out / "losses.jsonl").read_text().splitlines()
    return [(entry["step"], entry["epoch"], entry["loss"]) for entry in map(json.loads, lines)]


def _same_bits(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    if expected.dtype != actual.dtype or expected.shape != actual.shape:
        return False
    raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (expected, actual)]
    return torch.equal(*raw)


def assert_same_state(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    """Step, parameters, every optimizer moment (same key types), scheduler and RNG, bit for bit."""
    assert actual["step"] == expected["step"]
    assert actual["params"].keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        assert _same_bits(value, actual["params"][name]), name
    moments, restored = expected["optimizer"]["state"], actual["optimizer"]["state"]
    assert len(moments) == 4  # four parameters, so four sets of AdamW moments
    assert [(type(k), k) for k in restored] == [(type(k), k) for k in moments]
    for index, state in moments.items():
        assert sorted(restored[index]) == sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
        for name, value in state.items():
            assert _same_bits(value, restored[index][name]), (index, name)
    assert actual["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert actual["scheduler"] == expected["scheduler"]
    assert _same_bits(expected["rng"], actual["rng"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run, with its state after steps 5 and 7 (where the others stop)."""
    root = tmp_path_factory.mktemp("reference")
    process = _start(str(root / "ck"), root / "out", "--dump-at", "5", "7")
    _finish(process, 0)
    return root / "out"


@pytest.mark.process
@pytest.mark.parametrize(
    ("store", "wait_in", "stop_at", "options"),
    [
        ("local", "callback", 5, []),
        ("local", "module", 7, []),
        ("s3", "callback", 5, ["--async-save"]),
    ],
    ids=["sigterm-seen-by-the-callback", "sigterm-after-its-check", "s3-async"],
)
def test_sigterm_and_restart_end_bit_identical(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    reference: Path,
    store: str,
    wait_in: str,
    stop_at: int,
    options: list[str],
) -> None:
    """Mirrors docs/lightning.md's recipe: the callback in a real Trainer, cut and resumed."""
    uri = str(tmp_path / "ck") if store == "local" else request.getfixturevalue("s3_uri")
    killed = _start(
        uri, tmp_path / "killed", "--wait-at", str(stop_at), "--wait-in", wait_in, *options
    )
    _read_until(killed, f"waiting at step {stop_at}".encode())
    killed.send_signal(signal.SIGTERM)
    log = _finish(killed, 75)
    assert f"emergency save of step {stop_at} committed" in log
    with CheckpointManager(uri, preemption=False) as manager:
        assert manager.latest_step() == stop_at

    _finish(_start(uri, tmp_path / "resumed", *options), 0)

    resumed = tmp_path / "resumed"
    assert_same_state(_load(reference / f"at-{stop_at}.pt"), _load(resumed / "start.pt"))
    assert_same_state(_load(reference / "final.pt"), _load(resumed / "final.pt"))
    assert _losses(resumed) == _losses(reference)[stop_at:]
    assert _losses(tmp_path / "killed") == _losses(reference)[:stop_at]


@pytest.fixture(scope="module")
def reference_with_workers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run with 2 loader workers."""
    root = tmp_path_factory.mktemp("reference-workers")
    _finish(_start(str(root / "ck"), root / "out", "--workers", "2"), 0)
    return root / "out"


@pytest.mark.process
@pytest.mark.parametrize("stop_at", [5, 11], ids=["epoch-0", "epoch-1"])
def test_sigterm_to_the_process_group_with_loader_workers(
    tmp_path: Path, reference_with_workers: Path, stop_at: int
) -> None:
    """As torchrun, SLURM and Kubernetes deliver it: the loader's 2 workers get SIGTERM too, and
    must outlive it until the emergency save is in."""
    reference = reference_with_workers
    uri = str(tmp_path / "ck")
    workers = ("--workers", "2")
    killed = _start(uri, tmp_path / "killed", "--wait-at", str(stop_at), *workers, group=True)
    _read_until(killed, f"waiting at step {stop_at}".encode())
    os.killpg(killed.pid, signal.SIGTERM)
    log = _finish(killed, 75)
    assert f"emergency save of step {stop_at} committed" in log
    assert "killed by signal" not in log
    _finish(_start(uri, tmp_path / "resumed", *workers), 0)
    assert_same_state(_load(reference / "final.pt"), _load(tmp_path / "resumed" / "final.pt"))
    assert _losses(tmp_path / "resumed") == _losses(reference)[stop_at:]


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo what a Trainer run changes in this process: deterministic mode, seed variables."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for name in [k for k in os.environ if k.startswith("SPOTCKPT_")]:
        monkeypatch.delenv(name)
    yield
    torch.use_deterministic_algorithms(deterministic)


@pytest.mark.process
def test_a_notice_while_accumulating_saves_at_the_next_optimizer_step(
    tmp_path: Path, in_process: None
) -> None:
    common: dict[str, Any] = {"steps": 6, "interval": None, "accumulate": 2}
    run(str(tmp_path / "ref-ck"), tmp_path / "ref", **common)
    uri = str(tmp_path / "ck")
    with pytest.raises(SystemExit) as stopped:
        run(uri, tmp_path / "killed", trigger_at_batch=5, **common)  # batch 5 only accumulates
    assert stopped.value.code == 75
    with CheckpointManager(uri, preemption=False) as manager:
        assert manager.steps() == [3]  # saved after batch 6, which stepped the optimizer
    run(uri, tmp_path / "resumed", **common)
    assert_same_state(
        _load(tmp_path / "ref" / "final.pt"), _load(tmp_path / "resumed" / "final.pt")
    )
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "ref")[6:]


@pytest.mark.process
def test_a_loader_sharing_its_generator_with_its_sampler_resumes_exactly_in_a_later_epoch(
    tmp_path: Path, in_process: None
) -> None:
    """``shuffle=True, generator=g``: the sampler and the workers' base seed draw from `g`."""
    common: dict[str, Any] = {"steps": STEPS, "interval": None, "shared_generator": True}
    run(str(tmp_path / "ref-ck"), tmp_path / "ref", **common)
    uri = str(tmp_path / "ck")
    with pytest.raises(SystemExit) as stopped:
        run(uri, tmp_path / "killed", trigger_at_batch=11, **common)  # batch 3 of epoch 1
    assert stopped.value.code == 75
    with CheckpointManager(uri, preemption=False) as manager:
        assert manager.steps() == [11]
    run(uri, tmp_path / "resumed", **common)
    assert_same_state(
        _load(tmp_path / "ref" / "final.pt"), _load(tmp_path / "resumed" / "final.pt")
    )
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "ref")[11:]


def _epochs(out: Path) -> list[tuple[int, int]]:
    return [(step, epoch) for step, epoch, _ in _losses(out)]


def _cut_at(tmp_path: Path, stop_at: int) -> tuple[Path, Path]:
    """A reference, and a run preempted at batch `stop_at` then resumed: their out folders."""
    common: dict[str, Any] = {"steps": STEPS, "interval": None}
    run(str(tmp_path / "ref-ck"), tmp_path / "ref", **common)
    uri = str(tmp_path / "ck")
    with pytest.raises(SystemExit) as stopped:
        run(uri, tmp_path / "killed", trigger_at_batch=stop_at, **common)
    assert stopped.value.code == 75
    run(uri, tmp_path / "resumed", **common)
    return tmp_path / "ref", tmp_path / "resumed"


@pytest.mark.process
@pytest.mark.parametrize("stop_at", [8, 16], ids=["end-of-epoch-0", "end-of-epoch-1"])
def test_a_save_at_an_epochs_last_batch_resumes_into_the_next_epoch_once(
    tmp_path: Path, in_process: None, stop_at: int
) -> None:
    """8 batches an epoch: the save is at the end of an epoch's last batch (Lightning's own
    restart from such a save counts that epoch twice, and current_epoch came back one high)."""
    reference, resumed = _cut_at(tmp_path, stop_at)
    assert _epochs(resumed) == _epochs(reference)[stop_at:]


@pytest.mark.process
@pytest.mark.parametrize("stop_at", [8, 16], ids=["end-of-epoch-0", "end-of-epoch-1"])
def test_a_save_at_an_epochs_last_batch_resumes_bit_identically(
    tmp_path: Path, in_process: None, stop_at: int
) -> None:
    """The uninterrupted run never asks the finished epoch's iterator for more; the resumed run
    does once, and torch's RandomSampler would draw as it ends: that draw must not happen."""
    reference, resumed = _cut_at(tmp_path, stop_at)
    assert _losses(resumed) == _losses(reference)[stop_at:]


@pytest.mark.process
@pytest.mark.parametrize(
    "first",
    [12, 16],
    ids=["ends-mid-epoch", "ends-with-an-epoch"],
)
def test_a_finished_fit_continues_with_more_steps_as_one_longer_fit(
    tmp_path: Path, in_process: None, first: int
) -> None:
    """The last step is saved where its epoch is still open: a fit to more steps finishes it."""
    run(str(tmp_path / "ref-ck"), tmp_path / "ref", steps=STEPS, interval=None)
    uri = str(tmp_path / "ck")
    run(uri, tmp_path / "first", steps=first, interval=None)
    run(uri, tmp_path / "more", steps=STEPS, interval=None)
    assert _epochs(tmp_path / "more") == _epochs(tmp_path / "ref")[first:]
    assert _losses(tmp_path / "more") == _losses(tmp_path / "ref")[first:]
    assert_same_state(_load(tmp_path / "ref" / "final.pt"), _load(tmp_path / "more" / "final.pt"))


def test_the_packed_checkpoint_keeps_key_types_and_refuses_objects() -> None:
    checkpoint = {"loops": {0: {"1": 2, 1: [3.5, None]}}, "tensor": torch.arange(3), "t": (1,)}
    unpacked = unpack_checkpoint(pack_checkpoint(checkpoint))
    assert [(type(k), k) for k in unpacked["loops"][0]] == [(str, "1"), (int, 1)]
    assert unpacked["loops"][0][1] == [3.5, None]
    assert torch.equal(unpacked["tensor"], checkpoint["tensor"])
    assert unpacked["t"] == (1,)
    with pytest.raises(UnsupportedValueError, match=r"lightning\.callbacks"):
        pack_checkpoint({"callbacks": object()})


@pytest.mark.process
def test_import_spotckpt_does_not_import_lightning() -> None:
    code = "import sys, spotckpt, spotckpt.integrations; print('lightning' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, env=_env()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.process
def test_binds_to_pytorch_lightning_when_lightning_is_absent(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["lightning"] = None  # as if only pytorch_lightning were installed
        import pytorch_lightning as pl
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        from spotckpt import CheckpointManager
        from spotckpt.integrations.lightning import SpotckptCallback

        class Net(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)
            def training_step(self, batch, batch_idx):
                return self.layer(batch[0]).square().mean()
            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters())

        data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
        for steps in (2, 3):
            trainer = pl.Trainer(max_steps=steps, logger=False, enable_progress_bar=False,
                                 enable_model_summary=False,
                                 callbacks=[SpotckptCallback({str(tmp_path)!r}, interval_steps=1)])
            trainer.fit(Net(), train_dataloaders=data)
        assert isinstance(trainer.callbacks[-1], SpotckptCallback)  # ordered as a Checkpoint
        print(CheckpointManager({str(tmp_path)!r}, preemption=False).steps())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, env=_env()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[1, 2, 3]"
