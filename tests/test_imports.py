"""What loads torch: the package, the storage layer and the fast CLI commands must not.

Each check runs in a fresh interpreter (this test process has torch loaded already). The console
script is run with ``PYTHONPROFILEIMPORTTIME=1``, which makes Python list every module it imports
on stderr; `export-hf`, which needs torch, shows that the listing does catch torch. (``verify``
needs torch too: it loads every stored value with ``torch.load(weights_only=True)``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import spotckpt
from spotckpt import CheckpointManager, TrainState
from spotckpt.format.dtypes import BY_NAME, dtype_of

from tests_support import SCRIPT

pytestmark = pytest.mark.process  # its tests start processes or servers


def _python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def _imported_modules(stderr: str) -> set[str]:
    """Module names from ``-X importtime`` lines: ``import time: self | cumulative | name``."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }


def _script_imports(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    env["PYTHONPROFILEIMPORTTIME"] = "1"
    result = subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )
    return result, _imported_modules(result.stderr)


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("imports") / "ckpt"
    model = nn.Linear(4, 2)
    with CheckpointManager(str(root), preemption=False) as manager:
        manager.save(1, TrainState(model=model, rng=False))
    return root


@pytest.mark.parametrize(
    "module",
    ["spotckpt", "spotckpt.cli", "spotckpt.storage", "spotckpt.config", "spotckpt.gc"],
)
def test_import_does_not_load_torch(module: str) -> None:
    result = _python(f"import {module}, sys; assert 'torch' not in sys.modules, '{module}'")
    assert result.returncode == 0, result.stderr


def test_open_store_for_each_builtin_scheme_without_torch(tmp_path: Path) -> None:
    result = _python(
        f"""
        import sys
        from spotckpt.storage import open_store
        stores = [
            open_store({str(tmp_path)!r}),
            open_store("memory://imports"),
            open_store(
                "s3://bucket/prefix",
                endpoint_url="http://127.0.0.1:9",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
                region_name="us-east-1",
            ),
            open_store("gs://bucket/prefix", endpoint_url="http://127.0.0.1:9", anonymous=True),
        ]
        for store in stores:
            store.close()
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if "torch" in m)
        """
    )
    assert result.returncode == 0, result.stderr


def test_cli_help_ls_inspect_gc_do_not_load_torch(committed: Path, tmp_path: Path) -> None:
    for args in (
        ["--help"],
        ["ls", str(committed)],
        ["ls", str(committed), "--all", "--json"],
        ["inspect", str(committed)],
        ["gc", str(committed), "--dry-run"],
        ["verify", "--help"],
    ):
        result, modules = _script_imports(*args, cwd=tmp_path)
        assert result.returncode == 0, (args, result.stderr[-2000:])
        assert "spotckpt.cli" in modules
        assert "torch" not in modules, args
    listing = _script_imports("ls", str(committed), cwd=tmp_path)[0].stdout
    assert listing.splitlines()[1].split()[:2] == ["1", "committed"]


def test_export_loads_torch_so_the_listing_sees_it(committed: Path, tmp_path: Path) -> None:
    result, modules = _script_imports(
        "export-hf", str(committed), str(tmp_path / "out"), "--prefix", "", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch" in modules


def test_cli_main_in_process_leaves_torch_unloaded(committed: Path) -> None:
    result = _python(
        f"""
        import json, sys
        from spotckpt.cli import main
        try:
            main(["ls", {str(committed)!r}, "--json"])
        except SystemExit as stop:
            code = stop.code
        print(json.dumps({{"code": code, "torch": "torch" in sys.modules}}))
        """
    )
    assert result.returncode == 0, result.stderr
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == {"code": 0, "torch": False}


def test_lazy_package_exports_every_public_name() -> None:
    from spotckpt.manager import CheckpointManager as Direct

    assert spotckpt.CheckpointManager is Direct
    for name in spotckpt.__all__:
        assert getattr(spotckpt, name) is not None, name
    assert set(spotckpt.__all__) <= set(dir(spotckpt))
    assert spotckpt.PREEMPTED_EXIT_CODE == 75
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = spotckpt.no_such_name  # type: ignore[attr-defined]


def test_dtype_table_agrees_with_torch() -> None:
    for dtype in BY_NAME.values():
        assert dtype.itemsize == dtype.torch_dtype.itemsize, dtype.name
        assert dtype.is_floating_point == dtype.torch_dtype.is_floating_point, dtype.name
        assert dtype_of(dtype.torch_dtype) is dtype
    with pytest.raises(ValueError, match="complex128 cannot be stored"):
        dtype_of(torch.complex128)
