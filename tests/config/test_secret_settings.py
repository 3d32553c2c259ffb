"""Settings that may hold a secret (`spotckpt.config.SECRET_SETTINGS`: the signing and verify
keys, the storage options) are never echoed: not by a config error, not by the command line.

The case of issue 44: ``SPOTCKPT_SIGNING_KEY`` given the PEM text itself (a Kubernetes secret
exposed as an environment variable) instead of the path of a file that holds it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spotckpt import CheckpointManager, Config
from spotckpt.config import SECRET_SETTINGS
from spotckpt.errors import ConfigError
from spotckpt.redact import redact

from tests_support import write_signing_key


def _pem(tmp_path: Path) -> tuple[str, str]:
    """A private key's PEM text and the base64 line inside it (what must never be shown)."""
    text = write_signing_key(tmp_path / "key.pem").read_text()
    (body,) = [line for line in text.splitlines() if not line.startswith("-----")]
    return text, body


def _never_shown(message: str, body: str) -> None:
    assert body not in message and body[:12] not in message, message
    assert "BEGIN" not in message and "PRIVATE KEY-----" not in message, message


@pytest.mark.parametrize("variable", ["SPOTCKPT_SIGNING_KEY", "SPOTCKPT_VERIFY_KEYS"])
def test_pem_text_in_a_key_variable_is_refused_without_echo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    text, body = _pem(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, text)
    with pytest.raises(ConfigError) as caught:
        CheckpointManager(str(tmp_path / "ck"), preemption=False)
    message = str(caught.value)
    _never_shown(message, body)
    assert message.startswith(f"{variable}: ") and "PEM text" in message and "path" in message


def test_pem_text_is_refused_without_echo_from_every_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, body = _pem(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as keyword:
        CheckpointManager(str(tmp_path / "ck"), preemption=False, signing_key=text)
    (tmp_path / "spotckpt.toml").write_text(f"signing_key = '''{text}'''\n")
    with pytest.raises(ConfigError) as in_file:
        Config.load(uri="memory://x")
    (tmp_path / "spotckpt.toml").write_text(f"verify_keys = ['''{text}''']\n")  # wrong type
    with pytest.raises(ConfigError) as wrong_type:
        Config.load(uri="memory://x")
    for caught in (keyword, in_file, wrong_type):
        _never_shown(str(caught.value), body)
    assert "must be str or None, got list" in str(wrong_type.value)


def test_the_command_line_never_prints_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from spotckpt.cli import main

    text, body = _pem(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    monkeypatch.setenv("SPOTCKPT_SIGNING_KEY", text)
    for command in (["ls", str(tmp_path / "ck")], ["verify", str(tmp_path / "ck")]):
        with pytest.raises(SystemExit) as done:
            main(command)
        printed = capsys.readouterr()
        assert done.value.code == 2
        _never_shown(printed.out + printed.err, body)
        assert "SPOTCKPT_SIGNING_KEY: " in printed.err and "path" in printed.err


def test_secret_settings_are_declared_in_one_place() -> None:
    assert {"signing_key", "verify_keys", "storage_options"} <= SECRET_SETTINGS


def test_redact_masks_a_pem_block_wherever_it_appears(tmp_path: Path) -> None:
    text, body = _pem(tmp_path)
    for shown in (
        redact(f"cannot read key file {text}: File name too long"),
        redact(f"cannot read key file {' '.join(text.split())}: x"),  # folded onto one line
        redact(text.split("-----END")[0]),  # cut before its end line
    ):
        _never_shown(shown, body)
        assert "***" in shown
    assert redact("-----BEGIN PUBLIC KEY-----") == "-----BEGIN PUBLIC KEY-----"
