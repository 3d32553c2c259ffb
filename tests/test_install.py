"""The core install, alone: a fresh virtual environment with torch and ``pip install spotckpt``
(no extra), which imports spotckpt, saves and restores on S3 (the session's moto server, over
HTTP, run by this test process), and has none of the frameworks the extras bring.

pip is pointed at no index of its own: the machine's pip configuration decides where packages come
from. Only when torch of this interpreter's version can be had from a local wheel (pip's
``find-links``), so that the test does not download gigabytes, does it run; elsewhere it says so
and skips. Installing a local torch wheel and the core takes about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT_S = 900  # one pip command on a loaded 2-core machine; about 30 s when idle
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "torchtitan")
OTHER_EXTRAS = (
    "zfec",
    "s3fs",
    "gcsfs",
    "safetensors",
    "torchdata",
    "moto",
    "pytest",
)  # torch brings fsspec

CHILD = """
import importlib, importlib.util, json, sys
import torch
from torch import nn
import spotckpt
from spotckpt import CheckpointManager, TrainState
from spotckpt.errors import MissingDependencyError

uri, names = sys.argv[1], json.loads(sys.argv[2])
torch.manual_seed(0)
model = nn.Linear(8, 4)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
with CheckpointManager(uri, preemption=False) as mgr:
    mgr.save(7, TrainState(model=model, optimizer=optimizer), blocking=True)
fresh = nn.Linear(8, 4)
fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
with CheckpointManager(uri, preemption=False) as mgr:
    step = mgr.restore(TrainState(model=fresh, optimizer=fresh_optimizer))
refused = {}
for module in ("lightning", "transformers", "torchtitan"):
    try:
        importlib.import_module("spotckpt.integrations." + module)
    except MissingDependencyError as error:
        refused[module] = str(error)
print(json.dumps({
    "file": spotckpt.__file__,
    "step": step,
    "equal": all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                    fresh.state_dict().values())),
    "moments": sorted(fresh_optimizer.state_dict()["state"][0]),
    "present": [name for name in names if importlib.util.find_spec(name) is not None],
    "refused": refused,
}))
"""


def _run(*command: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"{command}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _sources(target: Path) -> Path:
    """What a source distribution would hold: building in a copy leaves the checkout alone."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, target / name)
    shutil.copytree(
        ROOT / "spotckpt", target / "spotckpt", ignore=shutil.ignore_patterns("__pycache__")
    )
    return target


def test_core_install_saves_and_restores_on_s3_without_the_frameworks(
    tmp_path: Path, s3_uri: str
) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    pip = (python, "-m", "pip", "--disable-pip-version-check")
    wanted = f"torch=={torch.__version__}"
    local = subprocess.run(
        [*map(str, pip), "install", "--dry-run", "--no-index", "--no-deps", wanted],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    if local.returncode != 0:
        pytest.skip(f"no local wheel of {wanted} for pip (find-links); it would download it")
    _run(*pip, "install", "-q", wanted)
    source = tmp_path / "src"
    source.mkdir()
    _run(*pip, "install", "-q", _sources(source))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOTCKPT_", "PYTHON"))}
    out = _run(
        python,
        "-c",
        textwrap.dedent(CHILD),
        s3_uri,
        json.dumps([*FRAMEWORKS, *OTHER_EXTRAS]),
        env=env,
        cwd=tmp_path,  # not the checkout, whose spotckpt/ would shadow the installed one
    )
    report = json.loads(out.strip().splitlines()[-1])
    assert report["file"].startswith(str(venv)), report["file"]  # not this checkout's copy
    assert report["step"] == 7
    assert report["equal"] is True
    assert report["moments"] == ["exp_avg", "exp_avg_sq", "step"]
    assert report["present"] == [], f"the core install brought {report['present']}"
    for module in ("lightning", "transformers", "torchtitan"):
        assert f"pip install 'spotckpt[{module}]'" in report["refused"][module]
