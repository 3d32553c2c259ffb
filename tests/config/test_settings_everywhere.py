"""One precedence rule for every way a manager is built: keyword argument > ``SPOTCKPT_*``
variable > ``spotckpt.toml`` > default (`spotckpt.config.Config.load`).

The matrix below crosses settings with entry points: each setting, given in the environment only,
must reach the manager that each entry point builds (the plain constructor as README's quick
start writes it, `from_config`, the Lightning and transformers callbacks, torchtitan's trainer),
and the command line must apply the signing key from the environment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.config import Config
from spotckpt.errors import ConfigError

from tests_support import write_signing_key


@contextmanager
def _plain(uri: str | None, tmp_path: Path) -> Iterator[CheckpointManager]:
    assert uri is not None
    with CheckpointManager(uri) as manager:
        yield manager


@contextmanager
def _from_config(uri: str | None, tmp_path: Path) -> Iterator[CheckpointManager]:
    with CheckpointManager.from_config(uri=uri) as manager:
        yield manager


@contextmanager
def _lightning(uri: str | None, tmp_path: Path) -> Iterator[CheckpointManager]:
    import lightning.pytorch as pl

    from spotckpt.integrations.lightning import SpotckptCallback

    callback = SpotckptCallback() if uri is None else SpotckptCallback(uri)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    callback.setup(trainer, pl.LightningModule(), "fit")
    assert callback.manager is not None
    try:
        yield callback.manager
    finally:
        callback.teardown(trainer, pl.LightningModule(), "fit")


@contextmanager
def _transformers(uri: str | None, tmp_path: Path) -> Iterator[CheckpointManager]:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from spotckpt.integrations.transformers import SpotckptCallback

    callback = SpotckptCallback(uri)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    callback.on_init_end(args, TrainerState(), TrainerControl())
    assert callback.manager is not None
    try:
        yield callback.manager
    finally:
        callback.on_train_end(args, TrainerState(), TrainerControl())


@contextmanager
def _torchtitan(
    uri: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[CheckpointManager]:
    """`SpotckptTrainer` up to the spotckpt manager it hands to its checkpointer: torchtitan's
    own Trainer (model, data, process group) is left out, the config-to-manager path is real."""
    from torchtitan.config import ConfigManager

    from spotckpt.integrations import torchtitan as titan

    built: dict[str, Any] = {}

    def checkpointer(**kwargs: Any) -> Any:
        built.update(kwargs)
        return kwargs["manager"]

    monkeypatch.setattr(titan.Trainer, "__init__", lambda self, job_config: None)
    monkeypatch.setattr(titan, "_needs_the_cpu", lambda: False)
    monkeypatch.setattr(titan, "SpotckptCheckpointManager", checkpointer)
    trainer = titan.SpotckptTrainer.__new__(titan.SpotckptTrainer)
    for name in ("dataloader", "model_parts", "optimizers", "lr_schedulers"):
        setattr(trainer, name, None)
    config = None if uri is None else Config.load(uri=uri)
    titan.SpotckptTrainer.__init__(trainer, ConfigManager().parse_args([]), spotckpt_config=config)
    with built["manager"] as manager:
        yield manager


ENTRY_POINTS: dict[str, Callable[..., AbstractContextManager[CheckpointManager]]] = {
    # each builds a manager through one entry point (uri None: not given) and closes it after
    "plain": _plain,
    "from_config": _from_config,
    "lightning": _lightning,
    "transformers": _transformers,
    "torchtitan": _torchtitan,
}


@dataclasses.dataclass(frozen=True)
class EnvSetting:
    """A setting given only in the environment, and how to see it applied to a manager."""

    variable: str
    value: Callable[[Path], str]
    applied: Callable[[CheckpointManager], bool]


SETTINGS = {
    "keep_last": EnvSetting("SPOTCKPT_KEEP_LAST", lambda _: "2", lambda m: m.keep_last == 2),
    "interval_steps": EnvSetting(
        "SPOTCKPT_INTERVAL_STEPS", lambda _: "7", lambda m: m.interval_steps == 7
    ),
    "signing_key": EnvSetting(
        "SPOTCKPT_SIGNING_KEY",
        lambda tmp: str(write_signing_key(tmp / "signing.pem")),
        lambda m: m.keyring is not None and m.keyring.signer is not None,
    ),
    "preemption": EnvSetting("SPOTCKPT_PREEMPTION", lambda _: "false", lambda m: m.watcher is None),
}


def _build(
    entry: str, uri: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AbstractContextManager[CheckpointManager]:
    if entry == "torchtitan":
        return _torchtitan(uri, tmp_path, monkeypatch)
    return ENTRY_POINTS[entry](uri, tmp_path)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_setting_from_the_environment_reaches_every_entry_point(
    entry: str, setting: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    given = SETTINGS[setting]
    monkeypatch.setenv("SPOTCKPT_PREEMPTION", "false")  # no watcher threads in this process
    monkeypatch.setenv(given.variable, given.value(tmp_path))
    with _build(entry, str(tmp_path / "ck"), tmp_path, monkeypatch) as manager:
        assert given.applied(manager), (entry, setting, manager.settings)


@pytest.mark.parametrize("entry", sorted(set(ENTRY_POINTS) - {"plain"}))
def test_the_uri_from_the_environment_reaches_every_entry_point_that_may_leave_it_out(
    entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPOTCKPT_PREEMPTION", "false")
    monkeypatch.setenv("SPOTCKPT_URI", str(tmp_path / "from-env"))
    with _build(entry, None, tmp_path, monkeypatch) as manager:
        assert manager.uri == str(tmp_path / "from-env")


def test_readme_quick_start_saves_on_the_interval_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first hour of issue 44: 40 steps of maybe_save with SPOTCKPT_INTERVAL_STEPS set."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPOTCKPT_URI", str(tmp_path / "elsewhere"))  # the argument wins
    monkeypatch.setenv("SPOTCKPT_KEEP_LAST", "2")
    monkeypatch.setenv("SPOTCKPT_INTERVAL_STEPS", "10")
    monkeypatch.setenv("SPOTCKPT_PREEMPTION", "false")
    state = {"w": torch.zeros(4)}
    with CheckpointManager(str(tmp_path / "ck")) as manager:
        for step in range(1, 41):
            state["w"] += 1
            manager.maybe_save(step, state)
        manager.wait()
        assert manager.uri == str(tmp_path / "ck")
        assert manager.steps() == [30, 40]
    assert not (tmp_path / "elsewhere").exists()


def test_keyword_beats_environment_beats_file_beats_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spotckpt.toml").write_text(
        "keep_last = 5\ninterval_steps = 50\nagree_every = 4\npreemption = false\n"
    )
    monkeypatch.setenv("SPOTCKPT_INTERVAL_STEPS", "25")
    monkeypatch.setenv("SPOTCKPT_AGREE_EVERY", "3")
    with CheckpointManager(str(tmp_path / "ck"), agree_every=2) as manager:
        assert manager.keep_last == 5  # the file
        assert manager.interval_steps == 25  # the environment over the file
        assert manager.agree_every == 2  # the keyword over both
        assert manager.settings.max_events == 500  # the default
    with CheckpointManager(str(tmp_path / "ck"), keep_last=None, interval_steps=None) as manager:
        assert manager.keep_last is None and manager.interval_steps is None  # None, given, wins
    with CheckpointManager.from_config(uri=str(tmp_path / "ck"), keep_last=None) as manager:
        assert manager.keep_last is None  # the same rule through from_config


def test_a_bad_variable_is_an_error_of_the_plain_constructor_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPOTCKPT_KEEP_LAST", "many")
    with pytest.raises(ConfigError, match=r"^SPOTCKPT_KEEP_LAST: must be int, got 'many'$"):
        CheckpointManager(str(tmp_path / "ck"), preemption=False)
    monkeypatch.delenv("SPOTCKPT_KEEP_LAST")
    with pytest.raises(TypeError, match="keep_lats"):
        CheckpointManager(str(tmp_path / "ck"), keep_lats=2)


def test_the_command_line_checks_the_signature_with_the_key_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manager and the CLI, both given the key in the environment only, agree: the manager
    signs, and ``verify`` says that it checked the signature, with which key."""
    from spotckpt.cli import main
    from spotckpt.format.signing import key_id

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPOTCKPT_SIGNING_KEY", str(write_signing_key(tmp_path / "k.pem")))
    root = str(tmp_path / "ck")
    with CheckpointManager(root, preemption=False) as manager:
        manager.save(3, {"w": torch.ones(4)})
        assert manager.keyring is not None
        expected = key_id(manager.keyring.verifiers[0])
    with pytest.raises(SystemExit) as done:
        main(["verify", root])
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert f"signature checked with key {expected}" in out
