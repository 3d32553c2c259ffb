"""`SpotckptTrainer` with the real torchtitan: SIGTERM, exit 75, restart, a bit-identical end.

tests/torchtitan_worker.py trains torchtitan's llama3 debugmodel on the CPU for 6 steps with
``checkpoint.interval`` 2, one process per rank started here with torchrun's variables (as
torchrun starts them). A reference run goes uninterrupted. Another waits after step 3, between
two interval saves, and gets SIGTERM on every rank (as torchrun forwards it): each rank must
commit step 3 and exit with status 75. The same command started again must train steps 4 to 6
only and end with the reference's model and optimizer tensors, bit for bit: one rank on a local
folder, two FSDP ranks on S3.

Every run sees no CUDA device (``CUDA_VISIBLE_DEVICES=""``), as on a CPU-only machine: nothing
in the worker moves torchtitan off CUDA, `SpotckptTrainer` does. The command of
docs/torchtitan.md, ``spotckpt launch --nproc-per-node=2 -m spotckpt.integrations.torchtitan``,
trains and resumes on the CPU too (the worker's module, imported by
``--experimental.custom_import``, only adds the synthetic data set).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.config import ConfigManager

from spotckpt import PREEMPTED_EXIT_CODE, CheckpointManager
from spotckpt.config import Config, ConfigError
from spotckpt.integrations.torchtitan import LoaderState, SpotckptTrainer
from spotckpt.values import ValueLoadError

from tests_support import TESTS, free_port
from torchtitan_worker import Tokens

WORKER = TESTS / "torchtitan_worker.py"
NO_CUDA = {"CUDA_VISIBLE_DEVICES": ""}  # a CPU-only machine, whatever this one has
TIMEOUT_S = 600  # a guard against hangs only: a run takes seconds
STEPS, INTERVAL, STOP_AT = 6, 2, 3
TITAN_ARGS = [
    "--model.name", "spotckpt_debug",
    "--model.flavor", "debugmodel",
    "--training.steps", str(STEPS),
    "--training.local_batch_size", "2",
    "--training.seq_len", "32",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--debug.seed", "0",
    "--checkpoint.interval", str(INTERVAL),
]  # fmt: skip


class Ranks:
    """The rank processes of one run, each logging to OUT/rank-<r>.log."""

    def __init__(self, world: int, uri: str, out: Path, wait_at: int | None = None) -> None:
        out.mkdir(parents=True)
        self.out = out
        self.markers: list[int] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        base = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
        base.update(
            SPOTCKPT_URI=uri,
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            PYTHONUNBUFFERED="1",
            **NO_CUDA,
        )
        for rank in range(world):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            pass_fds: tuple[int, ...] = ()
            if wait_at is not None:
                read, write = os.pipe()
                self.markers.append(read)
                env.update(WAIT_AT=str(wait_at), MARKER_FD=str(write))
                pass_fds = (write,)
            with open(out / f"rank-{rank}.log", "wb") as log:
                command = [sys.executable, str(WORKER), *TITAN_ARGS, "--job.dump_folder", str(out)]
                self.processes.append(
                    subprocess.Popen(
                        command, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT,
                        pass_fds=pass_fds,
                    )
                )  # fmt: skip
            if pass_fds:
                os.close(pass_fds[0])

    def wait_until_reached(self, step: int) -> None:
        """Block until every rank wrote ``REACHED step`` (an EOF means it exited first)."""
        for rank, read in enumerate(self.markers):
            seen = b""
            while b"\n" not in seen:
                ready, _, _ = select.select([read], [], [], TIMEOUT_S)
                chunk = os.read(read, 64) if ready else b""
                if not chunk:
                    self.kill()
                    raise AssertionError(f"rank {rank} never reached step {step}: {self.log(rank)}")
                seen += chunk
            assert seen.decode().strip() == f"REACHED {step}"

    def signal(self, signum: int) -> None:
        for process in self.processes:
            process.send_signal(signum)

    def finish(self) -> list[int]:
        """Every rank's exit status."""
        try:
            return [process.wait(timeout=TIMEOUT_S) for process in self.processes]
        finally:
            self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for read in self.markers:
            os.close(read)
        self.markers = []

    def log(self, rank: int = 0) -> str:
        return (self.out / f"rank-{rank}.log").read_text(errors="replace")[-4000:]

    def steps(self, rank: int) -> list[int]:
        return [int(line) for line in (self.out / f"steps-{rank}.txt").read_text().split()]

    def digest(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads((self.out / "digest.json").read_text())
        return result


def run_to_the_end(world: int, uri: str, out: Path) -> Ranks:
    ranks = Ranks(world, uri, out)
    assert ranks.finish() == [0] * world, ranks.log()
    return ranks


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Uninterrupted runs' digests, by world size."""
    root = tmp_path_factory.mktemp("torchtitan-reference")
    digests = {}
    for world in (1, 2):
        ranks = run_to_the_end(world, str(root / f"ck-{world}"), root / f"out-{world}")
        assert ranks.steps(0) == list(range(1, STEPS + 1))
        digests[world] = ranks.digest()
    return digests


@pytest.mark.process
@pytest.mark.parametrize(
    ("world", "store"), [(1, "local"), (2, "s3")], ids=["1-rank-local", "2-fsdp-ranks-s3"]
)
def test_sigterm_exit_75_and_bit_identical_resume(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    references: dict[int, dict[str, Any]],
    world: int,
    store: str,
) -> None:
    reference = references[world]
    uri = str(tmp_path / "ck") if store == "local" else request.getfixturevalue("s3_uri")

    killed = Ranks(world, uri, tmp_path / "killed", wait_at=STOP_AT)
    killed.wait_until_reached(STOP_AT)
    killed.signal(signal.SIGTERM)
    assert killed.finish() == [PREEMPTED_EXIT_CODE] * world, killed.log()
    assert f"emergency save of step {STOP_AT} committed" in killed.log()
    whole = (killed.out / "rank-0.log").read_text(errors="replace")
    assert "training on the CPU" in whole and "CPU capacity" in whole and "cuda" not in whole
    assert ("Applied FSDP to the model" in killed.log()) == (world > 1)
    assert all(killed.steps(rank) == [1, 2, 3] for rank in range(world))
    with CheckpointManager(uri, preemption=False) as manager:
        assert manager.steps() == [2, 3]

    resumed = run_to_the_end(world, uri, tmp_path / "resumed")
    assert all(resumed.steps(rank) == [4, 5, 6] for rank in range(world))
    result = resumed.digest()
    assert result["step"] == reference["step"] == STEPS
    assert len(result["model"]) == len(reference["model"]) > 50
    assert len(result["optimizer"]) == len(reference["optimizer"]) > 100
    for part in ("model", "optimizer"):
        different = [k for k, v in reference[part].items() if result[part].get(k) != v]
        assert not different, f"{part}: {len(different)} entries differ: {different[:5]}"
    assert result["lr_scheduler"] == reference["lr_scheduler"]


def _titan_command(steps: int, out: Path, port: int) -> list[str]:
    """docs/torchtitan.md's command on 2 ranks (``python -m spotckpt.launch`` is ``spotckpt
    launch``), with the synthetic data set and a small run."""
    args = list(TITAN_ARGS)
    args[args.index("--training.steps") + 1] = str(steps)
    return [
        sys.executable, "-m", "spotckpt.launch", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        "-m", "spotckpt.integrations.torchtitan",
        "--experimental.custom_import", "torchtitan_worker",
        *args, "--job.dump_folder", str(out),
    ]  # fmt: skip


@pytest.mark.process
def test_the_readme_command_trains_and_resumes_on_the_cpu(tmp_path: Path) -> None:
    """Mirrors docs/torchtitan.md's CPU command (`debug_model.toml` on two ranks)."""
    uri = str(tmp_path / "ck")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    env.update(SPOTCKPT_URI=uri, PYTHONPATH=str(TESTS), PYTHONUNBUFFERED="1", **NO_CUDA)
    logs = []
    for steps in (2, 4):
        result = subprocess.run(
            _titan_command(steps, tmp_path / f"out-{steps}", free_port()),
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-6000:]
        assert "_cuda_setDevice" not in output
        assert output.count("training on the CPU") == 2  # one line per rank
        assert "Applied FSDP to the model" in output
        logs.append(output)
    trained = [{int(step) for step in re.findall(r"step:\s+(\d+)\s", log)} for log in logs]
    assert trained == [{1, 2}, {3, 4}]
    assert "resuming after step 2" in logs[1] and "resuming" not in logs[0]
    with CheckpointManager(uri, preemption=False) as manager:
        assert manager.steps() == [2, 4]


@pytest.mark.process
def test_use_the_cpu_rebinds_torchtitan_s_device_only_when_the_trainer_starts() -> None:
    code = """if True:
        import torch
        import torchtitan.tools.utils as utils
        import spotckpt.integrations.torchtitan as integration
        from torchtitan.distributed import utils as dist_utils, parallel_dims
        from torchtitan.components import metrics
        before = (utils.device_type, integration._needs_the_cpu())
        integration._use_the_cpu()
        from torchtitan.distributed import dual_pipe_v  # imported after the switch
        cpu = integration.CPU_DEVICE_MODULE
        modules = (utils, dist_utils, metrics, dual_pipe_v)
        print(before, integration._needs_the_cpu(),
              {m.device_type for m in (*modules, parallel_dims)},
              all(m.device_module is cpu for m in modules),
              metrics.build_device_memory_monitor().get_peak_stats().max_active_gib < 0)
    """
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, **NO_CUDA},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2] == "('cuda', True) False {'cpu'} True True"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path only")
def test_refuses_a_cuda_memory_snapshot_on_the_cpu(tmp_path: Path) -> None:
    job_config = ConfigManager().parse_args(["--profiling.enable_memory_snapshot"])
    with pytest.raises(ConfigError, match=r"profiling\.enable_memory_snapshot .* no CUDA"):
        SpotckptTrainer(job_config, spotckpt_config=Config(uri=str(tmp_path)))


def test_refuses_checkpoint_options_it_cannot_honour(tmp_path: Path) -> None:
    job_config = ConfigManager().parse_args(
        ["--checkpoint.async_mode", "async", "--checkpoint.load_only"]
    )
    with pytest.raises(ConfigError, match=r"checkpoint\.async_mode, checkpoint\.load_only"):
        SpotckptTrainer(job_config, spotckpt_config=Config(uri=str(tmp_path)))


def _loader() -> ParallelAwareDataloader:
    return ParallelAwareDataloader(Tokens(0, 8), dp_rank=0, dp_world_size=1, batch_size=2)


def test_the_loader_position_is_a_weights_only_blob_that_resumes() -> None:
    used = _loader()
    batches = iter(used)
    for _ in range(3):
        next(batches)
    state = LoaderState(used).state_dict()
    assert list(state) == ["dp_rank_0"] and isinstance(state["dp_rank_0"], bytes)

    fresh = _loader()
    LoaderState(fresh).load_state_dict(state)
    (expected, _), (actual, _) = next(batches), next(iter(fresh))
    assert torch.equal(expected["input"], actual["input"])


class _Payload:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.path),)


def test_a_forged_pickle_in_the_loader_state_is_refused_unrun(tmp_path: Path) -> None:
    forged = {"dp_rank_0": pickle.dumps(_Payload(tmp_path / "ran"))}
    with pytest.raises(ValueLoadError, match="weights_only"):
        LoaderState(_loader()).load_state_dict(forged)
    assert not (tmp_path / "ran").exists()


@pytest.mark.process
def test_import_spotckpt_does_not_import_torchtitan() -> None:
    code = "import sys, spotckpt, spotckpt.integrations; print('torchtitan' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
