"""The issue's whole path across providers: a job saving to S3 (moto) with mirrors on GCS
(fake-gcs-server, its own storage options) and Azure (Azurite, its own connection string); every
committed step verified at both mirrors, incremental and signed; the job restarted with its
primary's server stopped resumes from a mirror bit for bit; restarted with a mirror as its root,
it goes on there and its later steps are mirrored back."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "seams") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "seams"))

import seam_run  # noqa: E402

from spotckpt import CheckpointManager  # noqa: E402
from spotckpt.catalog import Catalog  # noqa: E402
from spotckpt.errors import CorruptCheckpointError  # noqa: E402
from spotckpt.format.signing import Keyring  # noqa: E402
from spotckpt.layout import step_folder  # noqa: E402
from spotckpt.mirroring import Mirror  # noqa: E402
from spotckpt.storage import RetryPolicy, open_store  # noqa: E402
from spotckpt.verify import verify_checkpoint  # noqa: E402

from fault_proxy import FaultProxy  # noqa: E402
from gcs_emulator import create_bucket  # noqa: E402
from tests_support import write_signing_key  # noqa: E402

QUICK = RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.1, deadline_s=5.0)


def _steps(uri: str, **options: Any) -> list[int]:
    store = open_store(uri, **options)
    try:
        return Catalog(store).steps()
    finally:
        store.close()


@pytest.mark.process
@pytest.mark.timeout(600)
def test_s3_job_mirrored_to_gcs_and_azure_resumes_anywhere(
    s3_bucket: str,
    moto_endpoint: str,
    fake_gcs_endpoint: str,
    az_uri: str,
    azurite_connection_string: str,
    tmp_path: Path,
) -> None:
    proxy = FaultProxy(moto_endpoint, rate=0.0)
    primary = f"s3://{s3_bucket}/runs/exp1"
    s3_options = {"endpoint_url": proxy.endpoint, "retry": QUICK}
    gcs = f"gs://{create_bucket(fake_gcs_endpoint)}/runs/exp1"
    gcs_options = {"endpoint_url": fake_gcs_endpoint, "anonymous": True}
    azure_options = {"connection_string": azurite_connection_string}
    mirrors = {gcs: gcs_options, az_uri: azure_options}
    key = str(write_signing_key(tmp_path / "key"))
    keyring = Keyring.from_files(key)
    settings: dict[str, Any] = dict(
        preemption=False, keep_last=3, incremental=True, signing_key=key
    )

    with CheckpointManager(primary, storage_options=s3_options, mirrors=mirrors, **settings) as job:
        for step in (1, 2, 3, 4):
            job.save(step, seam_run.state(step))
            job.wait()
            for uri, options in mirrors.items():
                assert _steps(uri, **options)[-1] == step, uri
    for uri, options in mirrors.items():
        store = open_store(uri, **options)
        try:
            assert Catalog(store).steps() == [2, 3, 4]
            for step in (2, 3, 4):  # step 4 references bytes uploaded by step 1
                report = verify_checkpoint(store, step, keyring=keyring)
                assert report.ok, (uri, step, report.to_dict())
        finally:
            store.close()

    proxy.close()  # the primary's server is gone: restore from the nearest mirror
    with CheckpointManager(primary, storage_options=s3_options, mirrors=mirrors, **settings) as job:
        state = seam_run.blank()
        assert job.restore(state) == 4
        assert seam_run.same(state, seam_run.state(4))
        assert job._restorer.last_restore_uri in {gcs, az_uri}

    # Restarted with the GCS mirror as its root (SPOTCKPT_URI there), and S3 back as a mirror.
    back = FaultProxy(moto_endpoint, rate=0.0)
    s3_back = {"endpoint_url": back.endpoint, "retry": QUICK}
    try:
        with CheckpointManager(
            gcs, storage_options=gcs_options, mirrors={primary: s3_back}, **settings
        ) as job:
            state = seam_run.blank()
            assert job.restore(state) == 4
            assert seam_run.same(state, seam_run.state(4))
            job.save(5, seam_run.state(5))
        assert _steps(primary, **s3_back) == [3, 4, 5]
        with CheckpointManager(primary, storage_options=s3_back, **settings) as job:
            state = seam_run.blank()
            assert job.restore(state) == 5
            assert seam_run.same(state, seam_run.state(5))
    finally:
        back.close()


@pytest.mark.process
def test_s3_to_s3_copies_server_side_and_checks_what_the_provider_wrote(
    s3_uri: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two buckets one identity reaches: S3 copies each object itself; it is read back and
    checked at the mirror, and an object whose bytes at the source no longer match its manifest
    is deleted there again: the step is not committed."""
    other = f"mirror-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=other)
    mirror = f"s3://{other}/runs/exp1"
    _save_steps(s3_uri, (1, 2))
    source, target = Catalog(open_store(s3_uri)), Catalog(open_store(mirror))
    report = Mirror(source, target).copy_step(1)
    assert report.copied_objects > 0 and report.server_side_objects == report.copied_objects
    largest = max(source.store.list(f"{step_folder(2)}/"), key=lambda info: info.size)
    bucket, _, prefix = s3_uri.removeprefix("s3://").partition("/")
    body = bytearray(
        s3_client.get_object(Bucket=bucket, Key=f"{prefix}/{largest.key}")["Body"].read()
    )
    body[len(body) // 2] ^= 1
    s3_client.put_object(Bucket=bucket, Key=f"{prefix}/{largest.key}", Body=bytes(body))
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        Mirror(source, target).copy_step(2)
    assert not target.store.exists(largest.key) and target.steps() == [1]
    with CheckpointManager(mirror, preemption=False, keep_last=None) as job:
        state = seam_run.blank()
        assert job.restore(state) == 1
        assert seam_run.same(state, seam_run.state(1))


def _save_steps(uri: str, steps: tuple[int, ...]) -> None:
    with CheckpointManager(uri, preemption=False, keep_last=None) as job:
        for step in steps:
            job.save(step, seam_run.state(step))
