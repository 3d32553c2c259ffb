"""The issue's whole path across providers: a job saving to S3 (moto) with mirrors on GCS
(fake-gcs-server, its own storage options) and Azure (Azurite, its own connection string); every
committed step verified at both mirrors, incremental and signed; the job restarted with its
primary's server stopped resumes from a mirror bit for bit; restarted with a mirror as its root,
it goes on there and its later steps are mirrored back."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "seams") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "seams"))

import seam_run  # noqa: E402

from spotckpt import CheckpointManager  # noqa: E402
from spotckpt.catalog import Catalog  # noqa: E402
from spotckpt.format.signing import Keyring  # noqa: E402
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
