"""GCS back end: what the shared contract cannot show, against gcp-storage-emulator on loopback.

The emulator ignores ``ifGenerationMatch``, never paginates a listing, cannot cancel a resumable
session and never fails. `GCSFront`, a small HTTP proxy on loopback in front of it, records every
request and adds those behaviours the way GCS has them: it answers 412 to a create-only upload
whose object exists, pages listings, answers a cancelled session with 499, and injects faults
(429/503 answers, answers lost after the server acted).

Create-only is also tried on servers that check ``ifGenerationMatch`` themselves, with no proxy
in between: fake-gcs-server (`fake_gcs`) refuses a second single-request upload, so racing
writers and two jobs committing the same step are seen to commit exactly one manifest; the same
tests are expected to fail on the emulator, which overwrites.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import re
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, urlencode, urlsplit

import pytest

from spotckpt.layout import manifest_key
from spotckpt.storage import (
    AlreadyExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    PermissionDeniedError,
    RetryPolicy,
    StorageError,
    open_store,
)
from spotckpt.storage.gcs import GCSOptions, GCSStore, _ChunkStream, is_transient

from fake_gcs import IGNORES_RESUMABLE_PRECONDITIONS
from gcs_emulator import admin_client, create_bucket

KIB = 1 << 10
MIB = 1 << 20
CHUNK = 256 * KIB
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)


@dataclass
class Seen:
    """One request as the front received it."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    @property
    def content_range(self) -> str:
        """The Content-Range header, or an empty string."""
        return self.headers.get("content-range", "")

    @property
    def is_upload(self) -> bool:
        """Whether this request carries object bytes (or a status query) to an upload URL."""
        return self.path.startswith("/upload/")


@dataclass
class Reply:
    """Answer with this status without forwarding (``lose=True``: forward first, then answer)."""

    status: int
    lose: bool = False


Rule = Callable[[Seen], Reply | None]


def once(predicate: Callable[[Seen], bool], reply: Reply) -> Rule:
    """A rule that fires on the first request matching `predicate`, then never again."""
    fired = threading.Event()

    def rule(seen: Seen) -> Reply | None:
        if not fired.is_set() and predicate(seen):
            fired.set()
            return reply
        return None

    return rule


_FINAL_RANGE = re.compile(r"^bytes (\d+-\d+|\*)/(\d+)$")


@dataclass
class GCSFront:
    """A recording, faulting HTTP proxy in front of the emulator; see the module docstring."""

    upstream: str
    preconditions: str = "finish"  # "finish": checked on the last request; "start": also first
    finished_session_answer: int = 200  # GCS: 200 with the object; the emulator: 404
    rules: list[Rule] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sessions: dict[str, tuple[str, str, bool]] = field(default_factory=dict)
    _finished: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        front = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                url = urlsplit(self.path)
                seen = Seen(
                    self.command,
                    url.path,
                    parse_qs(url.query),
                    {k.lower(): v for k, v in self.headers.items()},
                    body,
                )
                status, headers, payload = front.handle(seen, self.path)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The front's URL."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()

    def uploads(self) -> list[Seen]:
        """Requests to upload URLs, in order."""
        return [s for s in self.seen if s.is_upload]

    # Behaviour ---------------------------------------------------------------------------

    def handle(self, seen: Seen, raw_path: str) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            self.seen.append(seen)
        for rule in self.rules:
            reply = rule(seen)
            if reply is not None:
                if reply.lose:
                    self._route(seen, raw_path)
                return reply.status, {}, b'{"error": {"message": "injected"}}'
        return self._route(seen, raw_path)

    def _route(self, seen: Seen, raw_path: str) -> tuple[int, dict[str, str], bytes]:
        upload_id = seen.query.get("upload_id", [""])[0]
        if seen.method == "DELETE" and upload_id:
            self._sessions.pop(upload_id, None)
            return 499, {}, b""  # how GCS answers a cancelled session
        if seen.method == "PUT" and upload_id in self._finished:
            if self.finished_session_answer == 200:
                return 200, {"Content-Type": "application/json"}, self._finished[upload_id]
            return self.finished_session_answer, {}, b""
        if seen.method == "GET" and re.fullmatch(r"/storage/v1/b/[^/]+/o", seen.path):
            return self._list_page(seen)
        if seen.is_upload and seen.method in ("POST", "PUT"):
            return self._upload(seen, raw_path, upload_id)
        return self._forward(seen, raw_path)

    def _upload(
        self, seen: Seen, raw_path: str, upload_id: str
    ) -> tuple[int, dict[str, str], bytes]:
        create_only = seen.query.get("ifGenerationMatch") == ["0"]
        bucket = seen.path.split("/")[5]
        if seen.method == "POST" and seen.query.get("uploadType") == ["resumable"]:
            name = json.loads(seen.body)["name"]
            if create_only and self.preconditions == "start" and self._exists(bucket, name):
                return _precondition_failed()
            status, headers, payload = self._forward(seen, raw_path)
            session = parse_qs(urlsplit(headers.get("Location", "")).query)["upload_id"][0]
            self._sessions[session] = (bucket, name, create_only)
            return status, headers, payload
        if upload_id:
            bucket, name, create_only = self._sessions[upload_id]
            if not _FINAL_RANGE.match(seen.content_range):
                return self._forward(seen, raw_path)
        else:  # a single-request (multipart) upload: the name is in its JSON part
            match = re.search(rb'"name":\s*"([^"]+)"', seen.body)
            name = match.group(1).decode() if match else seen.query["name"][0]
        with self._lock:  # check and create as one step, as GCS does
            if create_only and self._exists(bucket, name):
                return _precondition_failed()
            status, headers, payload = self._forward(seen, raw_path)
        if upload_id and status == 200:
            self._finished[upload_id] = payload
        return status, headers, payload

    def _exists(self, bucket: str, name: str) -> bool:
        connection = http.client.HTTPConnection(urlsplit(self.upstream).netloc, timeout=30)
        try:
            connection.request("GET", f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}")
            return connection.getresponse().status == 200
        finally:
            connection.close()

    def _list_page(self, seen: Seen) -> tuple[int, dict[str, str], bytes]:
        """Forward a listing whole, then cut out the page asked for (the emulator never pages)."""
        query = {k: v for k, v in seen.query.items() if k not in ("maxResults", "pageToken")}
        path = f"{seen.path}?{urlencode(query, doseq=True)}"
        status, headers, payload = self._forward(seen, path)
        if status != 200:
            return status, headers, payload
        listing = json.loads(payload)
        items = listing.get("items", [])
        start = int(seen.query.get("pageToken", ["0"])[0])
        size = int(seen.query.get("maxResults", [str(len(items) or 1)])[0])
        listing["items"] = items[start : start + size]
        if start + size < len(items):
            listing["nextPageToken"] = str(start + size)
        return status, {"Content-Type": "application/json"}, json.dumps(listing).encode()

    def _forward(self, seen: Seen, path: str) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection(urlsplit(self.upstream).netloc, timeout=60)
        try:
            headers = {k: v for k, v in seen.headers.items() if k not in ("connection",)}
            connection.request(seen.method, path, body=seen.body or None, headers=headers)
            response = connection.getresponse()
            payload = response.read()
            kept = ("content-type", "location", "range", "x-goog-hash", "content-range")
            out = {k: v for k, v in response.getheaders() if k.lower() in kept}
            return response.status, out, payload
        finally:
            connection.close()


def _precondition_failed() -> tuple[int, dict[str, str], bytes]:
    body = {"error": {"code": 412, "message": "At least one of the pre-conditions you specified "
                      "did not hold.", "errors": [{"reason": "conditionNotMet"}]}}  # fmt: skip
    return 412, {"Content-Type": "application/json"}, json.dumps(body).encode()


@pytest.fixture
def front(gcs_endpoint: str) -> Iterator[GCSFront]:
    proxy = GCSFront(gcs_endpoint)
    yield proxy
    proxy.close()


@pytest.fixture
def bucket(gcs_endpoint: str) -> str:
    return create_bucket(gcs_endpoint)


@pytest.fixture(autouse=True)
def _no_emulator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)


def _open(endpoint: str, bucket: str, **options: Any) -> GCSStore:
    options = {"chunk_size": CHUNK, "retry": FAST_RETRY, "anonymous": True, **options}
    store = open_store(f"gs://{bucket}/runs/exp1", endpoint_url=endpoint, **options)
    assert isinstance(store, GCSStore)
    return store


def _data(size: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(size))


def _write_streamed(store: GCSStore, key: str, data: bytes, create_only: bool = False) -> None:
    writer = store.open_writer(key, create_only=create_only)
    with writer:
        for start in range(0, len(data), 100 * KIB + 3):
            writer.write(data[start : start + 100 * KIB + 3])


# Create-only ----------------------------------------------------------------------------------

SHAPES = {
    "put": lambda store, key, data: store.put(key, data, create_only=True),
    "streamed-small": lambda store, key, data: _write_streamed(store, key, data[:1000], True),
    "streamed-resumable": lambda store, key, data: _write_streamed(store, key, data, True),
}


@pytest.mark.parametrize("checked_at", ["finish", "start"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_create_only_sends_if_generation_match_and_412_means_already_committed(
    front: GCSFront, bucket: str, shape: str, checked_at: str
) -> None:
    front.preconditions = checked_at
    store = _open(front.endpoint, bucket)
    write = SHAPES[shape]
    first, second = _data(3 * CHUNK + 17, seed=1), _data(3 * CHUNK + 17, seed=2)
    try:
        write(store, "step-000000001/manifest.json", first)
        with pytest.raises(AlreadyExistsError) as caught:
            write(store, "step-000000001/manifest.json", second)
        expected = first[:1000] if shape == "streamed-small" else first
        assert store.get("step-000000001/manifest.json") == expected
    finally:
        store.close()
    message = str(caught.value)
    assert "already exists" in message and "already committed" in message
    assert f"gs://{bucket}/runs/exp1/step-000000001/manifest.json" in message
    starts = [s for s in front.uploads() if s.method == "POST"]
    assert len(starts) == 2  # one upload (single request or session start) per attempt
    assert all(s.query.get("ifGenerationMatch") == ["0"] for s in starts)
    assert [s.query.get("uploadType") for s in starts] == [
        ["resumable" if shape == "streamed-resumable" else "multipart"]
    ] * 2


def test_plain_writes_send_no_precondition_and_overwrite(front: GCSFront, bucket: str) -> None:
    store = _open(front.endpoint, bucket)
    try:
        store.put("latest.json", b'{"step": 1}')
        store.put("latest.json", b'{"step": 2}')
        _write_streamed(store, "data.bin", _data(2 * CHUNK + 1))
        assert store.get("latest.json") == b'{"step": 2}'
    finally:
        store.close()
    assert front.uploads() and all("ifGenerationMatch" not in s.query for s in front.uploads())


def test_concurrent_create_only_has_one_winner(front: GCSFront, bucket: str) -> None:
    store = _open(front.endpoint, bucket)
    outcomes: list[str] = []

    def attempt(i: int) -> None:
        try:
            store.put("race", f"writer-{i}".encode(), create_only=True)
            outcomes.append("won")
        except AlreadyExistsError:
            outcomes.append("lost")

    try:
        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        store.close()
    assert sorted(outcomes) == ["lost"] * 5 + ["won"]


def test_lost_answer_to_own_create_only_put_is_not_a_conflict(front: GCSFront, bucket: str) -> None:
    # The server stores the manifest but the answer is lost; the retry then meets 412.
    front.rules.append(once(lambda s: s.is_upload, Reply(503, lose=True)))
    store = _open(front.endpoint, bucket)
    try:
        store.put("m.json", b"mine", create_only=True)
        assert store.get("m.json") == b"mine"
        with pytest.raises(AlreadyExistsError):
            store.put("m.json", b"someone else", create_only=True)
    finally:
        store.close()
    assert len([s for s in front.uploads() if s.method == "POST"]) == 3


# Create-only on servers that check it themselves ----------------------------------------

RACE_TIMEOUT_S = 300.0
PRECONDITION_FAILURES = (AssertionError, pytest.fail.Exception)
"""How a create-only test fails on a server that overwrites: never a crash or an HTTP error."""

SERVERS = [
    pytest.param(
        "gcs_endpoint",
        id="gcp-storage-emulator",
        marks=pytest.mark.xfail(
            strict=True,
            raises=PRECONDITION_FAILURES,
            reason="gcp-storage-emulator ignores ifGenerationMatch=0 and overwrites",
        ),
    ),
    pytest.param("fake_gcs_endpoint", id="fake-gcs-server"),
]


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest) -> str:
    """Endpoint of a GCS fake with no proxy in front: the emulator or fake-gcs-server."""
    return str(request.getfixturevalue(request.param))


@pytest.mark.process
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_create_only_conflicts_on_the_server_itself(
    server: str, shape: str, request: pytest.FixtureRequest
) -> None:
    if shape == "streamed-resumable" and request.node.callspec.params["server"] != "gcs_endpoint":
        request.applymarker(
            pytest.mark.xfail(
                strict=True, raises=PRECONDITION_FAILURES, reason=IGNORES_RESUMABLE_PRECONDITIONS
            )
        )
    key = "step-000000001/manifest.json"
    store = _open(server, create_bucket(server))
    write = SHAPES[shape]
    first, second = _data(3 * CHUNK + 17, seed=1), _data(3 * CHUNK + 17, seed=2)
    try:
        write(store, key, first)
        with pytest.raises(AlreadyExistsError, match="already committed"):
            write(store, key, second)
        assert store.get(key) == (first[:1000] if shape == "streamed-small" else first)
        store.put(key, b"plain")  # without the precondition the server replaces it
        assert store.get(key) == b"plain"
    finally:
        store.close()


@pytest.mark.process
def test_create_only_puts_racing_from_a_barrier_have_one_winner(server: str) -> None:
    key = "step-000000001/manifest.json"
    writers = 6
    start = threading.Barrier(writers)
    won: list[int] = []
    lost: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    store = _open(server, create_bucket(server), max_concurrency=writers)

    def attempt(i: int) -> None:
        start.wait(timeout=RACE_TIMEOUT_S)
        try:
            store.put(key, f"writer-{i}".encode(), create_only=True)
            outcome = won
        except AlreadyExistsError:
            outcome = lost
        except Exception as error:  # reported below, not lost in a thread
            with lock:
                errors.append(error)
            return
        with lock:
            outcome.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(writers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(RACE_TIMEOUT_S)
        stored = store.get(key)
    finally:
        store.close()
    assert not errors, errors
    assert len(won) == 1 and sorted(won + lost) == list(range(writers)), (won, lost)
    assert stored == f"writer-{won[0]}".encode()


def _commit_race_job(endpoint: str, bucket: str, value: float, start: Any, results: Any) -> None:
    """A job saving step 7; its manifest put waits at `start` until the other job's is ready."""
    import torch

    from spotckpt import CheckpointAlreadyCommittedError, CheckpointManager

    plain_put = GCSStore.put
    sent: list[bytes] = []

    def put_at_the_barrier(
        store: GCSStore, key: str, data: bytes, *, create_only: bool = False
    ) -> ObjectInfo:
        if create_only and key == manifest_key(7):
            sent.append(bytes(data))
            start.wait(timeout=RACE_TIMEOUT_S)
        return plain_put(store, key, data, create_only=create_only)

    GCSStore.put = put_at_the_barrier  # type: ignore[method-assign]  # in this process only
    options = {"endpoint_url": endpoint, "anonymous": True, "chunk_size": MIB}
    try:
        uri = f"gs://{bucket}/runs/exp1"
        with CheckpointManager(uri, preemption=False, storage_options=options) as manager:
            manager.save(7, {"w": torch.full((MIB,), value)})
        results.put(("committed", value, sent, ""))
    except CheckpointAlreadyCommittedError as error:
        results.put(("refused", value, sent, str(error)))
    except BaseException as error:
        start.abort()  # the other job must not wait for this one
        results.put(("error", value, sent, repr(error)))


@pytest.mark.process
def test_two_jobs_racing_to_commit_one_step_commit_exactly_one(server: str) -> None:
    import torch

    from spotckpt import CheckpointManager

    bucket = create_bucket(server)
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    results = context.Queue()
    jobs = [
        context.Process(target=_commit_race_job, args=(server, bucket, value, start, results))
        for value in (1.0, 2.0)
    ]
    for job in jobs:
        job.start()
    try:
        outcomes = sorted(results.get(timeout=RACE_TIMEOUT_S) for _ in jobs)
    finally:
        for job in jobs:
            job.join(RACE_TIMEOUT_S)
            if job.is_alive():
                job.kill()
                job.join()
    verdicts = [(outcome[0], outcome[3]) for outcome in outcomes]
    assert [verdict for verdict, _ in verdicts] == ["committed", "refused"], verdicts
    (_, winner, winner_sent, _), (_, _, loser_sent, message) = outcomes
    assert "already committed" in message
    assert len(winner_sent) == len(loser_sent) == 1 and winner_sent != loser_sent
    client = admin_client(server)
    try:
        names = [b.name for b in client.list_blobs(bucket) if b.name.endswith("manifest.json")]
        stored = client.bucket(bucket).blob(f"runs/exp1/{manifest_key(7)}").download_as_bytes()
    finally:
        client.close()
    assert names == [f"runs/exp1/{manifest_key(7)}"]
    assert stored == winner_sent[0]  # the winner's manifest, byte for byte
    options = {"endpoint_url": server, "anonymous": True}
    target = {"w": torch.empty(MIB)}
    uri = f"gs://{bucket}/runs/exp1"
    with CheckpointManager(uri, preemption=False, storage_options=options) as manager:
        assert manager.steps() == [7]
        assert manager.restore(target) == 7
    assert torch.equal(target["w"], torch.full((MIB,), winner))


# Retries and resumption -------------------------------------------------------------------


def _nth_chunk(n: int) -> Callable[[Seen], bool]:
    count = [0]

    def match(seen: Seen) -> bool:
        if seen.method == "PUT" and seen.is_upload and seen.content_range != "bytes */*":
            count[0] += 1
            return count[0] == n
        return False

    return match


@pytest.mark.parametrize(
    ("fault", "finished_answer"),
    [
        (Reply(503), 200),  # the chunk never arrived
        (Reply(429), 200),
        (Reply(503, lose=True), 200),  # the chunk arrived, its answer did not
        (Reply(500, lose=True), 404),
    ],
)
@pytest.mark.parametrize("chunk", [2, 4], ids=["middle-chunk", "final-chunk"])
def test_failed_chunk_resumes_where_the_server_stands(
    front: GCSFront, bucket: str, fault: Reply, finished_answer: int, chunk: int
) -> None:
    front.finished_session_answer = finished_answer
    front.rules.append(once(_nth_chunk(chunk), fault))
    data = _data(3 * CHUNK + 12345)
    store = _open(front.endpoint, bucket)
    try:
        _write_streamed(store, "obj", data)
        assert store.get("obj") == data
    finally:
        store.close()
    queries = [s for s in front.uploads() if s.content_range == "bytes */*"]
    assert len(queries) == 1  # asked the server where it stands, once, before resending
    sent = sum(len(s.body) for s in front.uploads() if s.method == "PUT")
    resent = 0 if fault.lose else (CHUNK if chunk == 2 else len(data) - 3 * CHUNK)
    assert sent == len(data) + resent


def test_lost_session_fails_clearly(front: GCSFront, bucket: str) -> None:
    front.rules.append(once(_nth_chunk(2), Reply(503)))
    front.rules.append(once(lambda s: s.content_range == "bytes */*", Reply(410)))
    store = _open(front.endpoint, bucket)
    try:
        with pytest.raises(StorageError, match=r"upload session of .*/obj is gone") as caught:
            _write_streamed(store, "obj", _data(3 * CHUNK + 1))
        assert not isinstance(caught.value, ObjectNotFoundError)
        assert not store.exists("obj")
    finally:
        store.close()


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504, 408])
def test_transient_answers_are_retried(front: GCSFront, bucket: str, status: int) -> None:
    store = _open(front.endpoint, bucket)
    try:
        store.put("a", b"x")
        front.rules.append(once(lambda s: s.method == "GET", Reply(status)))
        assert store.get("a") == b"x"
        front.rules.append(once(lambda s: "/o" in s.path and s.method == "GET", Reply(status)))
        assert [i.key for i in store.list()] == ["a"]
        front.rules.append(once(lambda s: s.is_upload, Reply(status)))
        store.put("b", b"y")
        assert store.get("b") == b"y"
    finally:
        store.close()


@pytest.mark.parametrize(
    ("status", "error", "says"),
    [
        (403, PermissionDeniedError, "HTTP 403"),
        (401, PermissionDeniedError, "credentials were rejected"),  # anonymous: no refresh
        (400, StorageError, "HTTP 400"),
    ],
)
def test_permanent_answers_fail_at_once(
    front: GCSFront, bucket: str, status: int, error: type[Exception], says: str
) -> None:
    store = _open(front.endpoint, bucket)
    try:
        front.rules.append(lambda s: Reply(status) if s.is_upload else None)
        with pytest.raises(error, match=rf"gs://{bucket}/runs/exp1/k: .*{says}"):
            store.put("k", b"x")
    finally:
        store.close()
    assert len(front.uploads()) == 1


def test_retries_give_up_after_the_policy(front: GCSFront, bucket: str) -> None:
    store = _open(front.endpoint, bucket)
    front.rules.append(lambda s: Reply(503))
    try:
        with pytest.raises(StorageError, match="HTTP 503"):
            store.get("anything")
    finally:
        store.close()
    downloads = [s for s in front.seen if s.path.startswith("/download/")]
    assert len(downloads) == FAST_RETRY.max_attempts


# Listing, aborts, memory ------------------------------------------------------------------


def test_list_follows_page_tokens(front: GCSFront, bucket: str) -> None:
    store = _open(front.endpoint, bucket, list_page_size=7)
    keys = [f"step-{i:03d}/obj" for i in range(23)] + ["other/file"]
    try:
        for key in keys:
            store.put(key, key.encode())
        listed = list(store.list("step-"))
    finally:
        store.close()
    assert [i.key for i in listed] == sorted(k for k in keys if k.startswith("step-"))
    assert all(i.size == len(i.key) for i in listed)
    pages = [s for s in front.seen if s.method == "GET" and s.path.endswith("/o")]
    assert [p.query.get("pageToken") for p in pages] == [None, ["7"], ["14"], ["21"]]
    assert all(p.query["maxResults"] == ["7"] for p in pages)


def test_abort_cancels_the_session_and_publishes_nothing(front: GCSFront, bucket: str) -> None:
    store = _open(front.endpoint, bucket)
    try:
        writer = store.open_writer("aborted")
        writer.write(_data(2 * CHUNK + 5))
        writer.abort()
        writer.abort()
        assert not store.exists("aborted")
    finally:
        store.close()
    deletes = [s for s in front.uploads() if s.method == "DELETE"]
    assert len(deletes) == 1 and deletes[0].query.get("upload_id")
    assert not any(_FINAL_RANGE.match(s.content_range) for s in front.uploads())


def test_streaming_memory_is_bounded(gcs_endpoint: str, bucket: str) -> None:
    store = _open(gcs_endpoint, bucket, chunk_size=MIB)
    piece = os.urandom(MIB // 4)
    tracemalloc.start()
    try:
        writer = store.open_writer("big")
        with writer:
            for _ in range(4 * 32):  # 32 MiB in 256 KiB pieces
                writer.write(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        store.close()
    assert writer.bytes_written == 32 * MIB
    assert peak < 4 * MIB, f"peak {peak / MIB:.1f} MiB while streaming 32 MiB in 1 MiB chunks"


def test_chunk_stream_reads_seeks_and_releases() -> None:
    stream = _ChunkStream()
    first, second = b"a" * 10, b"b" * 10
    stream.append(first)
    stream.append(second)
    assert stream.read(10) is first  # a whole piece goes out without a copy
    assert stream.read(5) == b"bbbbb" and stream.tell() == 15
    stream.release(12)
    stream.seek(12)
    assert stream.read() == b"b" * 8 and stream.available == 0
    with pytest.raises(StorageError, match="lost acknowledged data"):
        stream.seek(11)


# Emulator end to end ----------------------------------------------------------------------


def test_storage_emulator_host_is_honoured(
    gcs_endpoint: str,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint.removeprefix("http://"))
    store = open_store(f"gcs://{bucket}/p")  # anonymous by default under the emulator
    try:
        assert store.uri == f"gs://{bucket}/p"
        store.put("k", b"v")
    finally:
        store.close()
    client = admin_client(gcs_endpoint)
    try:
        assert client.bucket(bucket).blob("p/k").download_as_bytes() == b"v"
    finally:
        client.close()


def test_resumable_object_lands_whole_with_its_crc32c(gcs_endpoint: str, bucket: str) -> None:
    from spotckpt.checksum import crc32c_b64

    data = os.urandom(5 * CHUNK + 3)
    store = _open(gcs_endpoint, bucket)
    try:
        writer = store.open_writer("x/obj")
        with writer:
            writer.write(data)
        info = store.head("x/obj")
        assert info is not None and info.size == len(data)
        assert store.get_range("x/obj", CHUNK - 2, 5) == data[CHUNK - 2 : CHUNK + 3]
    finally:
        store.close()
    client = admin_client(gcs_endpoint)
    try:
        blob = client.bucket(bucket).get_blob("runs/exp1/x/obj")
        assert blob is not None and blob.crc32c == crc32c_b64(data)
    finally:
        client.close()


# Options, URIs, credentials ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"chunk_size": 1000}, "multiple of 262144"),
        ({"chunk_size": 0}, "multiple of 262144"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"list_page_size": 1001}, "list_page_size"),
        ({"part_size": 5 * MIB}, "unknown GCS storage options"),
        ({"endpoint_url": "ftp://x"}, "endpoint_url"),
    ],
)
def test_bad_options_are_rejected(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GCSOptions.from_options(options)


def test_options_from_strings() -> None:
    options = GCSOptions.from_options(
        {"chunk_size": "524288", "anonymous": "true", "read_timeout_s": "5"}
    )
    assert (options.chunk_size, options.anonymous, options.read_timeout_s) == (524288, True, 5.0)


@pytest.mark.parametrize(
    "uri", ["gs://", "gs://user:secret@bucket/p", "gs://bucket/p?x=1", "gs://Bad_Bucket/p"]
)
def test_bad_uris_are_rejected(uri: str) -> None:
    with pytest.raises(ValueError):
        open_store(uri, anonymous=True)


def test_missing_credentials_say_how_to_provide_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(PermissionDeniedError, match="Application Default Credentials"):
        open_store("gs://some-bucket/p")


def test_transient_classification() -> None:
    import requests
    from google.api_core import exceptions as api_exceptions

    assert is_transient(api_exceptions.TooManyRequests("slow down"))
    assert is_transient(api_exceptions.ServiceUnavailable("later"))
    assert is_transient(requests.exceptions.ConnectionError("reset"))
    assert not is_transient(api_exceptions.PreconditionFailed("exists"))
    assert not is_transient(api_exceptions.NotFound("gone"))
    assert not is_transient(api_exceptions.Forbidden("no"))
    assert not is_transient(api_exceptions.MethodNotImplemented("501"))


def test_missing_objects(gcs_endpoint: str, bucket: str) -> None:
    store = _open(gcs_endpoint, bucket)
    try:
        with pytest.raises(ObjectNotFoundError, match="runs/exp1/nope"):
            store.get("nope")
        with pytest.raises(ObjectNotFoundError):
            store.get_range("nope", 0, 1)
        assert store.head("nope") is None
        store.delete_many(["nope"])
    finally:
        store.close()


# The checkpoint manager on GCS ------------------------------------------------------------


def _model_and_optimizer(seed: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(torch.randn(8, 512)).pow(2).mean()
    loss.backward()
    optimizer.step()
    return model, optimizer


def _same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, dict):
            if not (isinstance(other, dict) and _same_bits(value, other)):
                return False
        elif isinstance(value, torch.Tensor):
            flat, flat_other = value.reshape(-1), other.reshape(-1)
            if value.dtype != other.dtype or value.shape != other.shape:
                return False
            if not torch.equal(flat.view(torch.uint8), flat_other.view(torch.uint8)):
                return False
        elif value != other:
            return False
    return True


def test_save_and_restore_through_the_manager_on_the_emulator(
    gcs_endpoint: str,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spotckpt import CheckpointManager

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    uri = f"gs://{bucket}/runs/exp1"
    model, optimizer = _model_and_optimizer(0)  # about 9 MiB with the AdamW moments
    options = {"chunk_size": MIB}  # several resumable chunks per shard
    with CheckpointManager(uri, preemption=False, storage_options=options) as manager:
        manager.save(3, {"model": model, "optim": optimizer})
        manager.save(5, {"model": model, "optim": optimizer})
        assert manager.steps() == [3, 5]
    fresh, fresh_optimizer = _model_and_optimizer(1)
    assert not _same_bits(model.state_dict(), fresh.state_dict())
    with CheckpointManager(uri, preemption=False) as manager:
        assert manager.restore({"model": fresh, "optim": fresh_optimizer}) == 5
    assert _same_bits(model.state_dict(), fresh.state_dict())
    assert _same_bits(optimizer.state_dict(), fresh_optimizer.state_dict())


def test_manager_commit_is_create_only_on_gcs(front: GCSFront, bucket: str) -> None:
    from spotckpt import CheckpointAlreadyCommittedError, CheckpointManager

    model = _model_and_optimizer(0)[0]
    options = {"endpoint_url": front.endpoint, "anonymous": True, "chunk_size": MIB}
    uri = f"gs://{bucket}/runs/exp1"
    with CheckpointManager(uri, preemption=False, storage_options=options) as manager:
        manager.save(4, {"model": model})
        with pytest.raises(CheckpointAlreadyCommittedError, match="already committed"):
            manager.save(4, {"model": _model_and_optimizer(1)[0]})
        fresh = _model_and_optimizer(2)[0]
        assert manager.restore({"model": fresh}) == 4
    assert _same_bits(model.state_dict(), fresh.state_dict())
    manifests = [s for s in front.uploads() if b"manifest.json" in s.body[:2048]]
    assert len(manifests) >= 1
    assert all(s.query.get("ifGenerationMatch") == ["0"] for s in manifests)
    assert any(s.query.get("uploadType") == ["resumable"] for s in front.uploads())
