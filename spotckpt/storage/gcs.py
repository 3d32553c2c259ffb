"""``gs://bucket/prefix`` (or ``gcs://``) through Google's client library: resumable uploads.

Design choices:
- Library: google-cloud-storage, not gcsfs. Every call it offers takes ``retry=None`` and
  ``if_generation_match=0``, so each request runs under spotckpt's own `RetryPolicy` and
  create-only is a plain argument. gcsfs retries every request inside itself (six tries,
  fixed at class level), so its retries would nest inside ours; it also runs all I/O on one
  asyncio loop thread, and its 2026 releases first try a gRPC bucket-type lookup that hangs
  against emulators.
- Streamed objects use the JSON API's **resumable upload**, not the XML multipart API: one
  session per object, chunks of ``chunk_size`` bytes (a multiple of 256 KiB, 16 MiB by default)
  sent in order. The XML multipart API would allow parallel parts, but spotckpt already gets its
  parallelism from many ranks and files uploading at once; a resumable session can be resumed
  after a failure from the offset the server reports, takes ``ifGenerationMatch=0`` when it
  starts, verifies a whole-object CRC32C (``X-Goog-Hash`` on the last chunk) before the object
  becomes visible, and is what GCS emulators implement. The chunk engine is
  ``google.cloud.storage._media.requests.ResumableUpload``: the code google-cloud-storage itself
  runs for ``Blob.upload_from_file`` and ``BlobWriter``, used directly because those wrappers
  hide the upload object, so a failed chunk could not be ``recover()``-ed under our retry policy.
  The module path is private; the version is pinned in constraints.txt and the tests exercise it.
- Bounded memory: a writer fills one chunk while the previous one uploads on the store's thread
  pool, so it holds about two chunks (three after a partially acknowledged chunk) whatever the
  object size. Objects smaller than one chunk go up in a single request with their CRC32C in the
  metadata, which the server checks.
- Create-only: ``ifGenerationMatch=0`` on the single request or on the session's start; GCS then
  answers 412 when the object exists, which becomes `AlreadyExistsError` ("already committed").
  A create-only write also carries a random token in its custom metadata, so that a 412 seen
  only after a retry (the first attempt succeeded but its answer was lost) is recognised as our
  own commit rather than reported as a conflict.
- Retries: 408, 429 and 5xx answers (except 501 and 505), connection errors and timeouts, each
  request on its own; a chunk is retried after asking the server how many bytes it has
  (``recover()``) and resumes from there, so no byte is stored twice or skipped. 401/403, 404
  and 412 fail at once.
- Reads: one media GET per attempt through the store's session, the body read with `read_body`,
  so the policy's ``deadline_s`` bounds the whole read even when the answer trickles in (the
  library's download reads fixed-size chunks and would wait for each to fill). A whole-object
  read checks the CRC32C of ``X-Goog-Hash``; a mismatch is retried as damage in transit.
- Credentials: Application Default Credentials (``google.auth.default``), or a key file given as
  ``credentials_file``, or anonymous (``anonymous=True``, and by default when the endpoint comes
  from ``STORAGE_EMULATOR_HOST``). The endpoint is ``endpoint_url``, else
  ``STORAGE_EMULATOR_HOST``, else https://storage.googleapis.com.
- A store pickles as its bucket, prefix and options with the endpoint and anonymity it resolved,
  and is rebuilt where it is unpickled (a child of DCP's process-mode async save, say), loading
  its credentials there the same way; no credential is pickled.
- Delimited listings (`GCSStore.list_delimited`) pass ``delimiter`` to objects.list, which takes
  any string; a server (an emulator, say) that refuses it or answers against the rules is warned
  about once and then listed in full, rolled up client-side.
- GCS cannot list unfinished resumable sessions, so `list_uploads` is always empty; an abandoned
  session exposes nothing, bills nothing and expires after a week. Aborting a writer still
  cancels its session.

Options, URIs, keys, listings, retries and pickling come from the base class,
`spotckpt.storage.bucket.BucketStore`; what follows is the JSON API's side of them.
"""

from __future__ import annotations

import base64
import builtins
import json
import logging
import os
import re
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit

import google.auth
import google.auth.exceptions
import requests
import requests.adapters
import urllib3.exceptions
from google.api_core import exceptions as api_exceptions
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud.storage._media.requests import ResumableUpload
from google.cloud.storage.blob import Blob
from google.cloud.storage.client import Client
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from spotckpt.checksum import crc32c, crc32c_b64
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
    check_key,
)
from spotckpt.storage.bucket import BucketOptions, BucketStore, Page
from spotckpt.storage.retry import Deadline, read_body, read_body_into

log = logging.getLogger("spotckpt.storage")

KIB = 1 << 10
MIB = 1 << 20
CHUNK_MULTIPLE = 256 * KIB
DEFAULT_ENDPOINT = "https://storage.googleapis.com"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
CONTENT_TYPE = "application/octet-stream"
TOKEN_KEY = "spotckpt-writer"
"""Custom-metadata key of the random token a create-only write carries."""

_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_SESSION_DONE = (499, 200, 204, 404, 410)  # 499: GCS's answer to a cancelled session
_TRANSIENT_ERRORS = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    google.auth.exceptions.TransportError,
    ConnectionError,
    TimeoutError,
)
_HTTP_ERRORS = (api_exceptions.GoogleAPICallError, InvalidResponse, DataCorruption)
MAX_ERROR_BODY = 64 * KIB


def http_status(error: BaseException) -> int | None:
    """The HTTP status behind a google-cloud-storage error, or None for other errors."""
    if isinstance(error, api_exceptions.GoogleAPICallError):
        return int(error.code) if error.code is not None else None
    if isinstance(error, InvalidResponse):
        status = getattr(error.response, "status_code", None)
        return int(status) if status is not None else None
    return None


def is_transient(error: BaseException) -> bool:
    """Whether a GCS error is worth retrying: 408, 429, 5xx, timeouts, connection resets."""
    status = http_status(error)
    if status is not None:
        return status in (408, 429) or (500 <= status < 600 and status not in (501, 505))
    if isinstance(error, google.auth.exceptions.RefreshError):
        return bool(getattr(error, "retryable", False))
    return isinstance(error, _TRANSIENT_ERRORS)


def is_throttle(error: BaseException) -> bool:
    """429 Too Many Requests: GCS asks to slow down (a bucket's rate ramps up under load)."""
    return http_status(error) == 429


def _is_transient_read(error: BaseException) -> bool:
    # A download whose CRC32C does not match was damaged in transit: fetch it again.
    return is_transient(error) or isinstance(error, DataCorruption)


def _server_message(error: BaseException) -> str:
    """The server's own words, without the request URL (a session URL is a credential)."""
    if isinstance(error, api_exceptions.GoogleAPICallError):
        for item in error.errors or []:
            if isinstance(item, dict) and item.get("message"):
                return str(item["message"])[:300]
        return str(error.reason or "")[:300]
    response = getattr(error, "response", None)
    if response is None:
        return str(error)[:300]
    try:
        body = response.json()
        message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
    except ValueError:
        message = ""
    return str(message or getattr(response, "reason", "") or "")[:300]


def translate_error(error: BaseException, what: str) -> StorageError:
    """Turn a google-cloud-storage or transport error into the storage layer's exception."""
    if isinstance(error, DataCorruption):
        return StorageError(f"{what}: CRC32C mismatch between client and server ({error.args})")
    status = http_status(error)
    auth = isinstance(error, google.auth.exceptions.GoogleAuthError)
    if auth and not isinstance(error, google.auth.exceptions.TransportError):
        return PermissionDeniedError(
            f"{what}: the credentials were rejected or could not be refreshed "
            f"({type(error).__name__}: {str(error)[:200]})"
        )
    if status is None:
        return StorageError(f"{what}: {type(error).__name__}: {str(error)[:300]}")
    message = _server_message(error)
    if status == 412:
        return AlreadyExistsError(
            f"{what}: the object already exists, it is already committed (HTTP 412 "
            "Precondition Failed on ifGenerationMatch=0); a create-only write never replaces it"
        )
    if status == 404:
        return ObjectNotFoundError(f"{what}: not found (HTTP 404) {message}".rstrip())
    if status in (401, 403):
        return PermissionDeniedError(f"{what}: permission denied (HTTP {status}) {message}")
    return StorageError(f"{what}: HTTP {status} {message}".rstrip())


def _check_crc(response: requests.Response, data: bytes) -> None:
    """Raise DataCorruption when the answer's ``X-Goog-Hash`` CRC32C does not match `data`."""
    for part in response.headers.get("X-Goog-Hash", "").split(","):
        name, _, value = part.strip().partition("=")
        if name == "crc32c" and value != crc32c_b64(data):
            raise DataCorruption(response, f"CRC32C {value} expected, {crc32c_b64(data)} read")


def _crc_b64(value: int) -> str:
    """A CRC32C value in the base64 big-endian form GCS reports."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


def _crc32c_of(reported: str | None) -> int | None:
    """The CRC32C GCS reported for an object (base64 big-endian), or None if it reported none or
    something that is not one."""
    try:
        raw = base64.b64decode(reported or "", validate=True)
    except ValueError:
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def _parse_time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str) or not value:
        return None
    text = value.replace("Z", "+00:00")
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(\.\d+)?(.*)$", text)
    if match:  # Python 3.10's fromisoformat takes 3 or 6 fraction digits only
        fraction = (match.group(2) or ".0")[1:7].ljust(6, "0")
        text = f"{match.group(1)}.{fraction}{match.group(3)}"
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


@dataclass(kw_only=True)
class GCSOptions(BucketOptions):
    """Settings of a GCS store; every field may come from ``storage_options``."""

    KIND: ClassVar[str] = "GCS"
    CREDENTIALS: ClassVar[str] = "Application Default Credentials"

    project: str | None = None
    credentials_file: str | None = field(default=None, repr=False)
    anonymous: bool | None = None
    chunk_size: int = 16 * MIB
    read_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size < CHUNK_MULTIPLE or self.chunk_size % CHUNK_MULTIPLE:
            raise InvalidArgumentError(
                f"chunk_size must be a positive multiple of {CHUNK_MULTIPLE} bytes"
            )
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise InvalidArgumentError("connect_timeout_s and read_timeout_s must be positive")
        if self.endpoint_url is not None and urlsplit(self.endpoint_url).scheme not in (
            "http",
            "https",
        ):
            raise InvalidArgumentError("endpoint_url must be an http:// or https:// URL")


def _endpoint(options: GCSOptions) -> tuple[str, bool]:
    """The API endpoint without a trailing slash, and whether it came from the emulator env."""
    emulator = os.environ.get(EMULATOR_ENV, "").strip()
    endpoint = options.endpoint_url or emulator or DEFAULT_ENDPOINT
    if "://" not in endpoint:  # STORAGE_EMULATOR_HOST is often written as host:port
        endpoint = f"http://{endpoint}"
    return endpoint.rstrip("/"), options.endpoint_url is None and bool(emulator)


def _credentials(options: GCSOptions, anonymous: bool, uri: str) -> Credentials:
    if anonymous:
        return AnonymousCredentials()
    try:
        if options.credentials_file:
            credentials, _ = google.auth.load_credentials_from_file(
                options.credentials_file, scopes=SCOPES
            )
        else:
            credentials, _ = google.auth.default(scopes=SCOPES)
    except google.auth.exceptions.DefaultCredentialsError as error:
        raise PermissionDeniedError(
            f"no Google Cloud credentials for {uri}: {error}. Use Application Default "
            "Credentials (gcloud auth application-default login, GOOGLE_APPLICATION_CREDENTIALS "
            "or a service account), credentials_file=..., or anonymous=True for an emulator"
        ) from None
    return credentials


class _ChunkStream:
    """The unacknowledged tail of a streamed object, addressed by absolute offsets.

    `ResumableUpload` reads each chunk from it and, after a failure, seeks back to the offset the
    server reports; bytes the server has acknowledged are released.
    """

    def __init__(self) -> None:
        self._pieces: deque[bytes] = deque()
        self._base = 0
        self._size = 0
        self._pos = 0

    @property
    def available(self) -> int:
        """Bytes between the read position and the end."""
        return self._base + self._size - self._pos

    def append(self, data: bytes) -> None:
        """Add bytes at the end."""
        if data:
            self._pieces.append(data)
            self._size += len(data)

    def tell(self) -> int:
        """The absolute read position."""
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        """Move to an absolute position inside the retained bytes."""
        if whence != 0 or not self._base <= pos <= self._base + self._size:
            raise StorageError(
                f"resumable upload asked for offset {pos}, outside the retained bytes "
                f"{self._base}-{self._base + self._size}: the server lost acknowledged data"
            )
        self._pos = pos
        return pos

    def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes from the position on; a whole piece is returned without a copy."""
        wanted = self.available if size < 0 else min(size, self.available)
        out: list[bytes | memoryview] = []
        offset = self._base
        for piece in self._pieces:
            if not wanted:
                break
            end = offset + len(piece)
            if end > self._pos:
                start = self._pos - offset
                take = min(len(piece) - start, wanted)
                whole = start == 0 and take == len(piece)
                out.append(piece if whole else memoryview(piece)[start : start + take])
                self._pos += take
                wanted -= take
            offset = end
        if len(out) == 1 and isinstance(out[0], bytes):
            return out[0]
        return b"".join(out)

    def release(self, upto: int) -> None:
        """Forget the bytes before absolute offset `upto` (the server has them)."""
        while self._pieces and self._base + len(self._pieces[0]) <= upto:
            piece = self._pieces.popleft()
            self._base += len(piece)
            self._size -= len(piece)
        if self._pieces and upto > self._base:
            cut = upto - self._base
            self._pieces[0] = self._pieces[0][cut:]
            self._base += cut
            self._size -= cut


class GCSWriter(ChunkedWriter):
    """One streamed object: a single request when small, else a resumable upload session."""

    def __init__(self, store: GCSStore, key: str, create_only: bool) -> None:
        self._store = store
        self._key = key
        self._create_only = create_only
        self._token = uuid.uuid4().hex if create_only else None
        self._chunk_size = self._chunk_limit = store.options.chunk_size
        self._buffer = bytearray()
        self._stream = _ChunkStream()
        self._upload: ResumableUpload | None = None
        self._pending: Future[None] | None = None
        self._resource: dict[str, Any] | None = None
        self._conflict: AlreadyExistsError | None = None
        self._size = 0
        self._crc = 0
        self._closed = False

    def _observe(self, view: memoryview) -> None:
        self._crc = crc32c(view, self._crc)

    def _chunk_full(self) -> None:
        self._hand_off()

    def _hand_off(self) -> None:
        """Queue the full buffer for upload once the previous chunk is acknowledged."""
        self._wait_pending()
        if self._conflict is None:
            self._stream.append(bytes(self._buffer))
            self._pending = self._store.pool.submit(self._pump, False)
        self._buffer = bytearray()  # after a conflict the bytes have nowhere to go

    def _wait_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _pump(self, final: bool) -> None:
        """Send every whole chunk held; with `final`, also the rest, which ends the upload.

        A create-only conflict found before the end (GCS may check ``ifGenerationMatch`` when
        the session starts) is kept for `commit` to raise, as the protocol has it; the bytes
        written meanwhile are dropped.
        """
        try:
            if self._upload is None:
                self._upload = self._initiate()
            while self._resource is None:
                if not final and self._stream.available < self._chunk_size:
                    return
                self._transmit(self._upload, final)
        except AlreadyExistsError as error:
            if final:
                raise
            self._conflict = error
            self._stream = _ChunkStream()

    def _initiate(self) -> ResumableUpload:
        store = self._store
        metadata: dict[str, Any] = {"name": store.full_name(self._key)}
        if self._token:
            metadata["metadata"] = {TOKEN_KEY: self._token}

        def start() -> ResumableUpload:
            upload = ResumableUpload(
                store.upload_url(self._create_only),
                self._chunk_size,
                checksum="crc32c",
                retry=None,
            )
            upload.initiate(
                store.session,
                self._stream,
                metadata,
                CONTENT_TYPE,
                stream_final=False,
                timeout=store.timeout,
            )
            return upload

        return store.call(f"start upload of {store.where(self._key)}", start)

    def _transmit(self, upload: ResumableUpload, final: bool) -> None:
        """Send one chunk, retried on its own; before a retry, ask the server where it stands."""
        store = self._store
        attempts = 0

        def once() -> None:
            nonlocal attempts
            attempts += 1
            if attempts > 1 and not self._recover(upload, final):
                return
            if not final and self._stream.available < self._chunk_size:
                return  # the server kept part of the chunk; the rest goes with the next one
            response = upload.transmit_next_chunk(store.session, timeout=store.timeout)
            self._stream.release(upload.bytes_uploaded)
            if upload.finished:
                self._resource = response.json()

        what = f"upload bytes {upload.bytes_uploaded}- of {store.where(self._key)}"
        try:
            store.call(what, once)
        except AlreadyExistsError:
            if attempts > 1 and self._token and store.written_by(self._key, self._token):
                self._resource = {"size": str(self._size)}
                return
            raise

    def _recover(self, upload: ResumableUpload, final: bool) -> bool:
        """Re-sync with the server after a failed chunk; False when the upload has finished."""
        try:
            upload.recover(self._store.session)
        except InvalidResponse as error:
            status = http_status(error)
            if status in (200, 201):  # the last chunk did arrive; only its answer was lost
                self._resource = error.response.json()
                return False
            if status not in (404, 410):
                raise
            # The session is gone. GCS keeps a finished one answering 200, but a server that
            # forgets it (the emulator does) leaves only the object itself to compare with.
            if final and self._store.holds(self._key, self._size, self._crc, self._token):
                self._resource = {"size": str(self._size)}
                return False
            raise StorageError(
                f"the upload session of {self._store.where(self._key)} is gone (HTTP {status}): "
                "it expired, was cancelled, or another attempt finished it"
            ) from None
        return True

    def commit(self) -> ObjectInfo:
        """Send the rest and finish the upload; raises AlreadyExistsError for create-only."""
        if self._closed:
            raise StorageError(f"commit of {self._key!r} after commit or abort")
        try:
            self._wait_pending()
            if self._conflict is not None:
                raise self._conflict
            if self._upload is None:
                body, self._buffer = bytes(self._buffer), bytearray()
                info = self._store.put_object(self._key, body, self._token)
            else:
                self._stream.append(bytes(self._buffer))
                self._buffer = bytearray()
                self._pump(final=True)
                info = self._finished_info()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return info

    def _finished_info(self) -> ObjectInfo:
        resource = self._resource or {}
        size = int(resource.get("size", -1))
        if size != self._size:
            raise StorageError(
                f"upload of {self._store.where(self._key)} ended with {size} bytes on the "
                f"server, {self._size} were written"
            )
        return ObjectInfo(self._key, size, _parse_time(resource.get("updated")))

    def abort(self) -> None:
        """Drop the buffered bytes and cancel the session; nothing becomes visible."""
        if self._closed:
            return
        self._closed = True
        self._buffer = bytearray()
        pending, self._pending = self._pending, None
        if pending is not None and not pending.cancel():
            pending.exception()  # waits; its error, if any, was raised already or is moot now
        upload, self._upload = self._upload, None
        self._stream = _ChunkStream()
        if upload is not None and upload.resumable_url and self._resource is None:
            try:
                self._store.cancel_session(upload.resumable_url, self._key)
            except StorageError as error:
                # Nothing was published; an uncancelled session holds no object, bills nothing
                # and expires after a week.
                log.warning("could not cancel the upload session of %s: %s", self._key, error)


class GCSStore(BucketStore[GCSOptions]):
    """A bucket prefix on Google Cloud Storage or a GCS emulator."""

    SCHEME: ClassVar[str] = "gs"
    SERVER_ERRORS: ClassVar[tuple[type[BaseException], ...]] = _HTTP_ERRORS
    TRANSPORT_ERRORS: ClassVar[tuple[type[BaseException], ...]] = (
        *_TRANSIENT_ERRORS,
        google.auth.exceptions.GoogleAuthError,
    )

    def __init__(self, bucket: str, prefix: str, options: GCSOptions) -> None:
        super().__init__(bucket, prefix, options)
        self.endpoint, from_emulator_env = _endpoint(options)
        self.anonymous = options.anonymous if options.anonymous is not None else from_emulator_env
        credentials = _credentials(options, self.anonymous, self.uri)
        self.session = AuthorizedSession(credentials)
        adapter = requests.adapters.HTTPAdapter(
            pool_connections=4, pool_maxsize=options.max_concurrency * 2 + 4, max_retries=0
        )
        self.session.mount("https://", adapter)
        self.session.mount("http://", adapter)
        self.client = Client(
            project=options.project,
            credentials=credentials,
            _http=self.session,
            client_options={"api_endpoint": self.endpoint},
        )
        self._bucket = self.client.bucket(bucket)
        deadline_s = options.retry.deadline_s
        self.timeout = (
            min(options.connect_timeout_s, deadline_s),
            min(options.read_timeout_s, deadline_s),
        )

    def check_root(self) -> None:
        """GCS's bucket naming rules; the prefix must be a plain key."""
        if not _BUCKET_NAME.match(self.bucket):
            raise InvalidArgumentError(f"{self.bucket!r} is not a valid GCS bucket name")
        if self.prefix:
            check_key(self.prefix)

    def is_transient(self, error: BaseException) -> bool:
        """See the module function `is_transient`."""
        return is_transient(error)

    def is_throttle(self, error: BaseException) -> bool:
        """See the module function `is_throttle`."""
        return is_throttle(error)

    def is_transient_read(self, error: BaseException) -> bool:
        """A whole-object read whose CRC32C does not match was damaged in transit: retried."""
        return _is_transient_read(error)

    def translate_error(self, error: BaseException, what: str) -> StorageError:
        """See the module function `translate_error`."""
        return translate_error(error, what)

    def upload_url(self, create_only: bool) -> str:
        """Where resumable sessions start; create-only adds ``ifGenerationMatch=0``."""
        url = f"{self.endpoint}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        url += "?uploadType=resumable"
        return url + "&ifGenerationMatch=0" if create_only else url

    def portable_options(self) -> GCSOptions:
        """The options with the endpoint and anonymity resolved here (a child process may not
        see the emulator variable that chose them)."""
        return replace(self.options, endpoint_url=self.endpoint, anonymous=self.anonymous)

    # Writes ---------------------------------------------------------------------------------

    def open_writer(self, key: str, *, create_only: bool = False) -> GCSWriter:
        """Start a streamed write of `key`."""
        self.full_name(key)
        return GCSWriter(self, key, create_only)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        """Write a small object in one request; create-only raises AlreadyExistsError."""
        return self.put_object(key, bytes(data), uuid.uuid4().hex if create_only else None)

    def put_object(self, key: str, data: bytes, token: str | None) -> ObjectInfo:
        """One-request upload with its CRC32C; a token makes it create-only (see module doc)."""
        name = self.full_name(key)
        checksum = crc32c_b64(data)
        attempts = 0

        def upload() -> Blob:
            nonlocal attempts
            attempts += 1
            blob = self._bucket.blob(name)
            blob.crc32c = checksum  # the server rejects the upload if the bytes differ
            if token:
                blob.metadata = {TOKEN_KEY: token}
            blob.upload_from_string(
                data,
                content_type=CONTENT_TYPE,
                if_generation_match=0 if token else None,
                timeout=self.timeout,
                checksum=None,
                retry=None,
            )
            return blob

        try:
            blob = self.call(f"put {self.where(key)}", upload, sent=len(data))
        except AlreadyExistsError:
            if attempts > 1 and token and self.written_by(key, token):
                return ObjectInfo(key, len(data))
            raise
        return ObjectInfo(key, len(data), blob.updated)

    def copy_within(
        self, source: ObjectStore, source_key: str, key: str, *, create_only: bool = False
    ) -> ObjectInfo | None:
        """Have GCS copy an object of another GCS store that this one's endpoint and credentials
        reach (`spotckpt.storage.copying.ServerSideCopy`): a rewrite, called again with its
        continuation token until GCS says it is done (large objects, other locations or storage
        classes take several calls); create-only with ``ifGenerationMatch=0``. None for any
        other source: the caller streams."""
        if not isinstance(source, GCSStore) or not self._same_identity(source):
            return None
        if source.head(source_key) is None:
            raise ObjectNotFoundError(f"copy of {source.where(source_key)}: no such object")
        origin = source._bucket.blob(source.full_name(source_key))
        mark = uuid.uuid4().hex if create_only else None
        attempts = 0
        rewrite_token: str | None = None
        total = 0
        target = self._bucket.blob(self.full_name(key))

        def step() -> tuple[str | None, int, int]:
            nonlocal attempts, target
            attempts += 1
            target = self._bucket.blob(self.full_name(key))
            if mark:
                target.metadata = {TOKEN_KEY: mark}
            answer: tuple[str | None, int, int] = target.rewrite(
                origin,
                token=rewrite_token,
                if_generation_match=0 if create_only else None,
                timeout=self.timeout,
                retry=None,
            )
            return answer

        try:
            while True:
                rewrite_token, _done, total = self.call(
                    f"copy {source.where(source_key)} to {self.where(key)}", step
                )
                if rewrite_token is None:
                    break
        except AlreadyExistsError:  # a retried call whose first answer was lost finished it
            if attempts > 1 and mark and self.written_by(key, mark):
                info = self.head(key)
                if info is not None:
                    return info
            raise
        return ObjectInfo(key, total, crc32c=_crc32c_of(target.crc32c))

    def _same_identity(self, other: GCSStore) -> bool:
        """Whether `other` is reached through this store's endpoint with its credentials
        (Application Default Credentials count as one identity), so that GCS can read its
        objects for a rewrite."""
        mine, theirs = self.options, other.options
        return (self.endpoint, self.anonymous, mine.credentials_file, mine.project) == (
            other.endpoint,
            other.anonymous,
            theirs.credentials_file,
            theirs.project,
        )

    def written_by(self, key: str, token: str) -> bool:
        """Whether the object now under `key` was written by the create-only writer `token`."""
        blob = self._get_blob(key)
        return blob is not None and (blob.metadata or {}).get(TOKEN_KEY) == token

    def holds(self, key: str, size: int, crc: int, token: str | None) -> bool:
        """Whether `key` holds exactly the bytes described (after a lost final answer)."""
        blob = self._get_blob(key)
        if blob is None or blob.size != size or blob.crc32c != _crc_b64(crc):
            return False
        return token is None or (blob.metadata or {}).get(TOKEN_KEY) == token

    def cancel_session(self, session_url: str, key: str) -> None:
        """Cancel a resumable upload session; one that is already gone counts as cancelled."""
        if not session_url.startswith(f"{self.endpoint}/upload/storage/v1/b/"):
            # the session carries our credentials: never send them anywhere else
            raise InvalidArgumentError(
                f"{key!r}: upload id is not a session URL of {self.endpoint}"
            )

        def cancel() -> None:
            response = self.session.delete(session_url, timeout=self.timeout)
            if response.status_code not in _SESSION_DONE:
                raise InvalidResponse(response, "cancelling the session failed")

        self.call(f"cancel upload of {self.where(key)}", cancel)

    def abort_upload(self, upload: UploadInfo) -> None:
        """Cancel the resumable session whose URL is `upload.upload_id`."""
        self.cancel_session(upload.upload_id, upload.key)

    # Reads ----------------------------------------------------------------------------------

    def _get_blob(self, key: str) -> Blob | None:
        name = self.full_name(key)
        return self.call(
            f"head {self.where(key)}",
            lambda: self._bucket.get_blob(name, timeout=self.timeout, retry=None),
        )

    def media_url(self, key: str) -> str:
        """The JSON API download URL of an object."""
        bucket, name = quote(self.bucket, safe=""), quote(self.full_name(key), safe="")
        return f"{self.endpoint}/download/storage/v1/b/{bucket}/o/{name}?alt=media"

    def _media_get(
        self, key: str, deadline: Deadline, first: int, last: int | None
    ) -> requests.Response:
        """Send one streamed media GET of bytes `first`..`last` (None: the whole object)."""
        headers = {"Accept-Encoding": "gzip"}  # with a raw read: the stored bytes as they are
        if last is not None:
            headers["Range"] = f"bytes={first}-{last}"
        left = deadline.check("sending the request")
        timeout = (min(self.timeout[0], left), min(self.timeout[1], left))
        return self.session.get(self.media_url(key), headers=headers, stream=True, timeout=timeout)

    def _download(self, key: str, deadline: Deadline, first: int, last: int | None) -> bytes:
        """One media GET of bytes `first`..`last` (None: the whole object), deadline-bound."""
        response = self._media_get(key, deadline, first, last)
        with response:
            status = response.status_code
            if last is not None and status == 416:
                return b""  # the range starts at or past the end
            if status not in (200, 206):
                raise self._error_answer(response, deadline)
            expected = int(response.headers.get("Content-Length", -1))
            data = read_body(response.raw, deadline, self.timeout[1], expected)
        if last is None:
            _check_crc(response, data)
        elif status == 200:  # the server ignored the range
            data = data[first : last + 1]
        return data

    def _error_answer(
        self, response: requests.Response, deadline: Deadline
    ) -> api_exceptions.GoogleAPICallError:
        """The error for a failed media GET, with the server's message (read under deadline)."""
        body = read_body(response.raw, deadline, self.timeout[1])[:MAX_ERROR_BODY]
        try:
            parsed = json.loads(body)
            message = (
                str(parsed.get("error", {}).get("message", "")) if isinstance(parsed, dict) else ""
            )
        except ValueError:
            message = ""
        message = message or str(response.reason or "")
        return api_exceptions.from_http_status(
            response.status_code, message, errors=[{"message": message}] if message else []
        )

    def _download_into(
        self, key: str, deadline: Deadline, start: int, views: Sequence[memoryview]
    ) -> int:
        """One ranged media GET into `views`, deadline-bound."""
        last = start + sum(view.nbytes for view in views) - 1
        response = self._media_get(key, deadline, start, last)
        with response:
            status = response.status_code
            if status == 416:
                return 0  # the range starts at or past the end
            if status not in (200, 206):
                raise self._error_answer(response, deadline)
            skip = start if status == 200 else 0  # the server ignored the range
            return read_body_into(response.raw, deadline, self.timeout[1], views, skip)

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and time, or None when it does not exist."""
        blob = self._get_blob(key)
        if blob is None:
            return None
        return ObjectInfo(key, int(blob.size or 0), blob.updated)

    def _list_page(self, full_prefix: str, delimiter: str | None, token: str | None) -> Page:
        """One objects.list page; a delimiter the server refuses raises
        DelimiterNotHonouredError (see the module docstring)."""
        rolled_up = "prefixes," if delimiter is not None else ""
        blobs = self.client.list_blobs(
            self._bucket,
            prefix=full_prefix or None,
            delimiter=delimiter,
            page_size=self.options.list_page_size,
            page_token=token,
            fields=f"items(name,size,updated),{rolled_up}nextPageToken",
            timeout=self.timeout,
            retry=None,
        )
        try:
            page = next(blobs.pages)
        except (api_exceptions.BadRequest, api_exceptions.MethodNotImplemented) as error:
            if delimiter is None:
                raise
            raise DelimiterNotHonouredError(f"it answered HTTP {error.code}") from None
        items = [ObjectInfo(self.relative(b.name), int(b.size or 0), b.updated) for b in page]
        common = [self.relative(name) for name in page.prefixes]
        return items, common, blobs.next_page_token

    # Deletes and unfinished uploads ---------------------------------------------------------

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete the objects in parallel; missing ones are ignored."""
        names = [(key, self.full_name(key)) for key in keys]

        def delete(key: str, name: str) -> None:
            try:
                self.call(
                    f"delete {self.where(key)}",
                    lambda: self._bucket.blob(name).delete(timeout=self.timeout, retry=None),
                )
            except ObjectNotFoundError:
                return

        futures = [self.pool.submit(delete, key, name) for key, name in names]
        errors = [error for error in (f.exception() for f in futures) if error is not None]
        if errors:
            first = errors[0]
            if len(errors) == 1:
                raise first
            kind = type(first) if isinstance(first, StorageError) else StorageError
            raise kind(f"{len(errors)} of {len(names)} deletes failed; first: {first}") from first

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """Always empty: GCS has no call that lists resumable sessions (see the module doc)."""
        self.full_prefix(prefix)
        return []

    def close(self) -> None:
        """Wait for running uploads, then release the thread pool and connections."""
        super().close()
        self.client.close()


def open_gcs_store(uri: str, options: dict[str, Any]) -> GCSStore:
    """Factory for ``gs://bucket/prefix`` and ``gcs://bucket/prefix``; see `GCSOptions`."""
    return GCSStore.from_uri(uri, GCSOptions.from_options(options))
