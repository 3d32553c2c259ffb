"""The README's Accelerate recipe: `TrainState` of `accelerator.prepare`d objects, SIGTERM, resume.

tests/accelerate_worker.py trains a small classifier (dropout, AdamW, LambdaLR, shuffled
`StatefulDataLoader`, 2 accumulated batches a step, 6 steps an epoch) for 14 steps, saving every
3. SIGTERM'd at the end of step K it must commit step K and exit with status 75; started again it
must end with every parameter and optimizer tensor equal to an uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_transformers_integration import committed_steps, digest, run, run_preempted, tail

from spotckpt import PREEMPTED_EXIT_CODE


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("accelerate") / "reference"
    done = run("accelerate_worker.py", str(out.parent / "reference-ckpt"), out)
    assert done.returncode == 0, tail(out)
    return digest(out)


@pytest.mark.parametrize("stop_at", [8, 6], ids=["mid-epoch", "at-an-epoch-boundary"])
def test_sigterm_exit_75_and_bit_identical_resume(
    tmp_path: Path, reference: dict[str, Any], stop_at: int
) -> None:
    uri, out = str(tmp_path / "ckpt"), tmp_path / "spot"
    assert run_preempted("accelerate_worker.py", uri, out, stop_at) == PREEMPTED_EXIT_CODE, tail(
        out
    )
    assert committed_steps(uri)[-1] == stop_at
    resumed = run("accelerate_worker.py", uri, out)
    assert resumed.returncode == 0, tail(out)
    result = digest(out)
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
