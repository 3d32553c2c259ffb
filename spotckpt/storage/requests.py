"""Counting what a store asked of its service: requests by billing class, bytes by direction.

Object stores bill per request, in classes (S3: PUT, COPY, POST and LIST at one price; GET, HEAD
and the rest at about a twelfth of it; DELETE free) and per byte stored. Every request of a
bucket store runs through `spotckpt.storage.bucket.BucketStore.call`, which counts each attempt
(a retried or throttled request is billed again) here, classed by the operation it serves:

- ``write``: put, start / upload part / complete of a multipart or resumable upload, list;
- ``read``: get (whole or ranged), head;
- ``delete``: deletes and aborted uploads (free on S3, GCS and Azure).

Bytes are object data that went over the wire: ``sent`` by puts and parts that succeeded,
``received`` by reads. `RequestCounter.tally` is a snapshot; the difference of two
(`RequestTally.minus`) is what one save, restore, gc or drain cost.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

CLASSES = ("write", "read", "delete")
_CLASS_OF_VERB = {
    "put": "write",
    "start": "write",
    "upload": "write",
    "complete": "write",
    "list": "write",
    "get": "read",
    "head": "read",
    "delete": "delete",
    "abort": "delete",
    "cancel": "delete",
}


def request_class(what: str) -> str:
    """The billing class of the operation named `what` (its first word: "put ...", "get ...");
    an operation not known here counts as a write, the dearer class."""
    return _CLASS_OF_VERB.get(what.split(" ", 1)[0], "write")


@dataclass(frozen=True)
class RequestTally:
    """Requests by class and object bytes by direction, at one moment or between two."""

    write: int = 0
    read: int = 0
    delete: int = 0
    sent: int = 0
    received: int = 0

    @property
    def requests(self) -> int:
        """All requests."""
        return self.write + self.read + self.delete

    def minus(self, earlier: RequestTally) -> RequestTally:
        """What was counted since `earlier`."""
        return RequestTally(
            self.write - earlier.write,
            self.read - earlier.read,
            self.delete - earlier.delete,
            self.sent - earlier.sent,
            self.received - earlier.received,
        )

    def plus(self, other: RequestTally) -> RequestTally:
        """Both tallies together."""
        return RequestTally(
            self.write + other.write,
            self.read + other.read,
            self.delete + other.delete,
            self.sent + other.sent,
            self.received + other.received,
        )

    def to_dict(self) -> dict[str, int]:
        """For events and ``--json``: requests by class, and bytes."""
        return {
            "write_requests": self.write,
            "read_requests": self.read,
            "delete_requests": self.delete,
            "bytes_sent": self.sent,
            "bytes_received": self.received,
        }

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> RequestTally:
        """The inverse of `to_dict` (missing fields count zero)."""
        return cls(
            int(document.get("write_requests", 0)),
            int(document.get("read_requests", 0)),
            int(document.get("delete_requests", 0)),
            int(document.get("bytes_sent", 0)),
            int(document.get("bytes_received", 0)),
        )


class RequestCounter:
    """A store's running counts; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(CLASSES, 0)
        self.sent = 0
        self.received = 0

    def request(self, what: str) -> None:
        """One attempt of the operation `what`."""
        kind = request_class(what)
        with self.lock:
            self.counts[kind] += 1

    def add_sent(self, size: int) -> None:
        """Object bytes that an attempt delivered (a refused one sends none: S3 clients wait for
        ``100 Continue`` before a large body)."""
        with self.lock:
            self.sent += size

    def add_received(self, size: int) -> None:
        """Object bytes that arrived."""
        with self.lock:
            self.received += size

    def tally(self) -> RequestTally:
        """A snapshot of the counts."""
        with self.lock:
            return RequestTally(
                self.counts["write"],
                self.counts["read"],
                self.counts["delete"],
                self.sent,
                self.received,
            )


def store_tally(store: object) -> RequestTally | None:
    """The counts of `store` if it keeps them (a bucket store does; local and memory do not)."""
    counter = getattr(store, "requests", None)
    return counter.tally() if isinstance(counter, RequestCounter) else None
