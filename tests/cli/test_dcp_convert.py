"""``spotckpt import-dcp`` and ``spotckpt export-dcp`` (docs/dcp.md, docs/cli.md): a standard DCP
run imported from S3 (moto) as a committed, verified step; exported back to a folder that DCP's
own tools read; exit statuses for a forged metadata (1), a missing step or name (2), an OUT that
holds a checkpoint (2); JSON reports; credentials never printed."""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from spotckpt.cli import main
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from tests_support import SCRIPT

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)},
        "step": seed,
    }


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(list(args))
    captured = capsys.readouterr()
    assert isinstance(done.value.code, int)
    return done.value.code, captured.out, captured.err


def _upload(folder: Path, uri: str, under: str) -> None:
    store = open_store(uri)
    for path in folder.iterdir():
        store.put(f"{under}/{path.name}", path.read_bytes())


def test_a_dcp_run_on_s3_is_imported_verified_and_exported_back(
    tmp_path: Path, s3_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp.save(_state(40), storage_writer=FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    _upload(tmp_path / "dcp", s3_uri, "step-40")
    spot = str(tmp_path / "spot")
    code, out, err = _run(capsys, "import-dcp", s3_uri, spot, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["step"] == 40 and report["tensors"] == 2 and report["values"] == 1
    assert verify_checkpoint(open_store(spot), 40).ok
    code, out, err = _run(capsys, "export-dcp", spot, str(tmp_path / "out"), "--step", "40")
    assert code == 0, err
    assert "exported step 40" in out
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert whole["step"] == 40
    assert all(torch.equal(whole["model"][k], v) for k, v in _state(40)["model"].items())


def test_exit_statuses_of_the_conversions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "dcp"
    dcp.save(_state(1), storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    spot = str(tmp_path / "spot")
    code, _, err = _run(capsys, "import-dcp", str(folder), spot)
    assert code == 2 and "--step" in err  # the folder names no step
    assert _run(capsys, "import-dcp", str(folder), spot, "--step", "1")[0] == 0
    code, _, err = _run(capsys, "import-dcp", str(folder), spot, "--step", "1")
    assert code == 2 and "already committed" in err
    assert _run(capsys, "import-dcp", str(folder), spot, "--step", "1", "--overwrite")[0] == 0
    code, _, err = _run(capsys, "import-dcp", str(tmp_path / "nothing"), spot, "--step", "1")
    assert code == 2
    out = str(tmp_path / "out")
    assert _run(capsys, "export-dcp", spot, out)[0] == 0
    code, _, err = _run(capsys, "export-dcp", spot, out)
    assert code == 2 and "--overwrite" in err
    assert _run(capsys, "export-dcp", spot, out, "--overwrite")[0] == 0
    code, _, err = _run(capsys, "export-dcp", spot, "s3://bucket/out")
    assert code == 2 and "local folder" in err
    code, _, _ = _run(capsys, "export-dcp", spot, out, "--step", "9")
    assert code == 2


class _Touch:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return exec, (f"open({str(self.path)!r}, 'w').close()",)


def test_a_forged_metadata_exits_1_and_runs_nothing_in_the_command(tmp_path: Path) -> None:
    folder = tmp_path / "dcp" / "step-3"
    dcp.save(_state(3), storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    marker = tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    done = subprocess.run(
        [str(SCRIPT), "import-dcp", str(tmp_path / "dcp"), str(tmp_path / "spot")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "refused as a DCP metadata" in done.stderr and "builtins.exec" in done.stderr
    assert not marker.exists()


def test_source_credentials_are_not_printed(
    tmp_path: Path, s3_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp.save(_state(2), storage_writer=FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    _upload(tmp_path / "dcp", s3_uri, "step-2")
    secret = "not-a-real-secret-8c1f"
    code, out, err = _run(
        capsys,
        "import-dcp",
        s3_uri,
        str(tmp_path / "spot"),
        "--source-option",
        f"aws_secret_access_key={secret}",
        "--source-option",
        "aws_access_key_id=testing",
        "--json",
    )
    assert code == 0, err  # moto takes any key
    assert secret not in out + err
    code, out, err = _run(  # and a failing one names its error without it
        capsys,
        "import-dcp",
        s3_uri + "-missing",
        str(tmp_path / "spot2"),
        "--source-option",
        f"aws_secret_access_key={secret}",
        "--source-option",
        "aws_access_key_id=testing",
    )
    assert code == 2 and secret not in out + err
