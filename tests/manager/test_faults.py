"""Fault injection: transient S3 errors, corrupt bytes, concurrent writers, stale hints, secrets."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from spotckpt import (
    CheckpointAlreadyCommittedError,
    CheckpointManager,
    CorruptCheckpointError,
)
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key, step_folder
from spotckpt.storage import ObjectNotFoundError, RetryPolicy, open_store
from spotckpt.storage.local import LocalStore

from fault_proxy import FaultProxy

MIB = 1 << 20


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "big": torch.randn(3 * MIB, generator=g),  # 12 MiB: a multipart upload
        "small": {f"t{i}": torch.randn(64, generator=g) for i in range(20)},
        "step": step,
    }


def _empty() -> dict[str, Any]:
    return {
        "big": torch.empty(3 * MIB),
        "small": {f"t{i}": torch.empty(64) for i in range(20)},
        "step": 0,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["big"], b["big"])
        and all(torch.equal(a["small"][k], b["small"][k]) for k in a["small"])
        and a["step"] == b["step"]
    )


def test_transient_faults_on_five_percent_of_requests(moto_endpoint: str) -> None:
    bucket = f"faults-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    proxy = FaultProxy(moto_endpoint, rate=0.05, seed=42)
    options = {
        "endpoint_url": proxy.endpoint,
        "part_size": 5 * MIB,
        "retry": RetryPolicy(max_attempts=10, initial_backoff_s=0.01, max_backoff_s=0.2),
    }
    try:
        with CheckpointManager(
            f"s3://{bucket}/run", preemption=False, keep_last=3, storage_options=options
        ) as mgr:
            for step in range(1, 21):
                mgr.save(step, _state(step))
                target = _empty()
                assert mgr.restore(target) == step
                assert _same(target, _state(step)), f"step {step} restored different data"
    finally:
        proxy.close()
    injected = sum(proxy.injected.values())
    print(f"fault proxy: {proxy.forwarded} forwarded, injected {proxy.injected}")
    assert injected >= 10 and all(proxy.injected.values())


def test_non_retryable_errors_fail_at_once(s3_uri: str) -> None:
    store = open_store(s3_uri.replace("s3://", "s3://missing-bucket-x/"), part_size=5 * MIB)
    with pytest.raises(ObjectNotFoundError, match="NoSuchBucket"):
        store.put("k", b"x")


@pytest.fixture(params=["local", "s3"])
def two_checkpoints(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointManager:
    uri = str(tmp_path / "ck") if request.param == "local" else request.getfixturevalue("s3_uri")
    options = {"part_size": 5 * MIB} if uri.startswith("s3://") else {}
    mgr = CheckpointManager(uri, preemption=False, storage_options=options)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    return mgr


def _shard_key(mgr: CheckpointManager, step: int) -> tuple[str, Manifest]:
    manifest = mgr.read_manifest(step)
    (key,) = manifest.objects
    return f"{step_folder(step)}/{key}", manifest


@pytest.mark.process
@pytest.mark.parametrize("damage", ["flip-one-byte", "truncate", "delete"])
def test_corruption_is_detected_named_and_restore_falls_back(
    two_checkpoints: CheckpointManager, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = two_checkpoints
    key, manifest = _shard_key(mgr, 2)
    data = bytearray(mgr.store.get(key))
    big = manifest.tensors["big"].chunks[0].location
    if damage == "flip-one-byte":
        data[big.offset + 12345] ^= 0x01
        mgr.store.put(key, bytes(data))
    elif damage == "truncate":
        mgr.store.put(key, bytes(data[: len(data) // 2]))
    else:
        mgr.store.delete_many([key])
    with pytest.raises(CorruptCheckpointError, match=key.split("/")[-1]) as error:
        mgr.restore(_empty(), step=2)
    if damage == "flip-one-byte":
        assert "CRC32C mismatch" in str(error.value) and "'big'" in str(error.value)
    with pytest.raises(CorruptCheckpointError):
        mgr.restore(_empty(), fallback=False)
    caplog.set_level(logging.WARNING, logger="spotckpt")
    target = _empty()
    assert mgr.restore(target) == 1
    assert _same(target, _state(1))
    assert "falling back to step 1" in caplog.text


def _save_same_step(uri: str, value: float, queue: Any) -> None:
    try:
        with CheckpointManager(uri, preemption=False) as mgr:
            mgr.save(7, {"w": torch.full((MIB,), value)})
        queue.put(("committed", value))
    except CheckpointAlreadyCommittedError as error:
        queue.put(("refused", str(error)))


@pytest.mark.process
def test_two_jobs_saving_the_same_step(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    jobs = [context.Process(target=_save_same_step, args=(uri, v, queue)) for v in (1.0, 2.0)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(120)
    outcomes = sorted(queue.get(timeout=5) for _ in jobs)
    assert [o[0] for o in outcomes] == ["committed", "refused"], outcomes
    assert "already committed" in outcomes[1][1]
    with CheckpointManager(uri, preemption=False) as mgr:
        target = {"w": torch.empty(MIB)}
        assert mgr.steps() == [7] and mgr.restore(target) == 7
        assert target["w"][0] == outcomes[0][1]


@pytest.mark.process
@pytest.mark.parametrize("hint", [{"step": 999}, {"step": 1}, "garbage"])
def test_stale_latest_hint_is_ignored(two_checkpoints: CheckpointManager, hint: Any) -> None:
    mgr = two_checkpoints
    mgr.store.put("latest.json", json.dumps(hint).encode())
    target = _empty()
    assert mgr.latest_step() == 2 and mgr.restore(target) == 2
    assert _same(target, _state(2))


def test_huge_entry_counts_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spotckpt.format import manifest as manifest_module
    from spotckpt.format.manifest import ManifestError

    mgr = CheckpointManager(str(tmp_path), preemption=False)
    mgr.save(1, _state(1))
    raw = mgr.store.get(manifest_key(1))
    monkeypatch.setattr(manifest_module, "MAX_ENTRIES", 5)
    with pytest.raises(ManifestError, match="more than 5 tensors"):
        Manifest.from_json(raw)
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(ManifestError, match="more than the 100 allowed"):
        Manifest.from_json(raw)


def test_credentials_never_appear(
    s3_uri: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "SuperSecretKey/xyz+" + uuid.uuid4().hex
    caplog.set_level(logging.DEBUG)
    options = {
        "aws_access_key_id": "AKIDTESTEXAMPLE",
        "aws_secret_access_key": secret,
        "part_size": 5 * MIB,
        "retry": RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.01),
    }
    texts = []
    with CheckpointManager(s3_uri, preemption=False, storage_options=options) as mgr:
        mgr.save(1, _state(1))
        texts.append(mgr.store.get(manifest_key(1)).decode())
        texts.append(repr(mgr.store) + repr(getattr(mgr.store, "options", "")))
    bad = dict(options, endpoint_url="http://127.0.0.1:9")
    with pytest.raises(Exception) as error:
        CheckpointManager(s3_uri, preemption=False, storage_options=bad).save(1, _state(1))
    texts.append(str(error.value) + repr(error.value))
    texts.append(caplog.text)
    assert all(secret not in text for text in texts)
    assert os.environ.get("AWS_SECRET_ACCESS_KEY") != secret


class _CtrlC:
    """Presses Ctrl-C (the main thread's KeyboardInterrupt, from whatever thread does the I/O)
    the first time a store call touches a safetensors object once armed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
        self.armed = False
        self.pressed = 0
        signal.signal(signal.SIGUSR2, signal.default_int_handler)  # as SIGINT's default
        original = getattr(LocalStore, method)

        def pressing(store: LocalStore, key: str, *args: Any, **kwargs: Any) -> Any:
            if self.armed and key.endswith(".safetensors"):
                self.armed = False
                self.pressed += 1
                signal.raise_signal(signal.SIGUSR2)
            return original(store, key, *args, **kwargs)

        monkeypatch.setattr(LocalStore, method, pressing)


@pytest.fixture
def sigusr2_restored() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGUSR2)
    yield
    signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("where", ["bucket", "fast tier"])
def test_ctrl_c_during_a_save_interrupts_it_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigusr2_restored: None, where: str
) -> None:
    """DCP's wrapper catches every BaseException of a rank: an interrupt must come out as the
    interrupt, never as a failed save (or, on the fast tier, a logged warning) that goes on."""
    ctrl_c = _CtrlC(monkeypatch, "open_writer")
    (tmp_path / "tier").mkdir()
    tier = {"local_dir": str(tmp_path / "tier"), "local_interval_steps": 1}
    settings: dict[str, Any] = {"interval_steps": 100, **tier} if where == "fast tier" else {}
    with CheckpointManager(str(tmp_path / "ck"), preemption=False, **settings) as mgr:
        save = mgr.maybe_save if where == "fast tier" else mgr.save
        save(1, _state(1))
        ctrl_c.armed = True
        with pytest.raises(KeyboardInterrupt):
            save(2, _state(2))
        assert ctrl_c.pressed == 1
        if where == "bucket":
            assert mgr.steps() == [1]
        save(3, _state(3))
        restored = _empty()
        assert mgr.restore(restored) == 3
        assert _same(restored, _state(3))


def test_ctrl_c_during_a_restore_interrupts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigusr2_restored: None
) -> None:
    """An interrupted restore is not a corrupt checkpoint: no fallback to an older step."""
    with CheckpointManager(str(tmp_path / "ck"), preemption=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        ctrl_c = _CtrlC(monkeypatch, "get_range_into_views")
        ctrl_c.armed = True
        with pytest.raises(KeyboardInterrupt):
            mgr.restore(_empty())
        assert ctrl_c.pressed == 1
        restored = _empty()
        assert mgr.restore(restored) == 2
        assert _same(restored, _state(2))
