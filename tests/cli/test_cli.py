"""The installed ``spotckpt`` console script, run as a child process on local folders and moto S3.

Each child imports torch (seconds on a small machine), so independent commands of one test run
concurrently and assertions share invocations.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from spotckpt import CheckpointManager, TrainState
from spotckpt.cli import parse_duration, parse_size
from spotckpt.config import DEFAULT_MAX_INTERVAL_STEPS
from spotckpt.format.manifest import Manifest
from spotckpt.goodput import EventLog
from spotckpt.layout import EVENT_SUMMARY_KEY, manifest_key, step_folder
from spotckpt.storage import open_store

from fsdp_checkpoints import (
    STEP,
    assert_same,
    fsdp_checkpoint,
    full_weights,
    tied_checkpoint,
    tied_weights,
)
from tests_support import FORGED_GOODPUT, REPO, SCRIPT

MIB = 1 << 20


def _script() -> str:
    if SCRIPT.exists():
        return str(SCRIPT)
    found = shutil.which("spotckpt")
    if found is None:
        pytest.fail("the spotckpt console script is not installed: pip install --no-deps -e .")
    return found


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    env.update(extra or {})
    return env


def run_all(
    commands: Sequence[Sequence[str]],
    cwd: Path,
    env: dict[str, str] | None = None,
    envs: Sequence[dict[str, str]] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``spotckpt <args>`` for each command at once (`envs`: extra variables for each);
    wait for all."""
    extras = envs if envs is not None else [{}] * len(commands)
    children = [
        subprocess.Popen(
            [_script(), *args],
            cwd=cwd,
            env=_env({**(env or {}), **extra}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, extra in zip(commands, extras, strict=True)
    ]
    results = []
    for args, child in zip(commands, children, strict=True):
        out, err = child.communicate(timeout=300)
        results.append(subprocess.CompletedProcess([_script(), *args], child.returncode, out, err))
    return results


def run(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run one ``spotckpt`` command."""
    return run_all([args], cwd, env)[0]


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """Assert the exit status and a single-line error on stderr; return that line."""
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("spotckpt: error: ")
    return lines[0]


def _save(uri: str, steps: Sequence[int], **options: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with CheckpointManager(uri, preemption=False, storage_options=options) as manager:
        for step in steps:
            manager.save(step, TrainState(model=model, rng=False), user_metadata={"loss": 0.5})


@pytest.fixture
def fsdp_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(fsdp_checkpoint(), tmp_path / "ckpt"))


def _upload_tree(root: Path, client: Any, bucket: str, prefix: str) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(root).as_posix()}"
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())


@pytest.mark.process
def test_ls_inspect_verify_on_local_folder(fsdp_copy: Path, tmp_path: Path) -> None:
    ls, inspect, verify = run_all(
        [
            ["ls", str(fsdp_copy)],
            ["inspect", str(fsdp_copy), "--json"],
            ["verify", str(fsdp_copy)],
        ],
        cwd=tmp_path,
    )
    assert ls.returncode == 0, ls.stderr
    header, row = ls.stdout.splitlines()
    columns = [
        "STEP",
        "STATUS",
        "CREATED",
        "(UTC)",
        "SIZE",
        "REFERENCED",
        "WORLD",
        "OBJECTS",
        "ATTEMPT",
    ]
    assert header.split() == columns
    manifest = Manifest.from_json((fsdp_copy / manifest_key(STEP)).read_bytes())
    cells = row.split()
    assert cells[:2] == [str(STEP), "committed"]
    assert cells[-3:] == ["4", "4", manifest.attempt]  # world size, objects, attempt

    assert inspect.returncode == 0, inspect.stderr
    summary = json.loads(inspect.stdout)
    weight = summary["tensors"]["model.0.weight"]
    assert weight["dtype"] == "float32" and weight["shape"] == [30, 16]
    assert weight["sharding"] == "4 chunks on dim 0" and len(weight["chunks"]) == 4
    assert summary["tensors"]["model.counts"]["sharding"] == "whole"
    assert summary["world_size"] == 4 and summary["step"] == STEP

    assert verify.returncode == 0, verify.stderr
    assert verify.stdout.startswith(f"step {STEP}: OK (4 objects,")
    assert verify.stderr == ""  # no progress bar when stderr is not a terminal


@pytest.mark.process
def test_verify_names_each_damaged_object_and_exits_1(fsdp_copy: Path, tmp_path: Path) -> None:
    manifest = Manifest.from_json((fsdp_copy / manifest_key(STEP)).read_bytes())
    folder = fsdp_copy / step_folder(STEP)
    keys = sorted(manifest.objects)
    chunk = next(c for c in manifest.tensors["model.0.weight"].chunks if c.location.key == keys[0])
    data = bytearray((folder / keys[0]).read_bytes())
    data[chunk.location.offset] ^= 0x01
    (folder / keys[0]).write_bytes(bytes(data))
    (folder / keys[1]).unlink()
    text, as_json = run_all(
        [["verify", str(fsdp_copy)], ["verify", str(fsdp_copy), "--step", str(STEP), "--json"]],
        cwd=tmp_path,
    )
    line = one_line_error(text, 1)
    assert "failed verification: 2 problems" in line
    assert f"{step_folder(STEP)}/{keys[0]}" in text.stdout and "model.0.weight" in text.stdout
    assert f"{step_folder(STEP)}/{keys[1]}" in text.stdout and "missing" in text.stdout
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert report["ok"] is False
    assert {(p["kind"], p["key"]) for p in report["problems"]} == {
        ("crc32c", f"{step_folder(STEP)}/{keys[0]}"),
        ("missing", f"{step_folder(STEP)}/{keys[1]}"),
    }


def test_s3_verify_ls_all_and_storage_options(
    s3_uri: str, s3_client: Any, s3_bucket: str, tmp_path: Path
) -> None:
    _save(s3_uri, [1, 2], part_size=5 * MIB)
    store = open_store(s3_uri, part_size=5 * MIB)
    manifest = Manifest.from_json(store.get(manifest_key(2)))
    key = f"runs/exp1/{step_folder(2)}/{next(iter(manifest.objects))}"
    body = bytearray(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x10
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    s3_client.put_object(
        Bucket=s3_bucket, Key="runs/exp1/step-000000003/a-partial/r00000-000.safetensors", Body=b"x"
    )
    s3_client.create_multipart_upload(
        Bucket=s3_bucket, Key="runs/exp1/step-000000003/a-partial/r00001-000.safetensors"
    )
    # Config: spotckpt.toml gives the URI and a part size that S3 refuses; -o overrides it.
    (tmp_path / "spotckpt.toml").write_text(
        f'uri = "{s3_uri}"\n[storage_options]\npart_size = 1024\n'
    )
    verify, ls_all, ls_plain, refused = run_all(
        [
            ["verify", "-o", f"part_size={5 * MIB}"],
            ["ls", s3_uri, "--all", "--json", "-o", f"part_size={5 * MIB}"],
            ["ls", "-o", f"part_size={5 * MIB}"],
            ["ls"],
        ],
        cwd=tmp_path,
    )
    one_line_error(verify, 1)
    assert f"{step_folder(2)}/{next(iter(manifest.objects))}" in verify.stdout
    assert "crc32c" in verify.stdout
    rows = json.loads(ls_all.stdout)["checkpoints"]
    assert [(r["step"], r["status"]) for r in rows] == [
        (1, "committed"),
        (2, "committed"),
        (3, "uncommitted"),
        (3, "upload"),
    ]
    assert rows[3]["key"] == "step-000000003/a-partial/r00001-000.safetensors"
    assert [line.split()[1] for line in ls_plain.stdout.splitlines()[1:]] == ["committed"] * 2
    assert "part_size" in one_line_error(refused, 2)


@pytest.mark.process
def test_gc_dry_run_then_real(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(str(root), [1, 2, 3])
    old = time.time() - 3 * 3600
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))
    stale = root / "step-000000004/a-crashed/r00000-000.safetensors"
    fresh = root / "step-000000005/a-writing/r00000-000.safetensors"
    for path in (stale, fresh):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"partial")
    os.utime(stale, (old, old))
    before = sorted(p for p in root.rglob("*") if p.is_file())

    dry = run("gc", str(root), "--dry-run", "--keep-last", "2", "--json", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert sorted(p for p in root.rglob("*") if p.is_file()) == before
    planned = json.loads(dry.stdout)
    assert planned["dry_run"] is True
    assert {(a["kind"], a["target"]) for a in planned["actions"]} == {
        ("retention", "step-000000001/"),
        ("uncommitted", "step-000000004/a-crashed/"),
    }

    real = run("gc", str(root), "--keep-last", "2", "--safety-age", "2h", cwd=tmp_path)
    assert real.returncode == 0, real.stderr
    assert "deleted retention step-000000001/" in real.stdout
    assert "deleted uncommitted step-000000004/" in real.stdout
    assert "kept step-000000005/" in real.stdout
    assert not (root / "step-000000001").exists() and not stale.exists()
    assert (
        fresh.exists() and (root / manifest_key(3)).exists() and (root / manifest_key(2)).exists()
    )


def test_export_hf_from_s3_and_local(
    fsdp_copy: Path, s3_uri: str, s3_client: Any, s3_bucket: str, tmp_path: Path
) -> None:
    _upload_tree(fsdp_copy, s3_client, s3_bucket, "runs/exp1")
    sharded, single = run_all(
        [
            [
                "export-hf",
                s3_uri,
                "--step",
                str(STEP),
                str(tmp_path / "sharded"),
                "--max-shard-size",
                "1KB",
                "--json",
            ],
            ["export-hf", str(fsdp_copy), str(tmp_path / "single"), "--dtype", "bfloat16"],
        ],
        cwd=tmp_path,
    )
    assert sharded.returncode == 0, sharded.stderr
    report = json.loads(sharded.stdout)
    assert len(report["files"]) >= 3 and report["index"] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "sharded" / report["index"]).read_text())
    loaded: dict[str, torch.Tensor] = {}
    for name in report["files"]:
        loaded.update(load_file(tmp_path / "sharded" / name))
    want = full_weights()
    assert_same(loaded, want)
    assert index["metadata"]["total_size"] == report["total_size"]
    assert set(index["weight_map"].values()) == set(report["files"])

    assert single.returncode == 0, single.stderr
    assert "model.safetensors" in single.stdout
    cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in want.items()}
    assert_same(load_file(tmp_path / "single" / "model.safetensors"), cast)


@pytest.mark.process
def test_export_hf_writes_tied_weights_once_and_copies_includes(tmp_path: Path) -> None:
    tied = Path(shutil.copytree(tied_checkpoint(), tmp_path / "tied"))
    template = tmp_path / "template"
    template.mkdir()
    (template / "config.json").write_text('{"model_type": "llama"}')
    (template / "tokenizer.json").write_text('{"version": "1.0"}')
    odd = tmp_path / "config.json\x1b[2J"
    odd.write_text("{}")
    text, as_json, keep, refused = run_all(
        [
            ["export-hf", str(tied), str(tmp_path / "text"), "--include", str(template)],
            [
                *["export-hf", str(tied), str(tmp_path / "json"), "--json"],
                *["--include", str(template / "config.json"), "--max-shard-size", "1KB"],
            ],
            ["export-hf", str(tied), str(tmp_path / "keep"), "--keep-tied"],
            ["export-hf", str(tied), str(tmp_path / "refused"), "--include", str(odd)],
        ],
        cwd=tmp_path,
    )
    assert text.returncode == 0, text.stderr
    out = open_store(str(tmp_path / "text")).uri
    assert text.stdout.splitlines() == [
        f"wrote {out}/model.safetensors",
        f"wrote {out}/config.json",
        f"wrote {out}/tokenizer.json",
        "lm_head.weight is tied to model.embed_tokens.weight: written once",
        "step 7: 3 tensors, 512 parameters, 2.0 KiB in 1 file",
    ]
    assert_same(load_file(tmp_path / "text" / "model.safetensors"), tied_weights())
    assert (tmp_path / "text" / "tokenizer.json").read_text() == '{"version": "1.0"}'

    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert report["included"] == ["config.json"] and report["total_parameters"] == 512
    index = json.loads((tmp_path / "json" / report["index"]).read_text())
    assert index["metadata"] == {"total_parameters": 512, "total_size": 2048}
    assert "lm_head.weight" not in index["weight_map"]

    assert keep.returncode == 0, keep.stderr
    assert "lm_head.weight" in load_file(tmp_path / "keep" / "model.safetensors")
    line = one_line_error(refused, 2)
    assert "include" in line and "\\x1b" in line and "\x1b" not in refused.stderr
    assert not (tmp_path / "refused").exists()


def test_usage_errors_are_one_line_with_exit_2(tmp_path: Path, moto_endpoint: str) -> None:
    root = tmp_path / "ckpt"
    _save(str(root), [1])
    bad_config = tmp_path / "broken.toml"
    bad_config.write_text("uri = [unclosed\n")
    secret = "S3CR3T-do-not-print-me"
    commands = [
        ["ls", "ftp://host/path"],
        ["verify", str(root), "--step", "9"],
        ["inspect"],
        ["gc", str(root), "--safety-age", "soon"],
        [
            "ls",
            "s3://no-such-bucket-here",
            "-o",
            "aws_access_key_id=AKIDEXAMPLE",
            "-o",
            f"aws_secret_access_key={secret}",
        ],
        ["ls"],
        ["ls"],
    ]
    envs: list[dict[str, str]] = [{}] * 5
    envs += [{"SPOTCKPT_CONFIG": str(bad_config)}, {"SPOTCKPT_URI": str(root)}]
    results = run_all(commands, tmp_path, env={"AWS_ENDPOINT_URL": moto_endpoint}, envs=envs)
    errors = [one_line_error(r, 2) for r in results[:6]]
    scheme, step, no_uri, duration, bucket, config = errors
    assert "unsupported storage URI scheme 'ftp'" in scheme
    assert "step 9 has no committed checkpoint" in step
    assert "SPOTCKPT_URI" in no_uri
    assert "--safety-age" in duration
    assert "no-such-bucket-here" in bucket
    assert "cannot read config file" in config
    assert all(secret not in r.stdout + r.stderr for r in results)
    from_env = results[6]
    assert from_env.returncode == 0, from_env.stderr
    assert from_env.stdout.splitlines()[1].split()[:2] == ["1", "committed"]


def test_size_and_duration_parsing() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5kb") == 1500
    assert parse_size("4096") == 4096
    assert parse_duration("1h") == 3600 and parse_duration("90") == 90
    assert parse_duration("2.5m") == 150 and parse_duration("2d") == 172800
    for bad in ("5i", "GB", "0", "-1MB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_duration("soon")


def _one_document(result: subprocess.CompletedProcess[str]) -> Any:
    """The single JSON document on stdout (json.loads refuses anything after it)."""
    return json.loads(result.stdout)


def test_s3_without_credentials_says_where_they_come_from(
    tmp_path: Path, moto_endpoint: str
) -> None:
    """boto3's real chain, run dry: no keys in the environment, no profile files, no metadata
    service (conftest turns it off for the children too)."""
    nothing = str(tmp_path / "no-such-file")
    bare = {
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": nothing,
        "AWS_CONFIG_FILE": nothing,
    }
    missing, no_profile = run_all(
        [["ls", "s3://some-bucket/run"], ["ls", "s3://some-bucket/run"]],
        tmp_path,
        envs=[bare, {**bare, "AWS_PROFILE": "training"}],
    )
    for result, cause in ((missing, "NoCredentialsError"), (no_profile, "ProfileNotFound")):
        line = one_line_error(result, 2)
        assert f"no usable AWS credentials ({cause}: " in line, line
        for source in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "instance or task role", "storage_opt"):
            assert source in line, (source, line)


def test_json_mode_reports_every_error_as_one_document(tmp_path: Path, moto_endpoint: str) -> None:
    root, empty, missing = tmp_path / "ckpt", tmp_path / "empty", tmp_path / "missing"
    _save(str(root), [1])
    empty.mkdir()
    bad_config = tmp_path / "broken.toml"
    bad_config.write_bytes(b'uri = "x"\n\xff\xfe')
    cases: list[tuple[list[str], dict[str, str], str]] = [
        (["ls", "ftp://host/path"], {}, "unsupported storage URI scheme 'ftp'"),
        (["verify", str(root), "--step", "9"], {}, "step 9 has no committed checkpoint"),
        (["inspect", str(empty)], {}, "no committed checkpoint at"),
        (["ls", str(missing)], {}, f"checkpoint root {missing} does not exist"),
        (["inspect", str(missing)], {}, f"checkpoint root {missing} does not exist"),
        (["verify", str(missing), "--step", "1"], {}, f"checkpoint root {missing} does not"),
        (["gc", str(missing)], {}, f"checkpoint root {missing} does not exist"),
        (["export-hf", str(missing), str(tmp_path / "o")], {}, f"root {missing} does not"),
        (["ls", str(root / manifest_key(1))], {}, "is not a folder"),
        (["ls", "s3://no-such-bucket-here"], {}, "no-such-bucket-here"),
        (["inspect", "s3://no-such-bucket-here", "--step", "3"], {}, "root s3://no-such-bucket"),
        (["gc", str(root), "--safety-age", "soon"], {}, "--safety-age"),
        (["ls", "--bogus"], {}, "--bogus"),
        (["export-hf"], {}, "one or two locations"),
        (["export-hf", str(root)], {}, "missing argument OUT: export-hf writes into a folder or "),
        (["ls"], {}, "pass the URI argument or set SPOTCKPT_URI"),
        (["ls"], {"SPOTCKPT_CONFIG": str(bad_config)}, "broken.toml: it is not UTF-8 TOML"),
        (["ls"], {"SPOTCKPT_URI": str(root), "SPOTCKPT_KEEP_LAST": "x"}, "SPOTCKPT_KEEP_LAST: "),
    ]
    commands = [args for args, _, _ in cases] + [[*args, "--json"] for args, _, _ in cases]
    envs = [extra for _, extra, _ in cases] * 2
    results = run_all(commands, tmp_path, env={"AWS_ENDPOINT_URL": moto_endpoint}, envs=envs)
    text, as_json = results[: len(cases)], results[len(cases) :]
    for (args, _, expected), plain, machine in zip(cases, text, as_json, strict=True):
        line = one_line_error(plain, 2)
        assert expected in line, (args, line)
        assert "pass uri=" not in line
        assert machine.returncode == plain.returncode, (args, machine.stderr)
        document = _one_document(machine)
        assert document == {"error": line.removeprefix("spotckpt: error: "), "exit_code": 2}
    listed, listed_json = run_all([["ls", str(empty)], ["ls", str(empty), "--json"]], tmp_path)
    assert listed.returncode == 0 and listed.stdout.startswith("no committed checkpoints at")
    assert listed_json.returncode == 0
    assert _one_document(listed_json)["checkpoints"] == []


@pytest.mark.process
def test_verify_json_failure_prints_only_the_report(fsdp_copy: Path, tmp_path: Path) -> None:
    manifest = Manifest.from_json((fsdp_copy / manifest_key(STEP)).read_bytes())
    (fsdp_copy / step_folder(STEP) / sorted(manifest.objects)[0]).unlink()
    result = run("verify", str(fsdp_copy), "--json", cwd=tmp_path)
    assert result.returncode == 1
    report = _one_document(result)
    assert report["ok"] is False and "error" not in report
    assert "failed verification" in one_line_error(result, 1)


def test_cli_messages_never_show_credentials(tmp_path: Path, moto_endpoint: str) -> None:
    secret = "S3CR3T-pa55w0rd"
    root = tmp_path / "ckpt"
    root.mkdir()
    toml_with_secret = tmp_path / "secret.toml"
    toml_with_secret.write_text(f'uri = "{root}"\nkeep_last = "http://admin:{secret}@host/"\n')
    cases: list[tuple[list[str], dict[str, str]]] = [
        (["ls", "s3://bucket/x", "-o", f"endpoint_url=http://user:{secret}@127.0.0.1:x"], {}),
        (["ls", "s3://bucket/x", "-o", f"endpoint_url=user:{secret}@127.0.0.1"], {}),
        (["ls", f"s3://AKID:{secret}@bucket/x"], {}),
        (["ls", str(root), "-o", f"aws_secret_access_key={secret}"], {}),
        (["ls", "s3://no-such-bucket-here", "-o", f"aws_session_token={secret}"], {}),
        (["ls"], {"SPOTCKPT_CONFIG": str(toml_with_secret)}),
        (["ls", str(root)], {"SPOTCKPT_STORAGE_OPTIONS": f'{{"token": "{secret}",'}),
        (["ls", "--storage-option", f"password{secret}"], {}),
    ]
    commands = [args for args, _ in cases] + [[*args, "--json"] for args, _ in cases]
    envs = [extra for _, extra in cases] * 2
    results = run_all(commands, tmp_path, env={"AWS_ENDPOINT_URL": moto_endpoint}, envs=envs)
    for args, result in zip(commands, results, strict=True):
        one_line_error(result, 2)
        assert secret not in result.stdout + result.stderr, (args, result.stderr)
    assert "http://***@127.0.0.1:x" in results[0].stderr
    assert "keep_last" in results[5].stderr and "secret.toml" in results[5].stderr


def test_redact_and_printable() -> None:
    from spotckpt.redact import printable, redact, secret_values

    assert redact("see http://u:pw@h:9/x and s3://TOKEN@b") == "see http://***@h:9/x and s3://***@b"
    assert redact("Invalid endpoint: user:pw@127.0.0.1") == "Invalid endpoint: ***@127.0.0.1"
    assert redact('{"aws_secret_access_key": "abc", "n": 1}') == (
        '{"aws_secret_access_key": "***", "n": 1}'
    )
    assert redact("token=abc&x=1 password = 'xyz'") == "token=***&x=1 password = '***'"
    assert redact("NoCredentialsError: Unable to locate credentials") == (
        "NoCredentialsError: Unable to locate credentials"
    )
    assert redact("bob@example.com at 10 s") == "bob@example.com at 10 s"
    assert redact("value hunter22 here", {"hunter22", "ab"}) == "value *** here"
    assert secret_values({"aws_secret_access_key": "abcd", "region": "us", "token": "x"}) == {
        "abcd"
    }
    assert printable("plain name é") == "plain name é"
    assert printable("a\x1b[2J\nb\u202e\x00") == "a\\x1b[2J\\nb\\u202e\\x00"


EVIL_TENSOR = "model.evil\x1b[2J\nname"


def _poison_manifest(root: Path, step: int) -> None:
    """Rewrite a committed manifest so that its names and metadata carry control characters."""
    path = root / manifest_key(step)
    document = json.loads(path.read_bytes())
    name = next(iter(document["tensors"]))
    document["tensors"][EVIL_TENSOR] = document["tensors"].pop(name)
    document["attempt"] = "a\x1b[31mred"
    document["created_at"] = "soon\x1b]0;title\x07"
    document["versions"]["torch\n"] = "2\x1b[1A"
    document["user_metadata"] = {"k\x1b[2J": "v\nw"}
    value = next(iter(document["values"]))
    document["values"]["evil\x1b[0m\nvalue." + value] = document["values"].pop(value)
    path.write_bytes(json.dumps(document).encode())


@pytest.mark.process
def test_control_characters_from_a_manifest_are_escaped(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(str(root), [1])
    _poison_manifest(root, 1)
    ls, inspect, filtered, as_json = run_all(
        [
            ["ls", str(root)],
            ["inspect", str(root)],
            ["inspect", str(root), "--filter", "evil"],
            ["inspect", str(root), "--json"],
        ],
        cwd=tmp_path,
    )
    for result in (ls, inspect, filtered, as_json):
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stdout
    assert len(ls.stdout.splitlines()) == 2 and "a\\x1b[31mred" in ls.stdout
    assert "model.evil\\x1b[2J\\nname" in inspect.stdout
    assert not any(line.startswith("name") for line in inspect.stdout.splitlines())
    assert "soon\\x1b]0;title\\x07" in inspect.stdout and "torch\\n 2\\x1b[1A" in inspect.stdout
    assert "evil\\x1b[0m\\nvalue." in filtered.stdout
    assert json.loads(as_json.stdout)["tensors"][EVIL_TENSOR]["dtype"] == "float32"


@pytest.mark.process
def test_log_records_print_as_one_line_each(tmp_path: Path) -> None:
    code = """
        import logging, sys
        from spotckpt.cli import main
        from spotckpt.storage import StorageError, register_store

        class NoisyStore:
            uri = "noisy://x"

            def list(self, prefix=""):
                log = logging.getLogger("spotckpt.storage.noisy")
                log.debug("looking at %s", prefix)
                try:
                    raise OSError("boom\\nsecond line")
                except OSError:
                    log.warning("first\\nsecond \\x1b[2J third", exc_info=True)
                raise StorageError("list noisy://x: gave up")

            def close(self):
                pass

        register_store("noisy", lambda uri, options: NoisyStore())
        main(sys.argv[1:])
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    quiet, verbose = (
        subprocess.run(
            [sys.executable, "-c", code.replace("\n        ", "\n"), *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env=env,
        )
        for args in (["ls", "noisy://x"], ["-v", "ls", "noisy://x"])
    )
    assert quiet.returncode == verbose.returncode == 2
    assert quiet.stderr.splitlines() == [
        "spotckpt: warning: first second \\x1b[2J third (OSError: boom second line)",
        "spotckpt: error: list noisy://x: gave up",
    ]
    lines = verbose.stderr.splitlines()
    assert lines[0] == "spotckpt: debug: looking at step-"
    assert lines[1:] == quiet.stderr.splitlines()


def _load_demo() -> Any:
    """The demo's driver (examples/demo.py), loaded once as test_eviction loads it."""
    import importlib.util

    if "spotckpt_demo" in sys.modules:
        return sys.modules["spotckpt_demo"]
    path = REPO / "examples" / "demo.py"
    spec = importlib.util.spec_from_file_location("spotckpt_demo", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["spotckpt_demo"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_stats_skips_forged_goodput_objects(tmp_path: Path, s3_uri: str) -> None:
    """Forged objects under events/ (30,000-deep JSON, a 400-digit int; events and the summary)
    made `stats` fail with RecursionError or OverflowError. It now reports the good events, with
    one warning per read naming the first bad object, and suggests no interval past the default
    ceiling even for a recorded step time of 1e-155 s."""
    local = str(tmp_path / "ck")
    summaries = {local: "deep summary", s3_uri: "huge int in the summary"}
    events = [FORGED_GOODPUT["deep event"], FORGED_GOODPUT["huge int in an event"]]
    for uri, summary in summaries.items():
        store = open_store(uri)
        for key, data in [FORGED_GOODPUT[summary], *events]:
            store.put(key, data)
        log = EventLog(store)
        for _ in range(3):
            log.record({"kind": "save", "stall_s": 1.0, "train_s": 300.0, "step_time_s": 1e-155})
    results = run_all(
        [["stats", local, "--json"], ["stats", s3_uri, "--json"], ["stats", s3_uri]], cwd=tmp_path
    )
    first_event = min(key for key, _ in events)
    for result in results:
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if "malformed goodput" in line]
        assert len(warnings) == 2, result.stderr  # one for the summary, one for the events
        assert EVENT_SUMMARY_KEY in warnings[0] and first_event in warnings[1], warnings
        assert "and 1 more" in warnings[1] and "Traceback" not in result.stderr
    for result in results[:2]:
        stats = json.loads(result.stdout)
        assert (stats["events"], stats["saves"], stats["evictions"]) == (3, 3, 0)
        assert stats["suggested_interval_steps"] == DEFAULT_MAX_INTERVAL_STEPS
    suggested = rf"^  suggested\s+{DEFAULT_MAX_INTERVAL_STEPS} steps \(Daly's formula: "
    assert re.search(suggested, results[2].stdout, re.M), results[2].stdout
    events_row = r"^  events\s+3 \(3 saves, 0 restores\)$"
    assert re.search(events_row, results[2].stdout, re.M), results[2].stdout


@pytest.mark.process
def test_stats_after_a_real_run_with_an_eviction(tmp_path: Path) -> None:
    """train.py saves every 4 of 12 steps, is evicted with SIGTERM mid-run, resumes to the end;
    `stats` then reports from the events those runs wrote (and imports no torch)."""
    demo = _load_demo()
    uri, losses, log = str(tmp_path / "ck" / "run"), tmp_path / "losses", tmp_path / "train.log"
    command = [
        sys.executable, str(Path(demo.ROOT) / "train.py"), "--steps", "12", "--save-every", "4",
        "--step-delay", "0.2", "--workers", "0", "--loss-log", str(losses),
    ]  # fmt: skip
    assert demo.evict_at(demo.run(command, uri, log), losses, 6, log) == 75, log.read_text()
    assert demo.run(command, uri, log).wait(timeout=300) == 0, log.read_text()[-3000:]
    (tmp_path / "empty").mkdir()
    as_json, text, timed, empty, empty_json, missing = run_all(
        [
            ["stats", uri, "--json"],
            ["stats", uri],
            ["stats", uri],
            ["stats", str(tmp_path / "empty")],
            ["stats", str(tmp_path / "empty"), "--json"],
            ["stats", str(tmp_path / "nowhere"), "--json"],
        ],
        cwd=tmp_path,
        envs=[{}, {}, {"PYTHONPROFILEIMPORTTIME": "1"}, {}, {}, {}],
    )
    assert as_json.returncode == 0, as_json.stderr
    stats = json.loads(as_json.stdout)
    assert stats["evictions"] == 1 and stats["steps_lost"] == 0 and stats["restores"] == 1
    assert stats["saves"] >= 3 and stats["interval_steps"] == 4
    assert stats["stall_median_s"] > 0 and stats["stall_p95_s"] >= stats["stall_median_s"]
    assert stats["upload_median_s"] > 0 and stats["restore_median_s"] > 0
    assert 0 < stats["overhead_share"] < 1 and stats["training_s"] > 12 * 0.2
    assert stats["step_time_s"] >= 0.2 and stats["suggested_interval_steps"] >= 1
    assert 0 < stats["estimated_goodput"] <= 1
    assert text.returncode == 0, text.stderr
    assert re.search(r"^  evictions\s+1$", text.stdout, re.M), text.stdout
    assert re.search(r"^  steps lost\s+0$", text.stdout, re.M), text.stdout
    assert re.search(r"^  interval\s+4 steps", text.stdout, re.M), text.stdout
    # a run of seconds: what the JSON holds, the text does not present as the library's cost
    too_little = r"^  (overhead|suggested|goodput)\s+too little data"
    assert len(re.findall(too_little, text.stdout, re.M)) == 3, text.stdout
    assert timed.returncode == 0 and timed.stdout == text.stdout
    imported = {ln.rsplit("|", 1)[1].strip() for ln in timed.stderr.splitlines() if "|" in ln}
    assert "spotckpt.goodput" in imported and "torch" not in imported
    assert empty.returncode == 0 and empty.stdout.startswith("no events yet at "), empty.stderr
    assert json.loads(empty_json.stdout)["events"] == 0
    assert json.loads(missing.stdout)["exit_code"] == 2
    assert "does not exist" in one_line_error(missing, 2)
