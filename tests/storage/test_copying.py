"""Server-side copies on S3 (`S3Store.copy_within`, through `spotckpt.storage.copying`): between
buckets, in several parts, create-only, with lost answers, and streamed where S3 cannot reach
the source with the target's credentials. The copy into every store is in the storage contract.
"""

from __future__ import annotations

import uuid
from typing import Any

import blake3
import pytest

from spotckpt.checksum import crc32c
from spotckpt.errors import CorruptCheckpointError
from spotckpt.storage import AlreadyExistsError, open_store
from spotckpt.storage import s3 as s3_module
from spotckpt.storage.copying import Expected, copy_object
from spotckpt.storage.retry import RetryPolicy

from fault_proxy import FaultProxy

pytestmark = pytest.mark.process

MIB = 1 << 20
PART = 5 * MIB


def _payload(size: int) -> bytes:
    return (bytes(range(251)) * (size // 251 + 1))[:size]


@pytest.fixture
def other_bucket(s3_client: Any) -> str:
    name = f"mirror-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


def _retry() -> RetryPolicy:
    return RetryPolicy(max_attempts=6, initial_backoff_s=0.01, max_backoff_s=0.05)


def test_a_copy_to_another_bucket_runs_in_parts_on_the_server(
    s3_uri: str, other_bucket: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_module, "COPY_PART_SIZE", PART)
    source = open_store(s3_uri, part_size=PART)
    target = open_store(f"s3://{other_bucket}/mirror", part_size=PART)
    payload = _payload(2 * PART + 12345)
    source.put("step-1/a-x/r0.safetensors", payload)
    copied = copy_object(source, "step-1/a-x/r0.safetensors", target, "step-1/a-x/r0.safetensors")
    assert copied.server_side and copied.crc32c is None
    assert target.get("step-1/a-x/r0.safetensors") == payload
    assert target.list_uploads() == []
    with pytest.raises(AlreadyExistsError):
        copy_object(
            source,
            "step-1/a-x/r0.safetensors",
            target,
            "step-1/a-x/r0.safetensors",
            create_only=True,
        )


def test_lost_answers_to_a_part_copy_and_the_completion_are_retried(
    s3_uri: str, other_bucket: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server copied a part, then completed the copy, and each answer was lost: the retries
    ask again, and the create-only copy ends whole, committed once, no upload left behind."""
    monkeypatch.setattr(s3_module, "COPY_PART_SIZE", PART)

    def lose_a_part_copy(method: str, path: str) -> bool:
        part = method == "PUT" and "partNumber=2" in path
        completion = method == "POST" and "uploadId=" in path
        return (part or completion) and not any(p.startswith(method) for p in proxy.lost)

    proxy = FaultProxy(moto_endpoint, rate=0.0, lose_answer=lose_a_part_copy)
    try:
        through = {"part_size": PART, "endpoint_url": proxy.endpoint, "retry": _retry()}
        source = open_store(s3_uri, **through)
        target = open_store(f"s3://{other_bucket}/mirror", **through)
        payload = _payload(3 * PART + 99)
        open_store(s3_uri, part_size=PART).put("obj", payload)
        copied = copy_object(source, "obj", target, "obj", create_only=True)
        assert copied.server_side and len(proxy.lost) == 2  # the faults really happened
        assert target.get("obj") == payload
        assert target.list_uploads() == []
    finally:
        proxy.close()


def test_other_credentials_or_endpoints_stream(
    s3_uri: str, other_bucket: str, moto_endpoint: str
) -> None:
    source = open_store(s3_uri, part_size=PART)
    source.put("obj", _payload(PART + 1))
    others = [
        open_store(
            f"s3://{other_bucket}/m",
            part_size=PART,
            aws_access_key_id="AKIDOTHER",
            aws_secret_access_key="other-secret",
        ),
        open_store(f"s3://{other_bucket}/n", part_size=PART, endpoint_url=moto_endpoint + "/"),
    ]
    for target in others:
        copied = copy_object(source, "obj", target, "obj")
        assert not copied.server_side and target.get("obj") == _payload(PART + 1)


@pytest.mark.parametrize(
    ("status", "code"), [(501, "NotImplemented"), (403, "AccessDenied"), (400, "InvalidRequest")]
)
def test_a_server_that_refuses_part_copies_gets_a_streamed_copy(
    s3_uri: str, other_bucket: str, moto_endpoint: str, status: int, code: str
) -> None:
    """An S3-compatible server without UploadPartCopy, or a bucket policy that denies it: the
    refused upload is aborted and the object streams instead."""
    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code></Error>'.encode()
    refused: list[str] = []

    def refuse_the_first_part_copy(method: str, path: str) -> tuple[int, bytes] | None:
        if method == "PUT" and "partNumber=" in path:  # only part copies: the stream is one PUT
            refused.append(path)
            return status, body
        return None

    proxy = FaultProxy(moto_endpoint, rate=0.0, answer=refuse_the_first_part_copy)
    try:
        through = {"part_size": PART, "endpoint_url": proxy.endpoint, "retry": _retry()}
        source = open_store(s3_uri, **through)
        target = open_store(f"s3://{other_bucket}/mirror", **through)
        payload = _payload(PART - 5)  # streamed in one PUT (below the part size)
        source.put("obj", payload)
        copied = copy_object(source, "obj", target, "obj", create_only=True)
        assert refused and not copied.server_side and copied.crc32c == crc32c(payload)
        assert target.get("obj") == payload
        assert target.list_uploads() == []
    finally:
        proxy.close()


def test_a_copy_between_gcs_buckets_is_a_rewrite_read_back_and_checked(
    fake_gcs_endpoint: str,
) -> None:
    from gcs_emulator import create_bucket

    options = {"endpoint_url": fake_gcs_endpoint, "anonymous": True}
    source = open_store(f"gs://{create_bucket(fake_gcs_endpoint)}/runs", **options)
    target = open_store(f"gs://{create_bucket(fake_gcs_endpoint)}/mirror", **options)
    payload = _payload(3 * MIB + 7)
    source.put("step-1/a-x/r0.safetensors", payload)
    key = "step-1/a-x/r0.safetensors"
    copied = copy_object(source, key, target, key)
    assert copied.server_side and target.get(key) == payload
    good = Expected(len(payload), crc32c(payload))
    checked = copy_object(source, key, target, "checked", expected=good, create_only=True)
    assert checked.server_side and checked.crc32c == good.crc32c
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        copy_object(
            source,
            key,
            target,
            "bad",
            expected=Expected(len(payload), good.crc32c ^ 1),
            create_only=True,
        )
    assert not target.exists("bad")
    other = open_store(f"gs://{create_bucket(fake_gcs_endpoint)}/x", **options, project="another")
    assert not copy_object(source, key, other, key).server_side  # another identity: streamed


def test_a_gcs_rewrite_is_checked_by_the_crc32c_gcs_reports_and_read_back_only_when_signed(
    fake_gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rewrite's answer carries the copy's CRC32C: an unsigned copy is checked by it, with
    no bytes read back over the network; a copy that must match a BLAKE3 is still read back."""
    from spotckpt.storage import copying

    from gcs_emulator import create_bucket

    options = {"endpoint_url": fake_gcs_endpoint, "anonymous": True}
    source = open_store(f"gs://{create_bucket(fake_gcs_endpoint)}/runs", **options)
    target = open_store(f"gs://{create_bucket(fake_gcs_endpoint)}/mirror", **options)
    payload = _payload(MIB + 3)
    source.put("o", payload)
    read_back: list[str] = []
    real = copying._read_back

    def counted(store: Any, key: str, *args: Any) -> tuple[int, str | None]:
        read_back.append(key)
        return real(store, key, *args)

    monkeypatch.setattr(copying, "_read_back", counted)
    good = Expected(len(payload), crc32c(payload))
    copied = copy_object(source, "o", target, "plain", expected=good, create_only=True)
    assert copied.server_side and copied.crc32c == good.crc32c and read_back == []
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        copy_object(
            source,
            "o",
            target,
            "bad",
            expected=Expected(len(payload), good.crc32c ^ 1),
            create_only=True,
        )
    assert not target.exists("bad") and read_back == []
    strong = Expected(len(payload), good.crc32c, blake3.blake3(payload).hexdigest())
    copy_object(source, "o", target, "signed", expected=strong, create_only=True)
    assert read_back == ["signed"] and target.get("signed") == payload
    forged = Expected(len(payload), good.crc32c, blake3.blake3(b"other").hexdigest())
    with pytest.raises(CorruptCheckpointError, match="BLAKE3"):
        copy_object(source, "o", target, "forged", expected=forged, create_only=True)
    assert not target.exists("forged")
