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
        ('uri = "memory://x"\nkeep_lst = 3\n', "spotckpt.toml: keep_lst: unknown setting"),
        ('uri = "memory://x"\nkeep_last = "three"\n', "spotckpt.toml: keep_last: must be int"),
        ('uri = "memory://x"\nasync_save = 1\n', "spotckpt.toml: async_save: must be bool"),
        ('uri = "memory://x"\nkeep_last = 0\n', "spotckpt.toml: keep_last: must be at least 1"),
        ('uri = "memory://x"\nsave_budget_s = nan\n', "save_budget_s: must be a positive"),
        ('uri = ""\n', "spotckpt.toml: uri: must be a non-empty string"),
        ("uri = [\n", "cannot read config file .*spotckpt.toml: it is not valid TOML"),
    ],
)
def test_file_errors(tmp_path: Path, content: str, match: str) -> None:
    (tmp_path / "spotckpt.toml").write_text(content)
    with pytest.raises(ConfigError, match=match) as caught:
        Config.load(tmp_path)
    assert str(tmp_path / "spotckpt.toml") in str(caught.value)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b'uri = "memory://x"\n\xff\xfe\x00\x81', "it is not UTF-8 TOML .*byte 0xff at offset 19"),
        (b"\x00\x01\x02binary", "it is not valid TOML"),
    ],
)
def test_binary_file_names_the_file(tmp_path: Path, data: bytes, match: str) -> None:
    (tmp_path / "spotckpt.toml").write_bytes(data)
    with pytest.raises(ConfigError, match=match) as caught:
        Config.load(tmp_path)
    assert str(caught.value).startswith(f"cannot read config file {tmp_path / 'spotckpt.toml'}: ")


def test_pyproject_tool_table_must_be_a_table(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool]\nspotckpt = "memory://x"\n')
    with pytest.raises(ConfigError, match=r"pyproject.toml: tool.spotckpt: must be a table"):
        Config.load(tmp_path)


def test_env_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTCKPT_URI", "memory://x")
    monkeypatch.setenv("SPOTCKPT_KEEP_LAST", "many")
    with pytest.raises(ConfigError, match=r"^SPOTCKPT_KEEP_LAST: must be int, got 'many'$"):
        Config.load(tmp_path)
    monkeypatch.setenv("SPOTCKPT_KEEP_LAST", "0")
    with pytest.raises(ConfigError, match=r"^SPOTCKPT_KEEP_LAST: must be at least 1, got 0$"):
        Config.load(tmp_path)
    monkeypatch.delenv("SPOTCKPT_KEEP_LAST")
    monkeypatch.setenv("SPOTCKPT_KEEPLAST", "3")
    with pytest.raises(ConfigError, match=r"^SPOTCKPT_KEEPLAST: unknown environment variable"):
        Config.load(tmp_path)
    monkeypatch.delenv("SPOTCKPT_KEEPLAST")
    with pytest.raises(ConfigError, match=r"^keyword argument agree_every: must be at least 1"):
        Config.load(tmp_path, agree_every=0)
    with pytest.raises(ConfigError, match=r"^interval_steps: must be at least 1"):
        Config(uri="memory://x", interval_steps=0)


SECRET = "hunter2-S3CR3T"


def test_errors_and_repr_never_show_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTCKPT_URI", "memory://x")
    monkeypatch.setenv("SPOTCKPT_STORAGE_OPTIONS", f'{{"aws_secret_access_key": "{SECRET}",')
    with pytest.raises(ConfigError, match="SPOTCKPT_STORAGE_OPTIONS: must be a JSON object") as a:
        Config.load(tmp_path)
    monkeypatch.setenv("SPOTCKPT_STORAGE_OPTIONS", f'["aws_secret_access_key={SECRET}"]')
    with pytest.raises(ConfigError, match="must be a JSON object, got list") as b:
        Config.load(tmp_path)
    monkeypatch.delenv("SPOTCKPT_STORAGE_OPTIONS")
    (tmp_path / "spotckpt.toml").write_text(f'storage_options = "token={SECRET}"\n')
    with pytest.raises(ConfigError, match="storage_options: must be a table") as c:
        Config.load(tmp_path)
    (tmp_path / "spotckpt.toml").write_text(f'keep_last = "https://user:{SECRET}@host/x"\n')
    with pytest.raises(ConfigError, match="keep_last: must be int or None") as d:
        Config.load(tmp_path)
    (tmp_path / "spotckpt.toml").unlink()
    config = Config.load(
        tmp_path,
        uri=f"s3://user:{SECRET}@bucket/x",
        storage_options={"aws_secret_access_key": SECRET, "endpoint_url": "http://127.0.0.1:9"},
    )
    for text in (str(a.value), str(b.value), str(c.value), str(d.value), repr(config)):
        assert SECRET not in text, text
    assert "http://127.0.0.1:9" in repr(config) and "s3://***@bucket/x" in repr(config)


def test_missing_uri(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no checkpoint URI: pass uri= or set SPOTCKPT_URI"):
        Config.load(tmp_path)


def test_manager_from_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTCKPT_URI", str(tmp_path / "ck"))
    monkeypatch.setenv("SPOTCKPT_KEEP_LAST", "2")
    monkeypatch.setenv("SPOTCKPT_PREEMPTION", "false")
    monkeypatch.chdir(tmp_path)
    with CheckpointManager.from_config(interval_steps=3) as mgr:
        assert mgr.keep_last == 2 and mgr.interval_steps == 3 and mgr.watcher is None


def test_manager_and_config_share_one_declaration_of_the_settings() -> None:
    from spotckpt import CheckpointManager
    from spotckpt.config import Settings

    config = Config(uri="memory://one")
    with CheckpointManager("memory://one", preemption=False) as mgr:
        assert mgr.keep_last == config.keep_last == Settings().keep_last == 3
        assert mgr.settings == Settings(preemption=False)
    assert set(config.manager_kwargs()) == {f for f in Settings.__dataclass_fields__}
    with pytest.raises(ConfigError, match="keep_last: must be at least 1"):
        CheckpointManager("memory://one", keep_last=0)
    with pytest.raises(TypeError, match="keep_lats"):
        CheckpointManager("memory://one", keep_lats=2)


def test_the_auto_interval_has_a_finite_default_ceiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_interval_steps defaults to DEFAULT_MAX_INTERVAL_STEPS, None means that default (not
    unbounded), and a min_interval_steps above the default ceiling is an error that says what to
    set, from keyword arguments, the environment and spotckpt.toml alike."""
    from spotckpt.config import DEFAULT_MAX_INTERVAL_STEPS, Settings

    above = DEFAULT_MAX_INTERVAL_STEPS + 1
    conflict = (
        rf"max_interval_steps: must be at least min_interval_steps \({above}\), got "
        rf"{DEFAULT_MAX_INTERVAL_STEPS} \(the default\): set max_interval_steps"
    )
    assert Settings().max_interval_steps == DEFAULT_MAX_INTERVAL_STEPS
    assert Settings(max_interval_steps=None).max_interval_steps == DEFAULT_MAX_INTERVAL_STEPS
    with CheckpointManager(str(tmp_path / "ck"), preemption=False, interval_steps="auto") as mgr:
        assert mgr.goodput.model.maximum == DEFAULT_MAX_INTERVAL_STEPS
    # keyword arguments
    with pytest.raises(ConfigError, match=conflict):
        CheckpointManager("memory://one", min_interval_steps=above)
    with pytest.raises(ConfigError, match=conflict):
        Config.load(tmp_path, uri="memory://x", min_interval_steps=above)
    assert Settings(min_interval_steps=above, max_interval_steps=above).max_interval_steps == above
    # the environment
    monkeypatch.setenv("SPOTCKPT_URI", "memory://x")
    monkeypatch.setenv("SPOTCKPT_MAX_INTERVAL_STEPS", "none")
    assert Config.load(tmp_path).max_interval_steps == DEFAULT_MAX_INTERVAL_STEPS
    monkeypatch.setenv("SPOTCKPT_MAX_INTERVAL_STEPS", "0")
    with pytest.raises(ConfigError, match=r"^SPOTCKPT_MAX_INTERVAL_STEPS: must be at least 1"):
        Config.load(tmp_path)
    monkeypatch.delenv("SPOTCKPT_MAX_INTERVAL_STEPS")
    monkeypatch.setenv("SPOTCKPT_MIN_INTERVAL_STEPS", str(above))
    with pytest.raises(ConfigError, match=conflict):
        Config.load(tmp_path)
    monkeypatch.setenv("SPOTCKPT_MAX_INTERVAL_STEPS", str(2 * above))
    assert Config.load(tmp_path).max_interval_steps == 2 * above
    monkeypatch.delenv("SPOTCKPT_MIN_INTERVAL_STEPS")
    monkeypatch.delenv("SPOTCKPT_MAX_INTERVAL_STEPS")
    # spotckpt.toml
    path = tmp_path / "spotckpt.toml"
    path.write_text(f"min_interval_steps = {above}\n")
    with pytest.raises(ConfigError, match=conflict):
        Config.load(tmp_path)
    path.write_text(f"min_interval_steps = {above}\nmax_interval_steps = {above}\n")
    assert Config.load(tmp_path).max_interval_steps == above
    path.write_text("max_interval_steps = 0\n")
    with pytest.raises(ConfigError, match=r"spotckpt.toml: max_interval_steps: must be at least 1"):
        Config.load(tmp_path)
    path.write_text('max_interval_steps = "none"\n')
    with pytest.raises(
        ConfigError, match=r"spotckpt.toml: max_interval_steps: must be int or None"
    ):
        Config.load(tmp_path)
