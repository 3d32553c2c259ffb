"""``spotckpt verify``'s success line says what was checked of the signature: checked, and with
which key (its public id, never key material), or why not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.cli import main
from spotckpt.format.signing import Keyring, key_id

from tests_support import write_signing_key


def _verify(root: Path, capsys: pytest.CaptureFixture[str], *options: str) -> str:
    with pytest.raises(SystemExit) as done:
        main(["verify", str(root), *options])
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    return out


def _save(root: Path, **settings: object) -> None:
    with CheckpointManager(str(root), preemption=False, **settings) as manager:
        manager.save(1, {"w": torch.ones(4)})


def test_the_success_line_says_what_was_checked_of_the_signature(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    key = write_signing_key(tmp_path / "k.pem")
    ring = Keyring.from_files(str(key))
    assert ring is not None
    ident = key_id(ring.verifiers[0])
    unsigned, signed = tmp_path / "unsigned", tmp_path / "signed"
    _save(unsigned)
    _save(signed, signing_key=str(key))

    assert (
        "step 1: OK" in (line := _verify(unsigned, capsys))
        and "unsigned, no key configured" in line
    )
    line = _verify(signed, capsys)
    assert f"signed with key {ident}, signature not checked: no key configured" in line
    monkeypatch.setenv("SPOTCKPT_VERIFY_KEYS", str(key))
    assert f"signature checked with key {ident}" in _verify(signed, capsys)
    monkeypatch.setenv("SPOTCKPT_ACCEPT_UNSIGNED", "true")
    assert "unsigned, accepted (accept_unsigned)" in _verify(unsigned, capsys)
    document = json.loads(_verify(signed, capsys, "--json"))
    assert document["signature"] == {"status": "checked", "key": ident}
    assert key.read_text().splitlines()[1] not in _verify(signed, capsys)
