"""The step digest (`spotckpt.digest`): recorded with the save, printed by ``verify --digest``,
equal across copies of the step, different for any other step or bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from spotckpt import CheckpointManager
from spotckpt.cli import cli
from spotckpt.digest import merkle_root
from spotckpt.layout import EVENTS_PREFIX, parse_event_key

from tests_support import write_signing_key


def _verify_digest(root: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.chdir(root.parent)  # no spotckpt.toml of the project's
    result = CliRunner().invoke(cli, ["verify", str(root), "--step", str(step), "--digest"])
    lines = [line for line in result.output.splitlines() if line.startswith("digest ")]
    return result.exit_code, lines[0].removeprefix("digest ") if lines else result.output


def _save_events(root: Path) -> dict[int, str]:
    events = [
        json.loads(path.read_bytes())
        for path in sorted((root / EVENTS_PREFIX).glob("*.json"))
        if parse_event_key(f"{EVENTS_PREFIX}{path.name}")
    ]
    return {e["step"]: e["digest"] for e in events if e["kind"] == "save"}


@pytest.mark.parametrize("signed", [False, True])
def test_digest_is_recorded_printed_and_equal_across_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signed: bool
) -> None:
    settings = {}
    if signed:
        key = write_signing_key(tmp_path / "key.pem")
        settings["signing_key"] = str(key)
        monkeypatch.setenv("SPOTCKPT_SIGNING_KEY", str(key))
    root = tmp_path / "bucket"
    with CheckpointManager(str(root), preemption=False, **settings) as manager:
        for step in (1, 2):
            manager.save(step, {"w": torch.full((256,), float(step)), "n": torch.tensor(step)})
    recorded = _save_events(root)
    code, printed = _verify_digest(root, 2, monkeypatch)
    assert code == 0 and printed == recorded[2] and printed.startswith("blake3:")
    assert recorded[1] != recorded[2]
    copy = tmp_path / "copy" / "run"  # another bucket: the step folder and the job copied
    shutil.copytree(root / "step-000000002", copy / "step-000000002")
    shutil.copy(root / "job.json", copy / "job.json")
    assert _verify_digest(copy, 2, monkeypatch) == (0, printed)
    (obj,) = (copy / "step-000000002").rglob("*.safetensors")
    data = bytearray(obj.read_bytes())
    data[-1] ^= 1
    obj.write_bytes(bytes(data))
    code, output = _verify_digest(copy, 2, monkeypatch)
    assert code == 1 and "digest" not in output  # a digest only stands for intact bytes


def test_merkle_root_depends_on_every_leaf_and_their_order() -> None:
    leaves = [b"a", b"b", b"c"]
    root = merkle_root(leaves)
    assert merkle_root([b"a", b"b", b"d"]) != root
    assert merkle_root([b"b", b"a", b"c"]) != root
    assert merkle_root([b"a", b"b"]) != root and merkle_root([b"ab", b"c"]) != root
