"""Every code block of README.md and docs/*.md runs (or is mirrored by a named test).

The pages are found when this module loads, so a new docs page is covered without editing it.
Each fenced block needs a language: ``python``, ``bash`` and ``toml`` blocks are code, ``text``
blocks are output. A comment on the line just above a block's fence changes how it is tested:

- ``<!-- docs-test: given NAME -->``: a python block runs after the prelude `PRELUDES[NAME]`,
  which defines what the snippet leaves to the reader (a model, a loader, a saved checkpoint);
- ``<!-- docs-test: after previous -->``: it runs after the page's previous python block, in the
  same namespace and folder (a quick start in two parts);
- ``<!-- docs-test: covered-by PATH::TEST -->``: a test elsewhere runs what the block shows; the
  test must exist and its file must name the page (so that it says which block it covers);
- ``<!-- docs-test: slow -->``: it runs only with the slow campaigns (``make test-all``);
- ``<!-- docs-test: skip REASON -->``: it cannot run here (a real cloud, GPUs); kept few.

Blocks run against the servers of tests/conftest.py: ``s3://bucket/...`` and
``s3://my-bucket/...`` become a fresh bucket on the moto server (an ``endpoint_url`` on loopback
becomes moto's), ``gs://my-bucket/...`` one on the GCS emulator, ``/tmp/`` a folder of the test,
``examples/`` and ``benchmarks/`` this checkout's. Python runs in this process; bash runs in a
child with this interpreter first on PATH and this checkout importable.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "toml", "text"}
MAX_SKIPPED = 5
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!-- docs-test: (given|after|covered-by|slow|skip)\b ?(.*?) ?-->$")
_BASH_TIMEOUT_S = 900

PRELUDES = {
    # docs/training-loop.md's loop: what `train_step(...)` and the training objects stand for.
    "training": """
import sys
import torch
from torch.utils.data import DataLoader
from spotckpt import ResumableSampler
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
scaler = torch.amp.GradScaler("cpu")
loader = DataLoader(torch.arange(16.0), batch_size=4, sampler=ResumableSampler(16, seed=0))
total_steps = 3
def train_step(*args):
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    sched.step()
""",
    # docs/data-loaders.md: a dataset of the reader's, and the model and optimizer.
    "data": """
import torch
from torch.utils.data import DataLoader, Dataset
class MyDataset(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, index):
        return torch.rand(3) + index
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
""",
    # docs/dcp.md: a state dict, and an older step (400) for the reader to pick.
    "dcp": """
import torch
import torch.distributed.checkpoint as dcp
import spotckpt
state_dict = {"weight": torch.arange(8.0), "bias": torch.zeros(2)}
dcp.save(state_dict, storage_writer=spotckpt.dcp_writer("s3://bucket/runs/exp1", step=400))
""",
    # docs/reading.md: a checkpoint of a trained model, and the model's class.
    "saved": """
import torch
from torch import nn
from spotckpt import CheckpointManager, TrainState
def MyModel():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
_model = MyModel()
_manager = CheckpointManager("s3://bucket/runs/exp1", preemption=False)
_state = TrainState(model=_model, optimizer=torch.optim.AdamW(_model.parameters()))
_manager.save(500, _state, blocking=True, user_metadata={"loss": 0.5})
_manager.close()
""",
}


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: Path
    line: int
    language: str
    code: str
    marker: str | None
    argument: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    found = []
    at = 0
    while at < len(lines):
        opened = _FENCE.match(lines[at])
        if opened is None:
            at += 1
            continue
        end = at + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        marker = _MARKER.match(lines[at - 1]) if at else None
        found.append(
            Block(
                page,
                at + 1,
                opened.group(1),
                "\n".join(lines[at + 1 : end]) + "\n",
                marker.group(1) if marker else None,
                marker.group(2) if marker else "",
            )
        )
        at = end + 1
    return found


BLOCKS = [block for page in PAGES for block in _blocks(page)]
CODE = [block for block in BLOCKS if block.language != "text"]


def _param(block: Block) -> Any:
    marks = [pytest.mark.slow] if block.marker == "slow" else []
    return pytest.param(block, id=block.where, marks=marks)


def test_every_block_names_a_known_language_and_markers_are_well_formed() -> None:
    assert len(PAGES) > 10 and len(CODE) > 10
    for block in BLOCKS:
        assert block.language in LANGUAGES, f"{block.where}: fence language {block.language!r}"
    for page in PAGES:
        lines = page.read_text().split("\n")
        for number, line in enumerate(lines):
            if line.startswith("<!--") and "docs-test" in line:
                assert _MARKER.match(line), f"{page.name}:{number + 1}: malformed {line!r}"
                following = lines[number + 1] if number + 1 < len(lines) else ""
                assert _FENCE.match(following), f"{page.name}:{number + 1}: not above a fence"


def test_skips_are_few_and_say_why() -> None:
    skipped = [block for block in CODE if block.marker == "skip"]
    assert len(skipped) <= MAX_SKIPPED, [block.where for block in skipped]
    for block in skipped:
        assert len(block.argument.split()) >= 3, f"{block.where}: say why it cannot run"


def test_readme_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_links_between_pages_lead_to_files() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links {target}, not a file"


def test_ci_runs_the_commands_the_readme_gives() -> None:
    """Covers README.md's two commands and its `SPOTCKPT_URI=... make demo` block: CI
    (.ci/run) runs `make test`, and `make demo` on the embedded server and on a local folder."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text().split("\n")
    assert "make test   # the test suite" in readme and "make demo   # a spot market" in readme
    assert "make test" in ci
    # `demo NAME VAR=VALUE...` runs `env VAR=VALUE... make demo` (the three side by side)
    assert '    env "$@" make demo >"$logs/$name" 2>&1 || status=$?' in ci
    assert "demo s3 -u SPOTCKPT_URI &" in ci  # the embedded server
    assert 'demo folder SPOTCKPT_URI="$checkpoints" &' in ci  # a local folder
    assert "SPOTCKPT_URI=/tmp/spotckpt-demo make demo" in readme


@pytest.mark.process
@pytest.mark.parametrize("block", [_param(b) for b in CODE])
def test_block(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block.marker == "skip":
        pytest.skip(f"{block.where}: {block.argument}")
    if block.marker == "covered-by":
        _check_covered(block)
        return
    context = _Context(block, request, tmp_path)
    if block.language == "python":
        context.run_python(block, {})
    elif block.language == "bash":
        context.run_bash(block)
    else:
        _check_toml(block, tmp_path, request)


def _check_covered(block: Block) -> None:
    path, _, name = block.argument.partition("::")
    source = REPO / path
    assert source.is_file(), f"{block.where}: {path} does not exist"
    text = source.read_text()
    assert re.search(rf"^def {re.escape(name)}\(", text, re.M), f"{block.where}: no test {name}"
    page = str(block.page.relative_to(REPO))
    assert page in text, f"{block.where}: {path} must say that it covers {page}"


def _check_toml(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    document = tomllib.loads(block.code)
    if "uri" not in document:  # another project's pyproject.toml fragment
        assert document, block.where
        return
    from spotckpt.config import Config

    monkeypatch = request.getfixturevalue("monkeypatch")
    for name in [n for n in os.environ if n.startswith("SPOTCKPT_")]:
        monkeypatch.delenv(name)
    (tmp_path / "spotckpt.toml").write_text(block.code)
    config = Config.load(tmp_path)
    for key, value in document.items():
        assert getattr(config, key) == value, f"{block.where}: {key}"


class _Context:
    """The servers, folder and substitutions of one page's blocks."""

    def __init__(self, block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.request = request
        self.folder = tmp_path
        text = "".join(b.code + PRELUDES.get(b.argument, "") for b in self._chain(block))
        self.subs: list[tuple[str, str]] = [("/tmp/", f"{tmp_path}/")]
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(REPO),
        }
        self.env = {k: v for k, v in self.env.items() if not k.startswith("SPOTCKPT_")}
        monkeypatch = request.getfixturevalue("monkeypatch")
        for name in [n for n in os.environ if n.startswith("SPOTCKPT_")]:
            monkeypatch.delenv(name)
        if re.search(r"s3://(my-)?bucket/", text):
            uri = request.getfixturevalue("s3_uri")  # sets AWS_ENDPOINT_URL for children too
            bucket = uri.split("/")[2]
            endpoint = request.getfixturevalue("moto_endpoint")
            self.subs += [
                ("s3://bucket/", f"s3://{bucket}/"),
                ("s3://my-bucket/", f"s3://{bucket}/"),
                ('"http://127.0.0.1:5000"', repr(endpoint)),
            ]
            self.env["AWS_ENDPOINT_URL"] = endpoint
        if "gs://my-bucket/" in text:
            uri = request.getfixturevalue("gcs_uri")
            self.subs.append(("gs://my-bucket/", f"gs://{uri.split('/')[2]}/"))
            self.env["STORAGE_EMULATOR_HOST"] = os.environ["STORAGE_EMULATOR_HOST"]
        for folder in ("examples/", "benchmarks/"):
            self.subs.append((f" {folder}", f" {REPO / folder}/"))

    @staticmethod
    def _chain(block: Block) -> list[Block]:
        """`block` and the earlier blocks it runs after, first first."""
        chain = [block]
        while chain[0].marker == "after":
            earlier = [
                b
                for b in CODE
                if b.page == block.page and b.line < chain[0].line and b.language == "python"
            ]
            assert earlier, f"{block.where}: no earlier python block to run after"
            chain.insert(0, earlier[-1])
        return chain

    def substitute(self, code: str) -> str:
        for old, new in self.subs:
            code = code.replace(old, new)
        return code

    def run_python(self, block: Block, namespace: dict[str, Any]) -> None:
        monkeypatch = self.request.getfixturevalue("monkeypatch")
        monkeypatch.chdir(self.folder)
        for name in ("AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST"):
            if name in self.env:
                monkeypatch.setenv(name, self.env[name])
        try:
            for part in self._chain(block):
                code = PRELUDES[part.argument] if part.marker == "given" else ""
                code += part.code
                compiled = compile(self.substitute(code), part.where, "exec")
                exec(compiled, namespace)
        finally:  # a snippet may leave a manager open: its watcher holds SIGTERM
            from spotckpt import CheckpointManager
            from spotckpt.weights import CheckpointFile

            for value in namespace.values():
                if isinstance(value, (CheckpointManager, CheckpointFile)):
                    value.close()

    def run_bash(self, block: Block) -> None:
        code = self.substitute(block.code).replace("source .venv/bin/activate\n", "")
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=_BASH_TIMEOUT_S,
        )
        assert result.returncode == 0, (
            f"{block.where} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
            f"{result.stderr[-3000:]}"
        )
