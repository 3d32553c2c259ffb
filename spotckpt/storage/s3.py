"""``s3://bucket/prefix`` through boto3: parallel multipart uploads with bounded memory.

Design choices:
- Objects smaller than one part go up in a single PUT; larger ones as a multipart upload whose
  parts are uploaded by a bounded thread pool. Parts in flight are bounded in bytes
  (``part_size * max_concurrency``), plus the one being filled, whatever the object size.
- No size ceiling below S3's own 5 TiB: S3 allows 10,000 parts, which at a fixed 16 MiB stops an
  object at 156 GiB. The part size doubles every `PARTS_PER_DOUBLING` parts (`part_size_for`),
  up to S3's 5 GiB part limit, so 10,000 parts hold more than 5 TiB even from the 5 MiB minimum;
  objects below 15 GiB (at 16 MiB) never see a larger part.
- Create-only writes send ``If-None-Match: *`` on the PUT or on CompleteMultipartUpload; S3
  answers 412 when the key exists, which becomes `AlreadyExistsError`.
- Any failure aborts the multipart upload, so no parts are left to bill.
- botocore's own retries are switched off; every request, each part on its own, is retried by a
  `RetryPolicy` (jittered exponential back-off with a total deadline) on throttling, 5xx,
  timeouts and connection errors. 403, 404 and 412 fail at once.
- The policy's ``deadline_s`` bounds a whole read, body included: botocore's read timeout is per
  socket read, so a body that trickles in would never trip it. Bodies are read with
  `read_body`, which stops at the deadline; connect and read timeouts are never longer than it.
- Delimited listings (`S3Store.list_delimited`) send ``Delimiter`` to ListObjectsV2, so a
  checkpoint root's manifests are found in about two entries per step. Some S3-compatible servers
  refuse a delimiter other than ``/`` (directory buckets, some gateways) or page it wrongly (a
  continuation token sent twice); that is detected, warned about once, and the listing is then
  made from a full one for the store's lifetime (`spotckpt.storage.bucket`).
- CRC32C of each part is computed with google-crc32c and sent to S3, which verifies it; botocore
  is told not to add checksums of its own (that would hash every byte a second time).
- A store pickles as its bucket, prefix and options, and is rebuilt (new client, new pool) where
  it is unpickled, taking credentials from the standard chain there. Explicit credentials in the
  options travel inside `ProcessSecrets`: through multiprocessing's pipes only, never to a file.

`S3Store` is a `spotckpt.storage.bucket.BucketStore`, which holds the options, URI, key, listing,
retry and pickling logic that S3 shares with GCS; this module holds S3's own requests.
"""

from __future__ import annotations

import builtins
import functools
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

import boto3
import botocore.config
import botocore.exceptions
import urllib3.exceptions

from spotckpt.checksum import crc32c_b64
from spotckpt.errors import InvalidArgumentError
from spotckpt.storage.base import (
    AlreadyExistsError,
    ChunkedWriter,
    DelimiterNotHonouredError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectStore,
    PermissionDeniedError,
    StorageError,
    UploadInfo,
    log,
)
from spotckpt.storage.bucket import BucketOptions, BucketStore, BytesInFlight, Page
from spotckpt.storage.retry import Deadline, read_body, read_body_into

MIB = 1 << 20
MIN_PART_SIZE = 5 * MIB
MAX_PART_SIZE = 5 << 30
COPY_PART_SIZE = 1 << 30
"""Bytes per part of a server-side copy (UploadPartCopy takes up to 5 GiB; 1 GiB parts retry a
lost answer cheaply)."""
MAX_PARTS = 10_000
MAX_OBJECT_SIZE = 5 << 40
PARTS_PER_DOUBLING = 950
DELETE_BATCH = 1000
SECRET_OPTIONS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)
_THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded"}
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchUpload"})
_DENIED_CODES = frozenset({"AccessDenied", "Forbidden", "403", "InvalidAccessKeyId"})
_CONFLICT_CODES = frozenset({"PreconditionFailed", "412"})
_DELIMITER_REFUSED_CODES = frozenset(
    {"InvalidArgument", "InvalidRequest", "NotImplemented", "BadRequest"}
)
_TRANSIENT_ERRORS = (
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    ConnectionError,
    TimeoutError,
)


_CREDENTIAL_ERRORS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.CredentialRetrievalError,
    botocore.exceptions.ProfileNotFound,
)
CREDENTIAL_SOURCES = (
    "boto3 looks in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, with "
    "AWS_SESSION_TOKEN for temporary keys), then a profile (AWS_PROFILE or "
    "storage_options profile_name, from ~/.aws/credentials or ~/.aws/config, SSO included), "
    "web identity (AWS_WEB_IDENTITY_TOKEN_FILE, as EKS sets it), then the instance or task "
    "role (EC2 instance metadata, ECS); or pass the keys as storage_options "
    "aws_access_key_id and aws_secret_access_key (never logged)"
)
"""Where S3 credentials come from, for the message when none are found."""


def credentials_error(error: BaseException, what: str) -> PermissionDeniedError:
    """The error for an S3 request that found no usable credentials: where they come from."""
    return PermissionDeniedError(
        f"{what}: no usable AWS credentials ({type(error).__name__}: {error}). {CREDENTIAL_SOURCES}"
    )


def is_transient(error: BaseException) -> bool:
    """Whether an S3 error is worth retrying: throttling, 5xx, timeouts, connection resets."""
    if isinstance(error, botocore.exceptions.ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return code in _TRANSIENT_CODES or status == 429 or status >= 500
    return isinstance(error, _TRANSIENT_ERRORS)


def _error_code(error: botocore.exceptions.ClientError) -> tuple[str, int]:
    code = str(error.response.get("Error", {}).get("Code", ""))
    status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


_COPY_REFUSED_CODES = ("NotImplemented", "InvalidRequest", "AccessDenied")
"""What a server answers a server-side copy it will not make; the copy then streams."""


def _copy_refused(error: StorageError) -> bool:
    """Whether `error` (translated) says the server refuses server-side copies here."""
    text = str(error)
    return isinstance(error, PermissionDeniedError) or any(
        f": {code} " in text for code in _COPY_REFUSED_CODES
    )


def translate_error(error: botocore.exceptions.ClientError, what: str) -> StorageError:
    """Turn a botocore ClientError into the storage layer's exception, naming the object."""
    code, status = _error_code(error)
    message = error.response.get("Error", {}).get("Message", "") or code
    text = f"{what}: {code or status} {message}".strip()
    if code in _CONFLICT_CODES or status == 412:
        return AlreadyExistsError(f"{what}: the object already exists (HTTP 412)")
    if code in _NOT_FOUND_CODES or status == 404:
        return ObjectNotFoundError(text)
    if code in _DENIED_CODES or status == 403:
        return PermissionDeniedError(text)
    return StorageError(text)


@dataclass(kw_only=True)
class S3Options(BucketOptions):
    """Settings of an S3 store; every field may come from ``storage_options``."""

    KIND: ClassVar[str] = "S3"
    CREDENTIALS: ClassVar[str] = "the standard AWS credential chain"
    SECRETS: ClassVar[tuple[str, ...]] = SECRET_OPTIONS

    region_name: str | None = None
    profile_name: str | None = None
    aws_access_key_id: str | None = field(default=None, repr=False)
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_session_token: str | None = field(default=None, repr=False)
    part_size: int = 16 * MIB
    send_checksums: bool = True
    addressing_style: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.part_size < MIN_PART_SIZE:
            raise InvalidArgumentError(
                f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum)"
            )
        if (self.aws_access_key_id is None) != (self.aws_secret_access_key is None):
            raise InvalidArgumentError("aws_access_key_id and aws_secret_access_key go together")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise InvalidArgumentError("addressing_style must be 'auto', 'path' or 'virtual'")


def part_size_for(number: int, base: int) -> int:
    """Size of part `number` (1-based) of a multipart upload whose first parts are `base`."""
    return min(MAX_PART_SIZE, base << ((number - 1) // PARTS_PER_DOUBLING))


class S3Writer(ChunkedWriter):
    """One streamed object: a single PUT when small, else a parallel multipart upload."""

    def __init__(self, store: S3Store, key: str, create_only: bool) -> None:
        self._store = store
        self._key = key
        self._create_only = create_only
        self._chunk_limit = store.options.part_size
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._in_flight = BytesInFlight(store.options.part_size * store.options.max_concurrency)
        self._size = 0
        self._closed = False

    def _chunk_full(self) -> None:
        self._send_part()

    def _send_part(self) -> None:
        self._raise_failed_part()
        if self._upload_id is None:
            self._upload_id = self._store.create_multipart(self._key)
        if len(self._parts) >= MAX_PARTS:
            raise StorageError(
                f"{self._key!r} is larger than S3's limit of {MAX_OBJECT_SIZE >> 40} TiB per object"
            )
        body, self._buffer = self._buffer, bytearray()
        number = len(self._parts) + 1
        self._chunk_limit = part_size_for(number + 1, self._store.options.part_size)
        self._in_flight.acquire(len(body))
        try:
            future = self._store.pool.submit(self._upload_part, self._upload_id, number, body)
        except BaseException:
            self._in_flight.release(len(body))
            raise
        self._parts.append(future)

    def _upload_part(self, upload_id: str, number: int, body: bytearray) -> dict[str, Any]:
        try:
            return self._store.upload_part(self._key, upload_id, number, body)
        finally:
            self._in_flight.release(len(body))

    def _raise_failed_part(self) -> None:
        for future in self._parts:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def commit(self) -> ObjectInfo:
        if self._closed:
            raise StorageError(f"commit of {self._key!r} after commit or abort")
        try:
            if self._upload_id is None:
                body, self._buffer = self._buffer, bytearray()
                self._store.put(self._key, bytes(body), create_only=self._create_only)
            else:
                if self._buffer:
                    self._send_part()
                parts = [future.result() for future in self._parts]
                self._store.complete_multipart(
                    self._key, self._upload_id, parts, create_only=self._create_only
                )
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return ObjectInfo(self._key, self._size)

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._buffer = bytearray()
        for future in self._parts:
            future.cancel()
        for future in self._parts:
            if not future.cancelled():
                future.exception()  # waits; the error, if any, was already raised or is moot
        if self._upload_id is not None:
            self._store.abort_upload(UploadInfo(self._key, self._upload_id))


class S3Store(BucketStore[S3Options]):
    """A bucket prefix on S3 or any S3-compatible server."""

    SCHEME: ClassVar[str] = "s3"
    SERVER_ERRORS: ClassVar[tuple[type[BaseException], ...]] = (
        botocore.exceptions.ClientError,
        *_CREDENTIAL_ERRORS,
    )
    TRANSPORT_ERRORS: ClassVar[tuple[type[BaseException], ...]] = _TRANSIENT_ERRORS

    def __init__(self, bucket: str, prefix: str, options: S3Options) -> None:
        super().__init__(bucket, prefix, options)
        try:
            session = boto3.session.Session(
                aws_access_key_id=options.aws_access_key_id,
                aws_secret_access_key=options.aws_secret_access_key,
                aws_session_token=options.aws_session_token,
                profile_name=options.profile_name,
                region_name=options.region_name,
            )
        except botocore.exceptions.ProfileNotFound as error:
            raise credentials_error(error, f"s3://{bucket}") from None
        config = botocore.config.Config(
            max_pool_connections=options.max_concurrency * 2 + 4,
            retries={"total_max_attempts": 1, "mode": "standard"},  # no retries of its own
            connect_timeout=min(options.connect_timeout_s, options.retry.deadline_s),
            read_timeout=min(options.read_timeout_s, options.retry.deadline_s),
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": options.addressing_style},
        )
        self.client = session.client("s3", endpoint_url=options.endpoint_url, config=config)

    def check_root(self) -> None:
        """S3 bucket names have 3 characters at least; the server judges the rest."""
        if len(self.bucket) < 3:
            raise InvalidArgumentError(
                f"S3 bucket name {self.bucket!r} is too short (3 characters at least)"
            )

    def is_transient(self, error: BaseException) -> bool:
        """See the module function `is_transient`."""
        return is_transient(error)

    def is_throttle(self, error: BaseException) -> bool:
        """SlowDown, 503 or 429: S3 asked to reduce the request rate."""
        if not isinstance(error, botocore.exceptions.ClientError):
            return False
        code, status = _error_code(error)
        return code in _THROTTLE_CODES or status in (429, 503)

    def translate_error(self, error: BaseException, what: str) -> StorageError:
        """A ClientError as `translate_error` has it; a transport error that outlived its
        retries as a StorageError."""
        if isinstance(error, botocore.exceptions.ClientError):
            return translate_error(error, what)
        if isinstance(error, _CREDENTIAL_ERRORS):
            return credentials_error(error, what)
        return StorageError(f"{what}: still failing after retries: {type(error).__name__}: {error}")

    # Writes ---------------------------------------------------------------------------------

    def open_writer(self, key: str, *, create_only: bool = False) -> S3Writer:
        """Start a streamed write of `key`."""
        self.full_name(key)
        return S3Writer(self, key, create_only)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        """Write a small object in one PUT; create-only raises AlreadyExistsError."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self.full_name(key), "Body": data}
        if create_only:
            args["IfNoneMatch"] = "*"
        if self.options.send_checksums:
            args["ChecksumCRC32C"] = crc32c_b64(data)
        self.call(f"put {self.where(key)}", lambda: self.client.put_object(**args), sent=len(data))
        return ObjectInfo(key, len(data))

    def create_multipart(self, key: str) -> str:
        """Start a multipart upload; returns its id."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self.full_name(key)}
        if self.options.send_checksums:
            args["ChecksumAlgorithm"] = "CRC32C"
        response = self.call(
            f"start upload {self.where(key)}", lambda: self.client.create_multipart_upload(**args)
        )
        return str(response["UploadId"])

    def upload_part(self, key: str, upload_id: str, number: int, body: bytearray) -> dict[str, Any]:
        """Upload one part (retried alone); returns its entry for CompleteMultipartUpload."""
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self.full_name(key),
            "UploadId": upload_id,
            "PartNumber": number,
            "Body": body,
        }
        part: dict[str, Any] = {"PartNumber": number}
        if self.options.send_checksums:
            args["ChecksumCRC32C"] = part["ChecksumCRC32C"] = crc32c_b64(body)
        response = self.call(
            f"upload part {number} of {self.where(key)}",
            lambda: self.client.upload_part(**args),
            sent=len(body),
        )
        part["ETag"] = response["ETag"]
        return part

    def complete_multipart(
        self, key: str, upload_id: str, parts: list[dict[str, Any]], *, create_only: bool
    ) -> None:
        """Finish a multipart upload; create-only sends If-None-Match."""
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self.full_name(key),
            "UploadId": upload_id,
            "MultipartUpload": {"Parts": parts},
        }
        if create_only:
            args["IfNoneMatch"] = "*"
        self.call(
            f"complete upload {self.where(key)}",
            lambda: self.client.complete_multipart_upload(**args),
        )

    def abort_upload(self, upload: UploadInfo) -> None:
        """Abort one multipart upload; one that is already gone counts as aborted."""
        try:
            self.call(
                f"abort upload {self.where(upload.key)}",
                lambda: self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self.full_name(upload.key), UploadId=upload.upload_id
                ),
            )
        except ObjectNotFoundError:
            return

    # Server-side copies ---------------------------------------------------------------------

    def copy_within(
        self, source: ObjectStore, source_key: str, key: str, *, create_only: bool = False
    ) -> ObjectInfo | None:
        """Have S3 copy an object of another S3 store that this one's endpoint and credentials
        reach (`spotckpt.storage.copying.ServerSideCopy`): UploadPartCopy in parts of up to
        `COPY_PART_SIZE`, then a create-only completion where asked (CopyObject stops at 5 GiB and
        has no create-only form). None for any other source, and where the server refuses the
        first part (a bucket policy, a server without UploadPartCopy): the caller streams."""
        if not isinstance(source, S3Store) or not self._same_identity(source):
            return None
        size = source.head(source_key)
        if size is None:
            raise ObjectNotFoundError(f"copy of {source.where(source_key)}: no such object")
        if size.size == 0:
            return self.put(key, b"", create_only=create_only)
        name = self.full_name(key)
        started = self.call(  # no checksum algorithm: the parts come from S3's own bytes
            f"start copy to {self.where(key)}",
            lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=name),
        )
        upload = UploadInfo(key, str(started["UploadId"]))
        origin = {"Bucket": source.bucket, "Key": source.full_name(source_key)}
        try:
            parts = []
            for number, first in enumerate(range(0, size.size, COPY_PART_SIZE), start=1):
                last = min(size.size, first + COPY_PART_SIZE) - 1
                try:
                    answer = self.call(
                        f"copy part {number} of {source.where(source_key)} to {self.where(key)}",
                        functools.partial(
                            self.client.upload_part_copy,
                            Bucket=self.bucket,
                            Key=name,
                            UploadId=upload.upload_id,
                            PartNumber=number,
                            CopySource=origin,
                            CopySourceRange=f"bytes={first}-{last}",
                        ),
                    )
                except StorageError as error:
                    if number == 1 and _copy_refused(error):
                        self._abort_quietly(upload)
                        return None
                    raise
                parts.append({"PartNumber": number, "ETag": answer["CopyPartResult"]["ETag"]})
            self.complete_multipart(key, upload.upload_id, parts, create_only=create_only)
        except BaseException:
            self._abort_quietly(upload)
            raise
        return ObjectInfo(key, size.size)

    def _abort_quietly(self, upload: UploadInfo) -> None:
        """Abort `upload`, logging (not raising) a failure: the error being handled matters more,
        and gc removes an upload left behind."""
        try:
            self.abort_upload(upload)
        except StorageError as error:
            log.warning("could not abort the copy upload to %s: %s", self.where(upload.key), error)

    def _same_identity(self, other: S3Store) -> bool:
        """Whether `other` is reached through this store's endpoint with its credentials (the
        default chain counts as one identity), so that S3 can read its objects for a copy."""
        mine, theirs = self.options, other.options
        return (mine.endpoint_url, mine.aws_access_key_id, mine.profile_name) == (
            theirs.endpoint_url,
            theirs.aws_access_key_id,
            theirs.profile_name,
        )

    # Reads ----------------------------------------------------------------------------------

    def _get_object(self, key: str, byte_range: str | None) -> dict[str, Any] | None:
        """GetObject's answer, of `byte_range` if given; None when that starts at or past the
        object's end (416)."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self.full_name(key)}
        if byte_range is not None:
            args["Range"] = byte_range
        try:
            return self.client.get_object(**args)
        except botocore.exceptions.ClientError as error:
            if byte_range is not None and _error_code(error) == ("InvalidRange", 416):
                return None
            raise

    def _download(self, key: str, deadline: Deadline, first: int, last: int | None) -> bytes:
        """One GetObject, its body read before the operation's deadline."""
        response = self._get_object(key, None if last is None else f"bytes={first}-{last}")
        if response is None:
            return b""
        expected = int(response.get("ContentLength", -1))
        with response["Body"] as raw:  # the urllib3 response under botocore's wrapper
            return read_body(raw, deadline, self.options.read_timeout_s, expected)

    def _download_into(
        self, key: str, deadline: Deadline, start: int, views: Sequence[memoryview]
    ) -> int:
        """One ranged GetObject, its body read into `views` before the deadline."""
        last = start + sum(view.nbytes for view in views) - 1
        response = self._get_object(key, f"bytes={start}-{last}")
        if response is None:
            return 0
        with response["Body"] as raw:
            return read_body_into(raw, deadline, self.options.read_timeout_s, views)

    def head(self, key: str) -> ObjectInfo | None:
        """HeadObject's size and time, or None when the object does not exist."""
        try:
            response = self.call(
                f"head {self.where(key)}",
                lambda: self.client.head_object(Bucket=self.bucket, Key=self.full_name(key)),
            )
        except ObjectNotFoundError:
            return None
        return ObjectInfo(key, int(response["ContentLength"]), response.get("LastModified"))

    def _list_page(self, full_prefix: str, delimiter: str | None, token: str | None) -> Page:
        """One ListObjectsV2 page; a delimiter the server refuses raises
        DelimiterNotHonouredError (see the module docstring)."""
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": full_prefix,
            "MaxKeys": self.options.list_page_size,
        }
        if delimiter is not None:
            args["Delimiter"] = delimiter
        if token:
            args["ContinuationToken"] = token
        try:
            page = self.client.list_objects_v2(**args)
        except botocore.exceptions.ClientError as error:
            code, status = _error_code(error)
            if delimiter is not None and (code in _DELIMITER_REFUSED_CODES or status == 501):
                raise DelimiterNotHonouredError(f"it answered {code or status}") from None
            raise
        objects = [
            ObjectInfo(self.relative(item["Key"]), int(item["Size"]), item.get("LastModified"))
            for item in page.get("Contents", [])
        ]
        common = [self.relative(item["Prefix"]) for item in page.get("CommonPrefixes", [])]
        return (
            objects,
            common,
            page.get("NextContinuationToken") if page.get("IsTruncated") else None,
        )

    # Deletes and unfinished uploads ---------------------------------------------------------

    def delete_many(self, keys: Iterable[str]) -> None:
        """DeleteObjects, 1,000 keys a request; missing objects are ignored."""
        full = [self.full_name(k) for k in keys]
        for start in range(0, len(full), DELETE_BATCH):
            batch = [{"Key": k} for k in full[start : start + DELETE_BATCH]]
            response = self.call(
                f"delete {len(batch)} objects under {self.uri}",
                functools.partial(
                    self.client.delete_objects,
                    Bucket=self.bucket,
                    Delete={"Objects": batch, "Quiet": True},
                ),
            )
            errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise StorageError(
                    f"deleting {len(errors)} objects under {self.uri} failed, first "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}"
                )

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """The unfinished multipart uploads under `prefix`, each with when it last got a part."""
        full_prefix = self.full_prefix(prefix)
        uploads: builtins.list[UploadInfo] = []
        markers: dict[str, str] = {}
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix, **markers}
            page = self.call(
                f"list uploads {self.uri}/{prefix}",
                functools.partial(self.client.list_multipart_uploads, **args),
            )
            for item in page.get("Uploads", []):
                key = self.relative(item["Key"])
                uploads.append(
                    UploadInfo(
                        key,
                        item["UploadId"],
                        item.get("Initiated"),
                        self._last_part_time(item["Key"], item["UploadId"], key),
                    )
                )
            if not page.get("IsTruncated"):
                return uploads
            markers = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "UploadIdMarker": page.get("NextUploadIdMarker", ""),
            }

    def _last_part_time(self, full_key: str, upload_id: str, key: str) -> datetime | None:
        """When an open multipart upload last received a part (None: no part yet)."""
        newest: datetime | None = None
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": full_key, "UploadId": upload_id}
        while True:
            try:
                page = self.call(
                    f"list parts of {self.where(key)}",
                    functools.partial(self.client.list_parts, **args),
                )
            except ObjectNotFoundError:  # completed or aborted meanwhile
                return newest
            for part in page.get("Parts", []):
                moment = part.get("LastModified")
                if moment is not None and (newest is None or moment > newest):
                    newest = moment
            if not page.get("IsTruncated"):
                return newest
            args["PartNumberMarker"] = page.get("NextPartNumberMarker", 0)

    def close(self) -> None:
        """Wait for running uploads, then release the thread pool and connections."""
        super().close()
        self.client.close()


def open_s3_store(uri: str, options: dict[str, Any]) -> S3Store:
    """Factory for ``s3://bucket/prefix``; see `S3Options` for the options."""
    if "endpoint_url" not in options:
        options["endpoint_url"] = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL"
        )
    return S3Store.from_uri(uri, S3Options.from_options(options))
