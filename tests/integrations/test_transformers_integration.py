"""`SpotckptCallback` with the real `transformers.Trainer`: SIGTERM, exit 75, resume, bit for bit.

Each run is a real child process (tests/hf_worker.py) training a tiny GPT-2 built from a config
(nothing is downloaded), on CPU: 14 optimizer steps of 2 accumulated batches, 6 steps an epoch
(the last one of a single batch), dropout on, saving every 3 steps. A run is SIGTERM'd at the end
of step K, which it announces on stdout and then waits there for the signal; it must commit step
K and exit with status 75; started again, it must finish with every parameter and optimizer
tensor equal to an uninterrupted run's (which had no loader workers), byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from spotckpt import PREEMPTED_EXIT_CODE, CheckpointManager
from spotckpt.integrations.transformers import TRAINER_STATE_KEY
from spotckpt.layout import QUARANTINE_PREFIX, step_folder

from framework_runs import child_env, committed_steps, digest, run, run_preempted, tail


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """An uninterrupted run: its checkpoint root and digest."""
    out = tmp_path_factory.mktemp("hf") / "reference"
    uri = str(out.parent / "reference-ckpt")
    done = run("hf_worker.py", uri, out)
    assert done.returncode == 0, tail(out)
    return uri, digest(out)


@pytest.mark.process
@pytest.mark.parametrize(
    ("stop_at", "store", "workers"),
    [(8, "s3", 2), (6, "local", 0)],
    ids=["mid-epoch-on-s3-group-signal-2-loader-workers", "at-an-epoch-boundary-local"],
)
def test_sigterm_exit_75_and_bit_identical_resume(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    reference: tuple[str, dict[str, Any]],
    stop_at: int,
    store: str,
    workers: int,
) -> None:
    """Mirrors docs/transformers.md's recipe, `resume_from_checkpoint()` included."""
    uri = request.getfixturevalue("s3_uri") if store == "s3" else str(tmp_path / "ckpt")
    out, loader = tmp_path / "spot", ("--workers", str(workers))
    status = run_preempted("hf_worker.py", uri, out, stop_at, *loader, group=workers > 0)
    assert status == PREEMPTED_EXIT_CODE, tail(out)
    assert "Traceback" not in tail(out), tail(out)
    steps = committed_steps(uri)
    assert steps[-1] == stop_at, steps  # the emergency save is of the step it was stopped at
    assert not (out / "digest.json").exists()  # it stopped: it did not train to the end
    with CheckpointManager(uri, preemption=False) as manager:
        trainer_state = manager.read_manifest(stop_at).user_metadata[TRAINER_STATE_KEY]
    assert trainer_state["global_step"] == stop_at

    resumed = run("hf_worker.py", uri, out, *loader)
    assert resumed.returncode == 0, tail(out)
    result, expected = digest(out), reference[1]
    assert result["resumed_from"] == str(stop_at)
    assert len(result["tensors"]) == len(expected["tensors"]) > 100
    different = [
        name for name, sha in expected["tensors"].items() if result["tensors"][name] != sha
    ]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:5]}"
    assert result["global_step"] == expected["global_step"] == 14
    assert result["epoch"] == expected["epoch"]
    assert result["log_steps"] == expected["log_steps"]  # the log history came back
    assert committed_steps(uri)[-1] == 14  # the last step is saved
    assert not list((out / "trainer").glob("spotckpt-resume-*")), "the resume folder stayed"


@pytest.mark.process
def test_a_corrupt_newest_checkpoint_is_quarantined_and_the_trainer_resumes_from_the_older(
    tmp_path: Path, reference: tuple[str, dict[str, Any]]
) -> None:
    """Steps 3 and 6 committed; a byte of an optimizer tensor in step 6's object flipped (the
    weights the Trainer loads stay intact). The restart must choose its step as a restore does:
    quarantine step 6 with a warning, resume from step 3, and (repeating steps 4 to 6) end bit
    for bit where an uninterrupted run ends."""
    uri, out = str(tmp_path / "ckpt"), tmp_path / "spot"
    keep = ("--keep-last", "10")  # keeps every step: the quarantine record of step 6 stays
    assert run_preempted("hf_worker.py", uri, out, 6, *keep) == PREEMPTED_EXIT_CODE, tail(out)
    assert committed_steps(uri) == [3, 6]
    with CheckpointManager(uri, preemption=False) as manager:
        manifest = manager.read_manifest(6)
    damaged = next(n for n in manifest.tensors if n.startswith("optimizer.state."))
    location = manifest.tensors[damaged].chunks[0].location
    _flip_byte(tmp_path / "ckpt" / step_folder(6) / location.key, location.offset)

    resumed = run("hf_worker.py", uri, out, *keep)
    log = out.with_suffix(".log").read_text()
    assert resumed.returncode == 0, tail(out)
    assert "checkpoint step 6 is unusable" in log and "falling back to step 3" in log, tail(out)
    records = list((tmp_path / "ckpt" / step_folder(6)).glob(f"{QUARANTINE_PREFIX}*"))
    assert len(records) == 1, "step 6 was not quarantined"
    assert "ChecksumMismatchError" in json.loads((records[0] / "reason.json").read_text())["reason"]
    result, expected = digest(out), reference[1]
    assert result["resumed_from"] == "3"
    different = [
        name for name, sha in expected["tensors"].items() if result["tensors"][name] != sha
    ]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:5]}"
    assert result["global_step"] == expected["global_step"] == 14
    assert result["log_steps"] == expected["log_steps"]
    assert committed_steps(uri) == [3, 6, 9, 12, 14]  # step 6 saved again on the way


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.process
def test_a_trainer_that_ignores_the_checkpoint_is_refused(
    tmp_path: Path, reference: tuple[str, dict[str, Any]]
) -> None:
    """Training from scratch over a committed checkpoint would collide with it: an error."""
    out = tmp_path / "fresh"
    done = run("hf_worker.py", reference[0], out, "--no-resume")
    assert done.returncode == 1
    assert "holds checkpoint step 14, but this Trainer did not resume from it" in tail(out)
    assert not (out / "digest.json").exists()


@pytest.mark.process
def test_import_spotckpt_does_not_import_transformers() -> None:
    code = textwrap.dedent(
        """
        import sys
        import spotckpt, spotckpt.integrations
        from spotckpt import CheckpointManager, TrainState
        print(sorted(m for m in ("transformers", "accelerate") if m in sys.modules))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=child_env()
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
