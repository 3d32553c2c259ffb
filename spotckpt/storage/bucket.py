"""What the HTTP object stores (S3, GCS, and the next one) share, so each keeps only its API.

A bucket store is a prefix inside a bucket, opened from ``scheme://bucket/prefix``. Like fsspec's
``AbstractFileSystem``, `BucketStore` derives most of the `ObjectStore` protocol from a few
primitives that a service implements with its SDK:

- `BucketStore._list_page`: one page of a listing, with or without a delimiter;
- `BucketStore._download` and `BucketStore._download_into`: one attempt at a read;
- `BucketStore.is_transient` and `BucketStore.translate_error`: which of the SDK's errors are
  worth retrying, and what the storage layer calls the others;
- `BucketStore.check_root`: which bucket names (and prefixes) the service accepts.

From them it makes ``get``, ``get_range``, ``get_range_into`` (and its scatter form,
``get_range_into_views``), ``exists``, ``list``,
``list_delimited`` (with the fallback of `DelimiterSupport` for servers that mishandle a
delimiter) and ``close``; every request runs through `BucketStore.call`, under the options'
`RetryPolicy`. A service adds its writer, ``put``, ``head``, ``delete_many``, ``list_uploads`` and
``abort_upload``, which differ too much between APIs to share.

Settings are a `BucketOptions` dataclass: the fields every service has, its own added by a
subclass; `BucketOptions.from_options` builds one from ``storage_options``, whose values may be
strings (from the command line or a config file).

URIs name a bucket and a prefix and nothing else: credentials, a query or a fragment in one are
refused with `InvalidArgumentError` (credentials belong to the service's own chain, settings to
the options; a dropped query would silently change the prefix).

A store pickles as what rebuilds it: bucket, prefix and options. Options that are credentials
(`BucketOptions.SECRETS`) cross only inside `ProcessSecrets`, through multiprocessing's pipes,
never into a file.
"""

from __future__ import annotations

import abc
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar
from urllib.parse import urlsplit

from typing_extensions import Self

from spotckpt.errors import InvalidArgumentError, StorageError
from spotckpt.storage.base import (
    DelimiterSupport,
    Listing,
    ListingPages,
    ObjectInfo,
    ProcessSecrets,
    check_key,
)
from spotckpt.storage.requests import RequestCounter
from spotckpt.storage.retry import Deadline, RetryPolicy
from spotckpt.storage.throttle import Throttle

T = TypeVar("T")
Page: TypeAlias = tuple[list[ObjectInfo], list[str], str | None]
"""One listing page: its objects and common prefixes (keys relative to the root), next token."""


@dataclass(kw_only=True)
class BucketOptions:
    """Settings every bucket store has; a service's options subclass this and add their own."""

    KIND: ClassVar[str] = "bucket"
    """The service's name in messages ("S3", "GCS")."""
    CREDENTIALS: ClassVar[str] = "the service's own credential chain"
    """Where credentials come from, for the message that refuses them in a URI."""
    SECRETS: ClassVar[tuple[str, ...]] = ()
    """Fields that hold credentials: never repr'd, pickled only into a multiprocessing pipe."""

    endpoint_url: str | None = None
    max_concurrency: int = 8
    list_page_size: int = 1000
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if not 1 <= self.max_concurrency <= 256:
            raise InvalidArgumentError("max_concurrency must be between 1 and 256")
        if not 1 <= self.list_page_size <= 1000:
            raise InvalidArgumentError("list_page_size must be between 1 and 1000")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """Build from a dict, converting strings (from a CLI or env) to each field's type."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise InvalidArgumentError(
                f"unknown {cls.KIND} storage options {unknown}; known: {sorted(known)}"
            )
        return cls(**{k: _coerce(v, known[k].type) for k, v in options.items()})


def _coerce(value: Any, annotation: Any) -> Any:
    """A string `value` as the type of the field annotated `annotation` (``X | None`` as ``X``);
    anything else, and strings for other types, as it is."""
    if not isinstance(value, str):
        return value
    kind = str(annotation).removesuffix(" | None")
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        return value.strip().lower() in ("1", "true", "yes", "on")
    return value


OptionsT = TypeVar("OptionsT", bound=BucketOptions)


class BucketStore(abc.ABC, Generic[OptionsT]):
    """A bucket prefix on an HTTP object store; see the module docstring for what a service adds.

    Thread-safe as the protocol requires: the SDK clients are, and the thread pool (of
    ``max_concurrency`` threads, for parallel uploads or deletes) is.
    """

    SCHEME: ClassVar[str]
    """The scheme of `uri`, the root as this store names it."""
    SERVER_ERRORS: ClassVar[tuple[type[BaseException], ...]]
    """The SDK's errors for a server's answer: translated without the SDK error as their cause,
    whose text can carry the request URL (a credential, for a GCS upload session)."""
    TRANSPORT_ERRORS: ClassVar[tuple[type[BaseException], ...]]
    """Connection, timeout and authentication failures: translated, keeping their cause."""

    def __init__(self, bucket: str, prefix: str, options: OptionsT) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.check_root()
        self.options = options
        self.pool = ThreadPoolExecutor(
            options.max_concurrency, thread_name_prefix=f"spotckpt-{options.KIND.lower()}"
        )
        self._delimiters = DelimiterSupport()
        self.throttle = Throttle(options.max_concurrency)
        self.requests = RequestCounter()

    @classmethod
    def from_uri(cls, uri: str, options: OptionsT) -> Self:
        """The store for ``scheme://bucket/prefix``; see the module docstring for what a URI
        may not carry."""
        parts = urlsplit(uri)
        kind = options.KIND
        if parts.username or parts.password or "@" in parts.netloc:
            raise InvalidArgumentError(
                f"{kind} URI must not carry credentials; use {options.CREDENTIALS}"
            )
        shown = f"{parts.scheme}://{parts.netloc}{parts.path}"  # never a query: it may hold a token
        if "?" in uri or "#" in uri:
            raise InvalidArgumentError(
                f"{kind} URI {shown} must not have a query or fragment; settings go in the "
                "storage options"
            )
        if not parts.netloc:
            raise InvalidArgumentError(
                f"{kind} URI {shown!r} has no bucket; use {parts.scheme}://bucket/prefix"
            )
        return cls(parts.netloc, parts.path, options)

    @abc.abstractmethod
    def check_root(self) -> None:
        """Refuse a `bucket` (InvalidArgumentError) or `prefix` (InvalidKeyError) that the
        service would not take."""

    # Keys -----------------------------------------------------------------------------------

    @property
    def uri(self) -> str:
        """The root as ``scheme://bucket/prefix``."""
        return f"{self.SCHEME}://{self.bucket}/{self.prefix}".rstrip("/")

    def full_name(self, key: str) -> str:
        """The object name in the bucket for a key relative to the root (checked)."""
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def full_prefix(self, prefix: str) -> str:
        """The name prefix in the bucket for a key prefix relative to the root."""
        if prefix:
            return self.full_name(prefix)
        return f"{self.prefix}/" if self.prefix else ""

    def relative(self, name: str) -> str:
        """The key relative to the root of an object name in the bucket."""
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def where(self, key: str) -> str:
        """The object's URL, for messages."""
        return f"{self.uri}/{key}"

    # Requests -------------------------------------------------------------------------------

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        transient: Callable[[BaseException], bool] | None = None,
        deadline: Deadline | None = None,
        *,
        sent: int = 0,
    ) -> T:
        """Run one request under the retry policy (retrying the errors `transient` accepts,
        `is_transient` by default) and the store's `Throttle`; each attempt is counted in
        `requests` (`sent`: the object bytes it carries); errors leave it as the storage
        layer's."""
        deadline = deadline or self.options.retry.deadline(what)

        def attempt() -> T:
            self.requests.request(what)
            result = fn()
            if sent:
                self.requests.add_sent(sent)
            return result

        def throttled() -> T:
            return self.throttle.run(attempt, self.is_throttle, deadline)

        try:
            return self.options.retry.call(
                throttled, transient or self.is_transient, what, deadline
            )
        except StorageError:
            raise
        except self.SERVER_ERRORS as error:
            raise self.translate_error(error, what) from None
        except self.TRANSPORT_ERRORS as error:
            raise self.translate_error(error, what) from error

    @abc.abstractmethod
    def is_transient(self, error: BaseException) -> bool:
        """Whether an error of the SDK is worth retrying (throttling, 5xx, timeouts, resets)."""

    def is_throttle(self, error: BaseException) -> bool:
        """Whether an error of the SDK says the service is asked too fast (S3's SlowDown): the
        `Throttle` backs off and lowers the concurrency. None by default."""
        return False

    def is_transient_read(self, error: BaseException) -> bool:
        """Whether an error of a whole-object read is worth retrying; a service that checks the
        bytes it reads adds their damage in transit to `is_transient`."""
        return self.is_transient(error)

    @abc.abstractmethod
    def translate_error(self, error: BaseException, what: str) -> StorageError:
        """The storage layer's exception for one of `SERVER_ERRORS` or `TRANSPORT_ERRORS` that
        retrying did not cure, naming the operation `what`."""

    # Reads ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def _download(self, key: str, deadline: Deadline, first: int, last: int | None) -> bytes:
        """One read of bytes `first`..`last` (None: the whole object), deadline-bound; empty
        when the range starts at or past the object's end."""

    @abc.abstractmethod
    def _download_into(
        self, key: str, deadline: Deadline, start: int, views: Sequence[memoryview]
    ) -> int:
        """One read of the bytes from `start` on into `views` in turn (as many as they hold
        together), deadline-bound; returns how many arrived."""

    def get(self, key: str) -> bytes:
        """Read a whole object; raises ObjectNotFoundError."""
        self.full_name(key)
        what = f"get {self.where(key)}"
        deadline = self.options.retry.deadline(what)
        return self.call(
            what,
            lambda: self._received(self._download(key, deadline, 0, None)),
            self.is_transient_read,
            deadline,
        )

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read `length` bytes from `start`; short or empty past the end of the object."""
        if start < 0 or length < 0:
            raise InvalidArgumentError("range start and length must be non-negative")
        self.full_name(key)
        if length == 0:
            return b""
        last = start + length - 1
        what = f"get bytes {start}-{last} of {self.where(key)}"
        deadline = self.options.retry.deadline(what)
        return self.call(
            what,
            lambda: self._received(self._download(key, deadline, start, last)),
            deadline=deadline,
        )

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        """Read ``buffer.nbytes`` bytes from `start` into `buffer`; fewer past the object's end."""
        return self.get_range_into_views(key, start, (buffer,))

    def get_range_into_views(self, key: str, start: int, views: Sequence[memoryview]) -> int:
        """Read the bytes from `start` on into `views` in turn, in one ranged request (see
        `spotckpt.storage.base.ScatterReads`); fewer past the object's end."""
        if start < 0:
            raise InvalidArgumentError("range start must be non-negative")
        self.full_name(key)
        length = sum(view.nbytes for view in views)
        if length == 0:
            return 0
        what = f"get bytes {start}-{start + length - 1} of {self.where(key)}"
        deadline = self.options.retry.deadline(what)
        return self.call(
            what,
            lambda: self._received_count(self._download_into(key, deadline, start, views)),
            deadline=deadline,
        )

    def _received(self, data: bytes) -> bytes:
        self.requests.add_received(len(data))
        return data

    def _received_count(self, size: int) -> int:
        self.requests.add_received(size)
        return size

    def exists(self, key: str) -> bool:
        """Whether the object exists."""
        return self.head(key) is not None

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and time, or None when it does not exist."""

    # Listings -------------------------------------------------------------------------------

    @abc.abstractmethod
    def _list_page(self, full_prefix: str, delimiter: str | None, token: str | None) -> Page:
        """One page of the names under `full_prefix`, from `token` (None: the first page); with
        a `delimiter`, raises DelimiterNotHonouredError when the server refuses it."""

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order, page after page."""
        full_prefix = self.full_prefix(prefix)
        token: str | None = None
        while True:
            objects, _, token = self.call(
                f"list {self.uri}/{prefix}",
                functools.partial(self._list_page, full_prefix, None, token),
            )
            yield from objects
            if not token:
                return

    def list_delimited(self, prefix: str, delimiter: str) -> Listing:
        """The server's delimited listing, page after page (each retried); a server that refuses
        the delimiter or answers against the rules is listed in full and rolled up here."""
        full_prefix = self.full_prefix(prefix)
        return self._delimiters.listing(
            self.uri,
            prefix,
            delimiter,
            native=functools.partial(self._list_delimited, prefix, full_prefix, delimiter),
            full=functools.partial(self.list, prefix),
        )

    def _list_delimited(self, prefix: str, full_prefix: str, delimiter: str) -> Listing:
        pages = ListingPages(prefix, delimiter)
        token: str | None = None
        while True:
            objects, common, token = self.call(
                f"list {self.uri}/{prefix} by {delimiter!r}",
                functools.partial(self._list_page, full_prefix, delimiter, token),
            )
            pages.add(objects, common, token)
            if not token:
                return pages.listing()

    # Life cycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for running uploads, then release the thread pool (a service: its client too)."""
        self.pool.shutdown(wait=True)

    def portable_options(self) -> OptionsT:
        """The options another process rebuilds this store with; a service may pin what it
        resolved here (an endpoint, say), so that the copy does not resolve it anew."""
        return self.options

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as bucket, prefix and options; credentials cross a multiprocessing pipe only."""
        options = self.portable_options()
        found = {name: getattr(options, name) for name in options.SECRETS}
        secrets = {name: value for name, value in found.items() if value is not None}
        cleared: dict[str, Any] = dict.fromkeys(options.SECRETS)
        public = replace(options, **cleared)
        carried = ProcessSecrets(secrets) if secrets else None
        return reopen_bucket_store, (type(self), self.bucket, self.prefix, public, carried)


def reopen_bucket_store(
    cls: type[BucketStore[OptionsT]],
    bucket: str,
    prefix: str,
    options: OptionsT,
    secrets: ProcessSecrets | None,
) -> BucketStore[OptionsT]:
    """Rebuild a pickled bucket store in this process (see `BucketStore.__reduce__`)."""
    if secrets is not None:
        values: dict[str, Any] = secrets.values
        options = replace(options, **values)
    return cls(bucket, prefix, options)


class BytesInFlight:
    """Bounds the bytes of parts (S3) or blocks (Azure) being uploaded, so a writer's memory does
    not grow with the object; a part larger than the budget goes alone."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.condition = threading.Condition()

    def acquire(self, size: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.used == 0 or self.used + size <= self.budget)
            self.used += size

    def release(self, size: int) -> None:
        with self.condition:
            self.used -= size
            self.condition.notify_all()
