"""Each optional part, used without its extra, says which ``pip install 'spotckpt[x]'`` brings it.

A None in ``sys.modules`` is Python's documented way to make an import fail as if the package were
not installed; the module that imports the optional package is dropped from ``sys.modules`` first
so that it runs its imports again. (`tests/test_install.py` checks the same in a real core-only
virtual environment.)
"""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from spotckpt.config import Settings
from spotckpt.errors import ConfigError, MissingDependencyError
from spotckpt.storage import open_store
from spotckpt.storage.registry import store_extras
from spotckpt.tiers.erasure import data_block, parity_block


def _block(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        monkeypatch.delitem(sys.modules, name)
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)


def _forget(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    monkeypatch.delitem(sys.modules, module, raising=False)


def test_erasure_coding_without_zfec_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [b"abcd", b"efgh"]
    parity = parity_block(blocks, 1, 0)
    assert data_block({1: blocks[1], 2: parity}, 2, 1, 0) == blocks[0]  # zfec, installed here
    _block(monkeypatch, "zfec")
    with pytest.raises(MissingDependencyError, match=r"pip install 'spotckpt\[erasure\]'"):
        parity_block(blocks, 1, 0)
    with pytest.raises(ConfigError, match=r"redundancy: ec:K\+M needs zfec: .*spotckpt\[erasure\]"):
        Settings(redundancy="ec:2+1")
    assert Settings(redundancy="replicate:2").redundancy == "replicate:2"  # needs no zfec


def test_gcs_store_without_google_cloud_storage_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _block(monkeypatch, "google")
    _forget(monkeypatch, "spotckpt.storage.gcs")
    with pytest.raises(MissingDependencyError, match=r"gs:// store needs .*spotckpt\[gcs\]'"):
        open_store("gs://bucket/prefix")


@pytest.mark.parametrize(
    ("module", "packages", "extra"),
    [
        ("spotckpt.integrations.lightning", ("lightning", "pytorch_lightning"), "lightning"),
        ("spotckpt.integrations.transformers", ("transformers",), "transformers"),
        ("spotckpt.integrations.torchtitan", ("torchtitan", "torchdata"), "torchtitan"),
    ],
)
def test_integration_without_its_framework_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, packages: tuple[str, ...], extra: str
) -> None:
    _block(monkeypatch, *packages)
    _forget(monkeypatch, module)
    with pytest.raises(MissingDependencyError) as raised:
        importlib.import_module(module)
    assert f"{module} needs the {extra} extra: pip install 'spotckpt[{extra}]'" in str(raised.value)
    assert isinstance(raised.value, ImportError)  # code that tries an optional import still can


_PACKAGES_OF_EXTRA = {"gcs": ("google",), "azure": ("azure",), "fsspec": ("fsspec",)}
"""The top-level packages each store extra brings, which `_block` makes unimportable."""


@pytest.mark.parametrize(
    ("scheme", "extra"),
    [(scheme, extra) for scheme, extra in sorted(store_extras().items()) if extra is not None],
)
def test_every_store_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    scheme: str,
    extra: str,
) -> None:
    """One rule for every built-in scheme (the registry's table), and the CLI says the same."""
    from spotckpt.cli import main

    _block(monkeypatch, *_PACKAGES_OF_EXTRA[extra])
    for module in [m for m in sys.modules if m.startswith("spotckpt.storage.")]:
        if module.rsplit(".", 1)[1] in ("gcs", "azure", "fsspec", "_gcs_http"):
            _forget(monkeypatch, module)
    uri = f"{scheme}memory://c/run" if scheme.endswith("+") else f"{scheme}://c/run"
    wanted = f"needs the {extra} extra: pip install 'spotckpt[{extra}]'"
    with pytest.raises(MissingDependencyError, match=re.escape(wanted)):
        open_store(uri)
    with pytest.raises(SystemExit):
        main(["ls", uri])
    assert wanted in capsys.readouterr().err


def test_every_built_in_scheme_is_in_the_table_of_extras() -> None:
    assert {"s3", "gs", "gcs", "az", "abfs", "abfss", "fsspec+", "file", "memory"} <= set(
        store_extras()
    )
    assert store_extras()["s3"] is None and store_extras()["az"] == "azure"
