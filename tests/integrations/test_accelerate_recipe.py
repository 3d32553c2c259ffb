"""docs/accelerate.md's recipe: `TrainState` of `accelerator.prepare`d objects, SIGTERM, resume.

tests/accelerate_worker.py trains a small classifier (dropout, AdamW, LambdaLR, shuffled
`StatefulDataLoader`, 2 accumulated batches a step, 6 steps an epoch) for 14 steps, saving every
3. SIGTERM'd at the end of step K it must commit step K and exit with status 75; started again it
must end with every parameter and optimizer tensor equal to an uninterrupted run's. The stops are
in epoch 0, at an epoch's end and in later epochs, over each loader set-up (torchdata's sampler,
torch's ``RandomSampler(generator=)``, a `SeededDataset` with augmentation), with and without
loader workers (the signal then goes to the whole process group, workers included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spotckpt import PREEMPTED_EXIT_CODE

from framework_runs import committed_steps, digest, run, run_preempted, tail

SETUPS = {  # loader set-up -> worker processes
    "torchdata": 0,
    "torch-sampler": 0,
    "augment": 2,
}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict[str, Any]]:
    """An uninterrupted run of each loader set-up."""
    found = {}
    for loader, workers in SETUPS.items():
        out = tmp_path_factory.mktemp("accelerate") / "reference"
        options = ("--loader", loader, "--workers", str(workers))
        done = run("accelerate_worker.py", str(out.parent / "reference-ckpt"), out, *options)
        assert done.returncode == 0, tail(out)
        found[loader, workers] = digest(out)
    return found


@pytest.mark.process
@pytest.mark.parametrize(
    ("loader", "stop_at"),
    [
        ("torchdata", 4),
        ("torchdata", 6),
        ("torch-sampler", 3),
        ("torch-sampler", 8),
        ("torch-sampler", 12),
        ("augment", 3),
        ("augment", 9),
        ("augment", 12),
    ],
    ids=lambda value: str(value),
)
def test_sigterm_exit_75_and_bit_identical_resume(
    tmp_path: Path,
    references: dict[tuple[str, int], dict[str, Any]],
    loader: str,
    stop_at: int,
) -> None:
    """Steps 1-6 are epoch 0 (6 ends it), 7-12 epoch 1 (12 ends it).

    Mirrors docs/accelerate.md's recipe, as printed (tests/accelerate_worker.py).
    """
    workers = SETUPS[loader]
    options = ("--loader", loader, "--workers", str(workers))
    uri, out = str(tmp_path / "ckpt"), tmp_path / "spot"
    status = run_preempted("accelerate_worker.py", uri, out, stop_at, *options, group=workers > 0)
    assert status == PREEMPTED_EXIT_CODE, tail(out)
    assert committed_steps(uri)[-1] == stop_at
    resumed = run("accelerate_worker.py", uri, out, *options)
    assert resumed.returncode == 0, tail(out)
    result, reference = digest(out), references[loader, workers]
    assert result["step"] == reference["step"] == 14
    assert len(result["tensors"]) == len(reference["tensors"]) == 16
    different = [n for n, sha in reference["tensors"].items() if result["tensors"][n] != sha]
    assert not different, f"{len(different)} tensors differ: {different}"


def test_a_prepared_plain_loader_is_refused_naming_the_setting() -> None:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from spotckpt import TrainState
    from spotckpt.errors import InvalidTypeError

    loader = Accelerator(cpu=True).prepare(DataLoader(list(range(8)), batch_size=2))
    with pytest.raises(InvalidTypeError, match="use_stateful_dataloader=True"):
        TrainState(model=torch.nn.Linear(1, 1), dataloader=loader)
