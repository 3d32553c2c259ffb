"""Config precedence (kwargs > env > spotckpt.toml > pyproject) and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotckpt import CheckpointManager, Config, ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("SPOTCKPT_"):
            monkeypatch.delenv(name)


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.spotckpt]\nuri = "memory://from-pyproject"\nkeep_last = 9\ninterval_steps = 7\n'
        "agree_every = 4\n"
    )
    (tmp_path / "spotckpt.toml").write_text(
        'uri = "memory://from-file"\nkeep_last = 5\ninterval_steps = 50\n'
        "[storage_options]\npart_size = 8388608\n"
    )
    monkeypatch.setenv("SPOTCKPT_KEEP_LAST", "4")
    monkeypatch.setenv("SPOTCKPT_ASYNC_SAVE", "true")
    config = Config.load(tmp_path, interval_steps=25)
    assert config.uri == "memory://from-file"
    assert config.keep_last == 4  # env beats file
    assert config.interval_steps == 25  # kwargs beat env and file
    assert config.async_save is True
    assert config.agree_every == 4  # only pyproject sets it
    assert config.storage_options == {"part_size": 8388608}
    monkeypatch.setenv("SPOTCKPT_URI", "memory://from-env")
    assert Config.load(tmp_path).uri == "memory://from-env"


def test_explicit_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "elsewhere.toml"
    path.write_text('uri = "memory://explicit"\n')
    monkeypatch.setenv("SPOTCKPT_CONFIG", str(path))
    assert Config.load(tmp_path / "nowhere").uri == "memory://explicit"
    monkeypatch.setenv("SPOTCKPT_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="not a readable file"):
        Config.load(tmp_path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('uri = "memory://x"\nkeep_lst = 3\n', "unknown setting 'keep_lst'"),
        ('uri = "memory://x"\nkeep_last = "three"\n', "'keep_last' .* must be int"),
        ('uri = "memory://x"\nasync_save = 1\n', "'async_save' .* must be bool"),
        ('uri = "memory://x"\nkeep_last = 0\n', "keep_last must be at least 1"),
        ("uri = [\n", "cannot read config file"),
    ],
)
def test_file_errors(tmp_path: Path, content: str, match: str) -> None:
    (tmp_path / "spotckpt.toml").write_text(content)
    with pytest.raises(ConfigError, match=match):
        Config.load(tmp_path)


def test_env_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTCKPT_URI", "memory://x")
    monkeypatch.setenv("SPOTCKPT_KEEP_LAST", "many")
    with pytest.raises(ConfigError, match="SPOTCKPT_KEEP_LAST must be int"):
        Config.load(tmp_path)
    monkeypatch.delenv("SPOTCKPT_KEEP_LAST")
    monkeypatch.setenv("SPOTCKPT_KEEPLAST", "3")
    with pytest.raises(ConfigError, match="unknown environment variable SPOTCKPT_KEEPLAST"):
        Config.load(tmp_path)


def test_missing_uri(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no checkpoint URI"):
        Config.load(tmp_path)


def test_manager_from_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTCKPT_URI", str(tmp_path / "ck"))
    monkeypatch.setenv("SPOTCKPT_KEEP_LAST", "2")
    monkeypatch.setenv("SPOTCKPT_PREEMPTION", "false")
    monkeypatch.chdir(tmp_path)
    with CheckpointManager.from_config(interval_steps=3) as mgr:
        assert mgr.keep_last == 2 and mgr.interval_steps == 3 and mgr.watcher is None
