"""``az://container/prefix`` (also ``abfs://`` and ``abfss://``) on Azure Blob Storage, through
azure-storage-blob: block blobs staged in parallel with bounded memory.

Design choices:
- Library: azure-storage-blob, the official SDK, not adlfs. Every request takes the
  conditional headers spotckpt needs (``If-None-Match: *`` on Put Blob and Put Block List), the
  SDK's own retries can be switched off (``retry_total=0``) so each request runs under
  spotckpt's `RetryPolicy`, and the block API is exposed directly. adlfs wraps the same SDK in
  fsspec's async layer, retries inside itself and offers no create-only write.
- Objects smaller than one block go up in a single Put Blob; larger ones as blocks (Put Block)
  staged by the store's thread pool, then committed in one Put Block List. Blocks in flight are
  bounded in bytes (``block_size * max_concurrency``), plus the one being filled, whatever the
  object size. Azure allows 50,000 blocks; the block size doubles every `BLOCKS_PER_DOUBLING`
  blocks up to Azure's 4,000 MiB block limit (`block_size_for`), so no object is refused below
  Azure's own ceiling and objects below 74 GiB (at 16 MiB) never see a larger block.
- Create-only: ``If-None-Match: *`` on Put Blob or on Put Block List; Azure (and Azurite)
  answer 409 ``BlobAlreadyExists``, which becomes `AlreadyExistsError`. A create-only write
  carries a random token in its metadata (`TOKEN_KEY`), so that a 409 whose blob holds our own
  token (the first attempt succeeded but its answer was lost, and the retry met our own write)
  is recognised as our commit rather than reported as a conflict.
- Uncommitted blocks cannot be aborted and no lifecycle rule reaches them (Azure drops them
  after 7 days). `abort_upload` discards them: an empty, create-only Put Block List (which
  drops every staged block of the name) then a Delete Blob of exactly that empty version, which
  is visible for that moment only. An aborted writer does so at once; blocks of a writer that
  died are found by `list_uploads` (the blobs that have staged blocks and no committed version)
  and discarded by ``spotckpt gc`` once older than its safety age. Staged blocks of a name that
  has a committed blob cannot be told apart from it cheaply and are left to Azure's 7 days.
  Block ids carry the writer's token, so two writers staging one name never mix their blocks.
- Retries: the SDK's are off; 408, 429, 5xx (except 501 and 505), ``ServerBusy``,
  ``OperationTimedOut`` and ``InternalError`` answers, connection errors and timeouts are
  retried by the policy, each request (each block) on its own. 401/403, 404 and 409 fail at once.
- Reads: one Get Blob per attempt, its body read from the HTTP response with `read_body` /
  `read_body_into`, so the policy's ``deadline_s`` bounds the whole read even when the answer
  trickles in, and a range lands straight in the caller's buffer (`get_range_into`). The request
  is the SDK's generated operation (``BlobClient._client.blob.download``, private), called
  directly because ``download_blob`` reads the body itself, in chunks that no deadline bounds;
  the SDK's version is pinned in constraints.txt and the tests exercise it.
- Credentials, in this order: ``connection_string`` (option, else
  ``AZURE_STORAGE_CONNECTION_STRING``); ``account_key`` (option, else ``AZURE_STORAGE_KEY``);
  ``sas_token`` (option, else ``AZURE_STORAGE_SAS_TOKEN``); else azure-identity's
  ``DefaultAzureCredential`` (environment, workload identity, managed identity, Azure CLI),
  ``managed_identity_client_id`` choosing a user-assigned identity. The account comes from
  ``account_name`` (else ``AZURE_STORAGE_ACCOUNT``, else an ``abfs://container@account...``
  URI); the endpoint from ``endpoint_url``, else the connection string, else
  ``https://<account>.blob.core.windows.net``. None of them is ever printed: errors are
  translated without the SDK's exception as their cause (its text can hold a SAS URL) and
  passed through `spotckpt.redact.redact`.
- A store pickles as its container, prefix and options; secrets given as options cross only
  inside `ProcessSecrets`, secrets from the environment are read again where it is rebuilt.

Options, URIs, keys, listings, retries and pickling come from the base class,
`spotckpt.storage.bucket.BucketStore`; what follows is the Blob service's side of them.
"""

from __future__ import annotations

import base64
import builtins
import logging
import os
import re
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

import requests
import urllib3.exceptions
from azure.core import MatchConditions
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
)
from azure.storage.blob import BlobBlock, BlobClient, BlobServiceClient, ContainerClient

from spotckpt.errors import InvalidArgumentError, InvalidKeyError
from spotckpt.redact import redact
from spotckpt.storage.base import (
    AlreadyExistsError,
    ChunkedWriter,
    DelimiterNotHonouredError,
    ObjectInfo,
    ObjectNotFoundError,
    PermissionDeniedError,
    StorageError,
    UploadInfo,
)
from spotckpt.storage.bucket import BucketOptions, BucketStore, BytesInFlight, Page
from spotckpt.storage.retry import Deadline, read_body, read_body_into

MIB = 1 << 20
MAX_BLOCK_SIZE = 4000 * MIB
MAX_BLOCKS = 50_000
BLOCKS_PER_DOUBLING = 4_750
TOKEN_KEY = "spotckpt_token"
"""Metadata name of the random token a create-only write carries."""
UNCOMMITTED = "uncommitted-blocks"
"""The `UploadInfo.upload_id` of a blob that has staged blocks and no committed version."""
SECRET_OPTIONS = ("account_key", "sas_token", "connection_string")
SCHEMES = ("az", "abfs", "abfss")
log = logging.getLogger("spotckpt.storage")

_TRANSIENT_CODES = frozenset({"ServerBusy", "OperationTimedOut", "InternalError"})
_CONFLICT_CODES = frozenset({"BlobAlreadyExists", "ConditionNotMet"})
_DELIMITER_REFUSED_CODES = frozenset({"InvalidQueryParameterValue", "NotImplemented"})
_TRANSPORT_ERRORS = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    ConnectionError,
    TimeoutError,
)
_ABFS_HOST = re.compile(r"^(?P<account>[a-z0-9]{3,24})\.(?:dfs|blob)\.")
_CONTAINER = re.compile(r"^(?:\$root|[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62})$")


def _status(error: HttpResponseError) -> int:
    return int(error.status_code or 0)


def _code(error: HttpResponseError) -> str:
    """The service's error code: the SDK's, else the ``x-ms-error-code`` header (the raw
    operations that reads use do not set the SDK's)."""
    code = getattr(error, "error_code", None)
    if not code and error.response is not None:
        code = getattr(error.response, "headers", {}).get("x-ms-error-code")
    return str(code or "")


def is_transient(error: BaseException) -> bool:
    """Whether an Azure error is worth retrying: throttling, 5xx, timeouts, connection resets."""
    if isinstance(error, HttpResponseError) and error.status_code is not None:
        status = _status(error)
        return (
            _code(error) in _TRANSIENT_CODES
            or status in (408, 429)
            or (status >= 500 and status not in (501, 505))
        )
    return isinstance(error, (AzureError, *_TRANSPORT_ERRORS)) and not isinstance(
        error, ClientAuthenticationError
    )


def translate_error(error: BaseException, what: str) -> StorageError:
    """The storage layer's exception for an SDK error, naming the object, credentials masked."""
    if isinstance(error, HttpResponseError) and error.status_code is not None:
        status, code = _status(error), _code(error)
        text = redact(f"{what}: {code or status} {error.reason or ''}".strip())
        if status == 409 and code in _CONFLICT_CODES:
            return AlreadyExistsError(f"{what}: the object already exists (HTTP 409 {code})")
        if status == 412:
            return AlreadyExistsError(f"{what}: the object already exists (HTTP 412)")
        if status == 404 or isinstance(error, ResourceNotFoundError):
            return ObjectNotFoundError(text)
        if status in (401, 403):
            return PermissionDeniedError(text)
        return StorageError(text)
    if isinstance(error, ClientAuthenticationError):
        first = str(error).splitlines()[0] if str(error) else ""
        return PermissionDeniedError(
            redact(f"{what}: no Azure credentials could be used: {first[:300]}")
        )
    detail = " ".join(str(error).split())[:300]
    return StorageError(
        redact(f"{what}: still failing after retries: {type(error).__name__}: {detail}")
    )


@dataclass(kw_only=True)
class AzureOptions(BucketOptions):
    """Settings of an Azure Blob store; every field may come from ``storage_options``."""

    KIND: ClassVar[str] = "Azure"
    CREDENTIALS: ClassVar[str] = (
        "a connection string, an account key, a SAS token or a managed identity (storage "
        "options or AZURE_STORAGE_* variables)"
    )
    SECRETS: ClassVar[tuple[str, ...]] = SECRET_OPTIONS

    account_name: str | None = None
    account_key: str | None = field(default=None, repr=False)
    sas_token: str | None = field(default=None, repr=False)
    connection_string: str | None = field(default=None, repr=False)
    managed_identity_client_id: str | None = None
    block_size: int = 16 * MIB
    validate_content: bool = True
    """Send each block's and small blob's MD5, which Azure checks before storing it."""
    api_version: str | None = None
    """Pin the service version the SDK speaks (an emulator that knows only older ones)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise InvalidArgumentError(
                f"block_size must be between 1 byte and {MAX_BLOCK_SIZE >> 20} MiB (Azure's limit)"
            )


def block_size_for(number: int, base: int) -> int:
    """Size of block `number` (1-based) of an object whose first blocks are `base` bytes."""
    return min(MAX_BLOCK_SIZE, base << ((number - 1) // BLOCKS_PER_DOUBLING))


def block_id(token: str, number: int) -> str:
    """The base64 id of block `number` of the writer `token`: every id of a blob has the same
    length, as Azure requires, and names its writer."""
    return base64.b64encode(f"{token}-{number:06d}".encode("ascii")).decode("ascii")


class AzureWriter(ChunkedWriter):
    """One streamed object: a single Put Blob when small, else staged blocks and a block list."""

    def __init__(self, store: AzureStore, key: str, create_only: bool) -> None:
        self._store = store
        self._key = key
        self._create_only = create_only
        self._token = uuid.uuid4().hex
        self._chunk_limit = store.options.block_size
        self._buffer = bytearray()
        self._blocks: list[Future[str]] = []
        self._in_flight = BytesInFlight(store.options.block_size * store.options.max_concurrency)
        self._size = 0
        self._closed = False

    def _chunk_full(self) -> None:
        self._stage()

    def _stage(self) -> None:
        for future in self._blocks:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        if len(self._blocks) >= MAX_BLOCKS:
            raise StorageError(f"{self._key!r} has more blocks than Azure's {MAX_BLOCKS}")
        body, self._buffer = self._buffer, bytearray()
        number = len(self._blocks) + 1
        self._chunk_limit = block_size_for(number + 1, self._store.options.block_size)
        self._in_flight.acquire(len(body))
        try:
            future = self._store.pool.submit(self._stage_block, number, body)
        except BaseException:
            self._in_flight.release(len(body))
            raise
        self._blocks.append(future)

    def _stage_block(self, number: int, body: bytearray) -> str:
        try:
            name = block_id(self._token, number)
            self._store.stage_block(self._key, name, number, body)
            return name
        finally:
            self._in_flight.release(len(body))

    def commit(self) -> ObjectInfo:
        if self._closed:
            raise StorageError(f"commit of {self._key!r} after commit or abort")
        token = self._token if self._create_only else None
        try:
            if not self._blocks:
                body, self._buffer = self._buffer, bytearray()
                self._store.put_blob(self._key, bytes(body), token)
            else:
                if self._buffer:
                    self._stage()
                names = [future.result() for future in self._blocks]
                self._store.commit_blocks(self._key, names, token)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return ObjectInfo(self._key, self._size)

    def abort(self) -> None:
        """Stop staging and discard the staged blocks (`AzureStore.abort_upload`); blocks that
        cannot be discarded now (the service is unreachable, or a committed blob of the same
        name keeps them) are left to gc or to Azure's 7 days, with a warning."""
        if self._closed:
            return
        self._closed = True
        self._buffer = bytearray()
        for future in self._blocks:
            future.cancel()
        staged = False
        for future in self._blocks:
            if not future.cancelled():
                staged = True
                future.exception()  # waits; the error, if any, was already raised or is moot
        if not staged:
            return
        try:
            self._store.abort_upload(UploadInfo(self._key, UNCOMMITTED))
        except StorageError as error:
            log.warning(
                "%s: its staged blocks stay until `spotckpt gc` or Azure drops them (7 days): %s",
                self._store.where(self._key),
                error,
            )


class AzureStore(BucketStore[AzureOptions]):
    """A container prefix on Azure Blob Storage or Azurite."""

    SCHEME: ClassVar[str] = "az"
    # Every SDK error is translated without its cause: a transport error's text (and a
    # traceback's) can hold the request URL, which holds a SAS token's signature.
    SERVER_ERRORS: ClassVar[tuple[type[BaseException], ...]] = (AzureError, *_TRANSPORT_ERRORS)
    TRANSPORT_ERRORS: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(self, bucket: str, prefix: str, options: AzureOptions) -> None:
        super().__init__(bucket, prefix, options)
        self.service = _service_client(options)
        self.container: ContainerClient = self.service.get_container_client(bucket)

    @classmethod
    def from_uri(cls, uri: str, options: AzureOptions) -> AzureStore:
        """``az://container/prefix``; ``abfs[s]://container@account.dfs.core.windows.net/prefix``
        names the account too (an ``account_name`` option must then agree)."""
        parts = urlsplit(uri)
        if parts.scheme in ("abfs", "abfss") and "@" in parts.netloc and "?" not in uri:
            container, _, host = parts.netloc.partition("@")
            found = _ABFS_HOST.match(host)
            if not container or found is None:
                raise InvalidArgumentError(
                    f"Azure URI {parts.scheme}://{parts.netloc}{parts.path} must read "
                    f"{parts.scheme}://container@account.dfs.core.windows.net/prefix"
                )
            account = found["account"]
            if options.account_name not in (None, account):
                raise InvalidArgumentError(
                    f"the URI names the account {account!r} but the option account_name is "
                    f"{options.account_name!r}"
                )
            options.account_name = account
            return cls(container, parts.path, options)
        return super().from_uri(uri, options)

    def check_root(self) -> None:
        """Container names: 3-63 lowercase letters, digits and single hyphens (or $root)."""
        if not _CONTAINER.match(self.bucket):
            raise InvalidArgumentError(
                f"Azure container name {self.bucket!r} is not valid: 3-63 lowercase letters, "
                "digits and single hyphens, starting with a letter or digit"
            )
        if self.prefix and any(part in (".", "..") for part in self.prefix.split("/")):
            raise InvalidKeyError(f"Azure prefix {self.prefix!r} has a '.' or '..' segment")

    def is_transient(self, error: BaseException) -> bool:
        """See the module function `is_transient`."""
        return is_transient(error)

    def translate_error(self, error: BaseException, what: str) -> StorageError:
        """See the module function `translate_error`."""
        return translate_error(error, what)

    def blob(self, key: str) -> BlobClient:
        """The SDK's client for the blob of `key` (checked), sharing the store's connections."""
        return self.container.get_blob_client(self.full_name(key))

    # Writes ---------------------------------------------------------------------------------

    def open_writer(self, key: str, *, create_only: bool = False) -> AzureWriter:
        """Start a streamed write of `key`."""
        self.full_name(key)
        return AzureWriter(self, key, create_only)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        """Write a small object in one Put Blob; create-only raises AlreadyExistsError."""
        return self.put_blob(key, data, uuid.uuid4().hex if create_only else None)

    def put_blob(self, key: str, data: bytes, token: str | None) -> ObjectInfo:
        """One Put Blob; a `token` makes it create-only (see the module docstring)."""
        blob = self.blob(key)
        args: dict[str, Any] = {
            "overwrite": token is None,
            "validate_content": self.options.validate_content,
            "max_concurrency": 1,
        }
        if token is not None:
            args["metadata"] = {TOKEN_KEY: token}
        self._create(key, token, f"put {self.where(key)}", lambda: blob.upload_blob(data, **args))
        return ObjectInfo(key, len(data))

    def stage_block(self, key: str, name: str, number: int, body: bytearray) -> None:
        """One Put Block (retried alone)."""
        blob = self.blob(key)
        # the MD5 is computed over bytes; without it the buffer goes as it is, uncopied
        data: Any = bytes(body) if self.options.validate_content else body
        self.call(
            f"stage block {number} of {self.where(key)}",
            lambda: blob.stage_block(
                name, data, length=len(body), validate_content=self.options.validate_content
            ),
        )

    def commit_blocks(self, key: str, names: builtins.list[str], token: str | None) -> None:
        """Put Block List of the staged `names`; a `token` makes it create-only."""
        blob = self.blob(key)
        args: dict[str, Any] = {}
        if token is not None:
            args = {
                "metadata": {TOKEN_KEY: token},
                "match_condition": MatchConditions.IfMissing,  # If-None-Match: *
            }
        self._create(
            key,
            token,
            f"commit {len(names)} blocks of {self.where(key)}",
            lambda: blob.commit_block_list([BlobBlock(name) for name in names], **args),
        )

    def _create(self, key: str, token: str | None, what: str, request: Any) -> None:
        """Run a write; for a create-only one (`token`), a conflict with a blob holding our own
        token is our earlier attempt, whose answer was lost: the write is done."""
        try:
            self.call(what, request)
        except AlreadyExistsError:
            if token is None or not self.written_by(key, token):
                raise

    def written_by(self, key: str, token: str) -> bool:
        """Whether the blob now under `key` was committed by the create-only writer `token`."""
        blob = self.blob(key)
        try:
            found = self.call(f"head {self.where(key)}", blob.get_blob_properties)
        except ObjectNotFoundError:
            return False
        return (found.metadata or {}).get(TOKEN_KEY) == token

    # Reads ----------------------------------------------------------------------------------

    def _get_blob(self, key: str, byte_range: str | None) -> Any:
        """The HTTP response of one Get Blob (of `byte_range` if given), its body unread; None
        when the range starts at or past the object's end (416)."""
        blob = self.blob(key)
        try:
            pipeline = blob._client.blob.download(  # the SDK's generated Get Blob operation
                range=byte_range, cls=lambda response, _body, _headers: response
            )
        except HttpResponseError as error:
            if byte_range is not None and _status(error) == 416:
                return None
            raise
        return pipeline.http_response.internal_response  # requests.Response, body not read

    def _download(self, key: str, deadline: Deadline, first: int, last: int | None) -> bytes:
        """One Get Blob, its body read before the operation's deadline."""
        response = self._get_blob(key, None if last is None else f"bytes={first}-{last}")
        if response is None:
            return b""
        with response:
            expected = int(response.headers.get("Content-Length", -1))
            return read_body(response.raw, deadline, self.options.read_timeout_s, expected)

    def _download_into(
        self, key: str, deadline: Deadline, start: int, views: Sequence[memoryview]
    ) -> int:
        """One ranged Get Blob, its body read into `views` before the deadline."""
        last = start + sum(view.nbytes for view in views) - 1
        response = self._get_blob(key, f"bytes={start}-{last}")
        if response is None:
            return 0
        with response:
            return read_body_into(response.raw, deadline, self.options.read_timeout_s, views)

    def head(self, key: str) -> ObjectInfo | None:
        """Get Blob Properties' size and time, or None when the blob does not exist."""
        blob = self.blob(key)
        try:
            found = self.call(f"head {self.where(key)}", blob.get_blob_properties)
        except ObjectNotFoundError:
            return None
        return ObjectInfo(key, int(found.size), found.last_modified)

    def _list_page(self, full_prefix: str, delimiter: str | None, token: str | None) -> Page:
        """One List Blobs page; a delimiter the server refuses raises DelimiterNotHonouredError."""
        size = self.options.list_page_size
        pages: Any
        if delimiter is None:
            pages = self.container.list_blobs(
                name_starts_with=full_prefix, results_per_page=size
            ).by_page(continuation_token=token)
        else:
            pages = self.container.walk_blobs(
                name_starts_with=full_prefix, delimiter=delimiter, results_per_page=size
            ).by_page(continuation_token=token)
        try:
            items = list(next(pages))
        except StopIteration:
            return [], [], None
        except HttpResponseError as error:
            if delimiter is not None and (
                _code(error) in _DELIMITER_REFUSED_CODES or _status(error) == 501
            ):
                raise DelimiterNotHonouredError(f"it answered {_code(error)}") from None
            raise
        objects: list[ObjectInfo] = []
        common: list[str] = []
        for item in items:
            if hasattr(item, "size"):
                objects.append(
                    ObjectInfo(self.relative(item.name), int(item.size), item.last_modified)
                )
            else:  # a BlobPrefix: the common prefix of a delimited listing
                common.append(self.relative(item.name))
        return objects, common, pages.continuation_token or None

    # Deletes and staged blocks --------------------------------------------------------------

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete Blob for each key (with its snapshots), in parallel; missing ones are ignored."""
        names = [self.full_name(k) for k in keys]
        for _ in self.pool.map(self._delete, names):
            pass

    def _delete(self, name: str) -> None:
        blob = self.container.get_blob_client(name)
        try:
            self.call(
                f"delete {self.uri}/{self.relative(name)}",
                lambda: blob.delete_blob(delete_snapshots="include"),
            )
        except ObjectNotFoundError:
            return

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """The blobs under `prefix` that have staged blocks and no committed version (an
        aborted or crashed writer's), each with when it last received a block."""
        full_prefix = self.full_prefix(prefix)

        def listed() -> builtins.list[UploadInfo]:
            # A listing names a blob that has only staged blocks when asked to include
            # uncommitted blobs, and never otherwise; neither Azure nor Azurite marks it.
            committed = {item.name for item in self.container.list_blobs(full_prefix)}
            return [
                UploadInfo(self.relative(item.name), UNCOMMITTED, None, item.last_modified)
                for item in self.container.list_blobs(full_prefix, include=["uncommittedblobs"])
                if item.name not in committed
            ]

        return self.call(f"list staged blocks under {self.uri}/{prefix}", listed)

    def abort_upload(self, upload: UploadInfo) -> None:
        """Discard a blob's staged blocks: an empty create-only Put Block List (which drops them)
        then a Delete Blob of that empty version only. A blob committed meanwhile dropped them
        itself and is left alone."""
        blob = self.blob(upload.key)
        what = f"discard staged blocks of {self.where(upload.key)}"
        try:
            done = self.call(
                what,
                lambda: blob.commit_block_list([], match_condition=MatchConditions.IfMissing),
            )
        except AlreadyExistsError:
            return
        try:
            self.call(
                what,
                lambda: blob.delete_blob(
                    etag=str(done["etag"]), match_condition=MatchConditions.IfNotModified
                ),
            )
        except (ObjectNotFoundError, AlreadyExistsError):
            return  # gone, or rewritten since: not ours to delete

    def close(self) -> None:
        """Wait for running uploads, then release the thread pool and connections."""
        super().close()
        self.service.close()


def _service_client(options: AzureOptions) -> BlobServiceClient:
    """The SDK client: credentials as the module docstring orders them, SDK retries off."""
    settings: dict[str, Any] = {
        "retry_total": 0,
        "connection_timeout": min(options.connect_timeout_s, options.retry.deadline_s),
        "read_timeout": min(options.read_timeout_s, options.retry.deadline_s),
        "max_single_put_size": max(options.block_size, 64 * MIB),
        "connection_data_block_size": 1 * MIB,
    }
    if options.api_version:
        settings["api_version"] = options.api_version
    connection_string = options.connection_string or os.environ.get(
        "AZURE_STORAGE_CONNECTION_STRING"
    )
    if connection_string:
        try:
            return BlobServiceClient.from_connection_string(connection_string, **settings)
        except ValueError:
            raise InvalidArgumentError(
                "the Azure connection string is malformed (it is not shown: it holds the key)"
            ) from None
    account = options.account_name or os.environ.get("AZURE_STORAGE_ACCOUNT")
    endpoint = options.endpoint_url or os.environ.get("AZURE_STORAGE_BLOB_ENDPOINT")
    if account is None and endpoint:
        account = _account_of(endpoint)
    if endpoint is None:
        if not account:
            raise InvalidArgumentError(
                "an Azure store needs its account: the option account_name, AZURE_STORAGE_ACCOUNT, "
                "an abfs://container@account.dfs.core.windows.net URI, an endpoint_url or a "
                "connection string"
            )
        endpoint = f"https://{account}.blob.core.windows.net"
    key = options.account_key or os.environ.get("AZURE_STORAGE_KEY")
    sas = options.sas_token or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
    credential: Any
    if key:
        if not account:
            raise InvalidArgumentError("an Azure account key needs the account_name")
        credential = AzureNamedKeyCredential(account, key)
    elif sas:
        credential = AzureSasCredential(sas.lstrip("?"))
    else:
        from azure.identity import DefaultAzureCredential  # loads only without a key or SAS

        credential = DefaultAzureCredential(
            managed_identity_client_id=options.managed_identity_client_id
        )
    return BlobServiceClient(endpoint, credential=credential, **settings)


def _account_of(endpoint: str) -> str | None:
    """The account an endpoint names: Azurite's ``http://host:port/account`` or
    ``https://account.blob.core.windows.net``."""
    parts = urlsplit(endpoint)
    path = parts.path.strip("/")
    if path:
        return path.split("/")[0]
    host = parts.hostname or ""
    return host.split(".")[0] if "." in host and not host[0].isdigit() else None


def open_azure_store(uri: str, options: dict[str, Any]) -> AzureStore:
    """Factory for ``az://container/prefix`` and the ``abfs[s]://`` spellings; see
    `AzureOptions` for the options."""
    return AzureStore.from_uri(uri, AzureOptions.from_options(options))
