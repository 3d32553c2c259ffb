"""`ObjectStoreReader`: DCP's storage reader for one committed checkpoint in any `ObjectStore`.

DCP's call order: ``reset`` -> ``read_metadata`` (from the validated `Manifest`: nothing is read)
-> ``set_up_storage_reader`` -> ``prepare_local_plan`` -> ``prepare_global_plan`` (coordinator:
pieces wanted by several ranks go to one reader, `spotckpt.engine.shared_reads`) -> ``read_data``
(every rank).

``read_data`` first checks that every object it reads from exists with the manifest's size, then
fetches with parallel ranged reads. A tensor piece of half a read (8 MiB) or more that can take
the stored bytes as they are (a contiguous CPU destination of the stored dtype and shape) is read
straight into its memory, in pieces of at most ``max_read_bytes``, and its CRC32C blocks are
checked there, in the reading thread: no intermediate buffer, no copy. Such pieces back to back
in an object share one ranged read that fills each destination in turn (a scatter read, one
request where the store offers it: `spotckpt.storage.base.ScatterReads`). In a signed step every
byte returned is also checked against a BLAKE3 the signature covers (`spotckpt.engine.chunks`):
a chunk is then read whole, however little of it is wanted, and one read in place in pieces is
hashed once its last piece landed, before it is committed. Smaller pieces (and those
needing a strided copy or another device) are widened to CRC block boundaries, coalesced with
their neighbours into one ranged read each, verified (`spotckpt.engine.chunks`), and copied out.
A chunk stored encoded (compressed: `spotckpt.format.encodings`) is read by its stored blocks,
neighbours coalesced into one ranged read, and decoded by its encoding in the reading thread
(`spotckpt.engine.chunks`), straight into its destination when that can take the bytes as they
are; stored and raw CRC32Cs are both checked. Non-tensor
values are unpickled only with ``torch.load(weights_only=True)``, whatever planner is in use.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import io
import itertools
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future as PoolFuture
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from spotckpt.engine.chunks import ChunkReader, strong_hashes
from spotckpt.engine.packing import Run, RunDestinations, RunMember, Unpack, small_runs
from spotckpt.engine.shared_reads import (
    SharedReads,
    StoredShapes,
    exchange,
    plan_shared_reads,
    read_key,
)
from spotckpt.errors import CorruptCheckpointError, InvalidArgumentError
from spotckpt.format.dtypes import BY_NAME
from spotckpt.format.manifest import ChunkLocation, Manifest
from spotckpt.layout import step_folder
from spotckpt.storage.base import ObjectStore, reads_scattered
from spotckpt.values import load_plain

IN_PLACE_SHARE = 2
"""A tensor piece of at least ``max_read_bytes / IN_PLACE_SHARE`` (8 MiB by default) is read
straight into its destination, in pieces of at most ``max_read_bytes`` read in parallel; smaller
ones are coalesced with their neighbours into ranged reads of up to ``max_read_bytes`` and
copied out: a request of its own per mid-sized tensor would cost more than the copy."""
SCATTER_SHARE = 2
"""In-place pieces back to back in an object are read by one request of up to
``SCATTER_SHARE * max_read_bytes`` (32 MiB by default; `ObjectStoreReader._scatter`): larger
requests gained nothing more, and each must arrive whole within the retry policy's deadline."""


@dataclass
class _Need:
    """One read item's byte range within one object, widened to CRC block boundaries."""

    request: ReadItem
    location: ChunkLocation
    start: int
    end: int
    first_block: int
    wanted_start: int
    wanted_end: int
    target: torch.Tensor | None = None
    """The destination, once resolved (tensor items only)."""
    contiguous: bool = False
    """Whether the wanted bytes are exactly the destination's memory (then copied as bytes)."""
    into: memoryview | None = None
    """A piece of an encoded chunk decoded in place: its slice of the destination's memory."""


@dataclass
class _Fetch:
    """One ranged read that serves one or more needs.

    `into` holds the destinations' own memory when the fetch lands in place, back to back in
    the object, filled in turn by one ranged read: a view per need (a piece of a tensor), or per
    member of a run read straight into its members (`RunDestinations`). `checks` says what each
    view holds, for its CRC32Cs: its need, and the run member or None. Otherwise the fetch is
    read into a buffer of its own and copied out.
    """

    key: str
    start: int
    end: int
    needs: list[_Need]
    into: list[memoryview] | None = None
    checks: list[tuple[_Need, RunMember | None]] = dataclasses.field(default_factory=list)
    decode: bool = False
    """Pieces of encoded chunks (one need each): `start`..`end` are their stored bytes."""


@dataclass
class _Landing:
    """A tensor read in place: its destination, its need, how many pieces it was read in and
    how many of them are in flight."""

    target: torch.Tensor
    need: _Need
    pieces: int
    unpack: Unpack | None = None
    """For a run read into its buffer after the reader took its destinations: the copy out."""
    pieces_left: int = -1

    def __post_init__(self) -> None:
        self.pieces_left = self.pieces


class _Claims:
    """The memory that reads land in directly. Each piece is checked on its destination's bytes
    once they arrive, so nothing else may write there meanwhile: a destination that shares
    memory with one (tied weights, saved untied; a view of another) is read into a buffer of its
    own and copied once every read has landed (the last copy wins), and so are runs read into
    their buffers, whose members the planner copies out."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def claim(self, spans: list[tuple[int, int]]) -> bool:
        """Claim every (start, end) address span, or none when any overlaps another."""
        spans = sorted((start, end) for start, end in spans if end > start)
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                return False
        if any(self.overlaps(start, end) for start, end in spans):
            return False
        for start, end in spans:
            at = bisect.bisect_right(self.starts, start)
            self.starts.insert(at, start)
            self.ends.insert(at, end)
        return True

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any claimed span overlaps ``start``..``end``."""
        at = bisect.bisect_right(self.starts, start)
        return (at > 0 and self.ends[at - 1] > start) or (
            at < len(self.starts) and self.starts[at] < end
        )

    def touches(self, tensor: torch.Tensor | None) -> bool:
        """Whether a claimed span overlaps the memory a CPU `tensor` spans."""
        if tensor is None or tensor.device.type != "cpu" or not self.starts:
            return False
        return self.overlaps(*_span(tensor))


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The addresses from a tensor's first element to past its last (a strided view's whole
    extent, its gaps included)."""
    if tensor.numel() == 0:
        return 0, 0
    last = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


@dataclass
class ReadStats:
    """Bytes a restore fetched against bytes its read items needed."""

    bytes_read: int = 0
    bytes_needed: int = 0
    requests: int = 0

    @property
    def ratio(self) -> float:
        """Read over needed (1.0 is perfect)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


class ObjectStoreReader(StorageReader):
    """Reads one committed checkpoint described by `manifest`; see the module docstring.

    With a process `group`, a tensor piece that several ranks load (DDP replicas, the replicated
    dimension of HSDP) is read from the bucket once, by one of them (spread for balance), and
    broadcast to the others inside `read_data`, so a restart reads the checkpoint about once
    whatever the number of replicas.

    With `offer_runs`, the metadata also offers each run of small tensors
    (`spotckpt.engine.packing`) as one uint8 item, for a load planner that adopts runs (the
    manager's); plain DCP planners would load such an item as a tensor of its own, so it is off by
    default.
    """

    def __init__(
        self,
        store: ObjectStore,
        manifest: Manifest,
        *,
        max_parallel_reads: int = 8,
        max_read_bytes: int = 16 << 20,
        coalesce_gap: int = 64 << 10,
        group: Any = None,
        offer_runs: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.store = store
        self.manifest = manifest
        self.folder = step_folder(manifest.step)
        self.max_parallel_reads = max_parallel_reads
        self.max_read_bytes = max_read_bytes
        self.coalesce_gap = coalesce_gap
        self.chunks = ChunkReader(
            store,
            self.folder,
            manifest.block_size,
            {key: record.size for key, record in manifest.objects.items()},
            strong=strong_hashes(manifest),
        )
        self.metadata, self.locations = manifest.to_dcp()
        self.chunk_sizes = StoredShapes(self.metadata)
        self.offer_runs = offer_runs
        self.runs = small_runs(manifest) if offer_runs else {}
        for name, run in self.runs.items():
            self._offer_run(name, run)
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()
        self._planned = 0  # bytes this rank's fetches read in all (`progress`)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the store, the manifest and the read settings (the stats start afresh)."""
        if self.group is not None:
            raise InvalidArgumentError(
                "an ObjectStoreReader with a process group cannot be pickled (a group does not "
                "cross processes); build the reader with group=None in the other process"
            )
        rebuild = functools.partial(
            ObjectStoreReader,
            max_parallel_reads=self.max_parallel_reads,
            max_read_bytes=self.max_read_bytes,
            coalesce_gap=self.coalesce_gap,
            offer_runs=self.offer_runs,
        )
        return rebuild, (self.store, self.manifest)

    def _offer_run(self, name: str, run: Run) -> None:
        """Offer DCP a run of small tensors (`spotckpt.engine.packing`) as one more uint8 item,
        which a load planner may load instead of its members; its bytes are checked member by
        member."""
        size = torch.Size([run.length])
        chunk = ChunkStorageMetadata(torch.Size([0]), size)
        properties = TensorProperties(dtype=torch.uint8)
        self.metadata.state_dict_metadata[name] = TensorStorageMetadata(properties, size, [chunk])
        index = MetadataIndex(name, torch.Size([0]))
        self.locations[index] = ChunkLocation(
            key=run.key, offset=run.offset, length=run.length, block_crc32c=()
        )

    def reset(self, checkpoint_id: Any = None) -> None:
        self.stats = ReadStats()
        self._planned = 0

    def progress(self) -> tuple[int, int]:
        """Bytes this rank has fetched so far, and how many its reads fetch in all (0 before
        they are planned)."""
        return self.stats.bytes_read, self._planned

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any
    ) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: give each tensor piece wanted by several ranks to one reader
        (`spotckpt.engine.shared_reads`)."""
        if self.group is None or len(plans) < 2:
            return plans
        return plan_shared_reads(plans, self.chunk_sizes)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def byte_ranges(self, plan: LoadPlan) -> dict[str, list[tuple[int, int]]]:
        """The byte ranges ``[start, end)`` of each object that reading `plan` fetches."""
        ranges: dict[str, list[tuple[int, int]]] = {}
        for fetch in self._plan_fetches([self._need(item) for item in plan.items]):
            ranges.setdefault(fetch.key, []).append((fetch.start, fetch.end))
        return ranges

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        failure: Exception | None = None
        try:
            self._read_own(plan, planner)
        except Exception as error:  # raised once the peers know it (`exchange`)
            failure = error
        if isinstance(plan.storage_data, SharedReads):
            exchange(plan, plan.storage_data, planner, self.group, failed=failure is not None)
        if failure is not None:
            raise failure
        done_future: Future[None] = Future()
        done_future.set_result(None)
        return done_future

    def _read_own(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Fetch the plan's items with parallel ranged reads; each fetch's CRCs are checked in
        the thread that read it, and tensors are committed here, in the calling thread."""
        in_place: list[_Fetch] = []
        buffered: list[_Need] = []
        encoded: list[_Need] = []
        landing: dict[int, _Landing] = {}  # by id() of the read item
        shared = plan.storage_data if isinstance(plan.storage_data, SharedReads) else None
        broadcast = {read.key for read in shared.reads} if shared is not None else set()
        claims = _Claims()
        shares_memory: set[int] = set()  # read items copied once every read has landed
        late: list[Callable[[], None]] = []

        def commit(item: ReadItem, tensor: torch.Tensor) -> None:
            if item.storage_index.fqn in self.runs:  # the planner copies its members out: last
                late.append(functools.partial(planner.commit_tensor, item, tensor))
            else:
                planner.commit_tensor(item, tensor)

        def deliver(need: _Need, view: memoryview, start: int) -> None:
            if id(need.request) in shares_memory or claims.touches(need.target):
                late.append(
                    functools.partial(
                        self._deliver, need, view, start, planner, planner.commit_tensor
                    )
                )
            else:
                self._deliver(need, view, start, planner, commit)

        for need in (self._need(item) for item in plan.items):
            # a run this rank reads for others is broadcast from its buffer: it must be filled
            sent = read_key(need.request) in broadcast
            into_members = None if sent else self._run_into_members(need, planner, claims)
            if into_members is not None:
                run_buffer, pieces, unpack = into_members
                landing[id(need.request)] = _Landing(run_buffer, need, len(pieces), unpack)
                in_place += pieces
                continue
            target = self._in_place_target(need, planner)
            if target is not None and not claims.claim([_span(target)]):
                target = None  # it shares memory with another destination: copied, last
                shares_memory.add(id(need.request))
            if need.location.codec:
                to_decode = self._encoded_pieces(need, target)
                if target is not None:
                    landing[id(need.request)] = _Landing(target, need, len(to_decode))
                encoded += to_decode
                continue
            if target is None:
                buffered.append(need)
                continue
            pieces = self._pieces(need, target)
            landing[id(need.request)] = _Landing(target, need, len(pieces))
            in_place += pieces
        fetches = self._scatter(in_place)
        fetches += self._plan_fetches(buffered)
        encoded.sort(key=lambda n: (n.location.key, n.location.offset, n.first_block))
        fetches += self._encoded_fetches(encoded)
        fetches.sort(key=lambda fetch: (fetch.key, fetch.start))
        self._planned += sum(fetch.end - fetch.start for fetch in fetches)
        with ThreadPoolExecutor(
            self.max_parallel_reads, thread_name_prefix="spotckpt-read"
        ) as pool:
            self._check_objects(fetches, pool)
            pending: dict[PoolFuture[Any], _Fetch] = {
                pool.submit(self._fetch_decoded if fetch.decode else self._fetch, fetch): fetch
                for fetch in fetches
            }
            try:
                for done in as_completed(pending):
                    fetch = pending[done]
                    if fetch.decode:  # one decoded view per need, in its destination or not
                        for need, view in zip(fetch.needs, done.result(), strict=True):
                            if need.into is None:
                                deliver(need, view, need.location.offset + need.start)
                            else:
                                self._land(landing[id(need.request)], commit, late)
                        continue
                    buffer = done.result()
                    for need in fetch.needs:
                        if buffer is None:  # landed in place
                            self._land(landing[id(need.request)], commit, late)
                        else:
                            deliver(need, buffer, fetch.start)
            except Exception as error:
                raise _first_failure(pending, error) from None
        for copy in late:  # into memory that in-place reads shared (`_Claims`), now all in
            copy()

    def _land(
        self,
        landed: _Landing,
        commit: Callable[[ReadItem, torch.Tensor], None],
        late: list[Callable[[], None]],
    ) -> None:
        """One more piece of a tensor read in place has arrived (its CRCs checked); after the
        last, the whole chunk's BLAKE3 is checked (a signed step's: a single piece was checked
        whole already) and the tensor is committed."""
        landed.pieces_left -= 1
        if landed.pieces_left:
            return
        if landed.pieces > 1:
            memory = landed.target.reshape(-1).view(torch.uint8).numpy().data
            request = landed.need.request
            self.chunks.check_strong(memory, landed.need.location, request.storage_index.fqn)
        if landed.unpack is not None:  # a run whose members share memory: copied out last
            late.append(functools.partial(landed.unpack, landed.target))
        commit(landed.need.request, landed.target)

    def _check_objects(self, fetches: list[_Fetch], pool: ThreadPoolExecutor) -> None:
        """Before any byte is read: every object exists with the size the manifest says, and
        holds what is asked of it (one ``head`` each, in parallel); an error names everything
        that this rank reads from the object."""
        spans: dict[str, tuple[int, int, list[str]]] = {}
        for fetch in fetches:
            start, end, names = spans.get(fetch.key, (fetch.start, fetch.end, []))
            names += [need.request.storage_index.fqn for need in fetch.needs]
            spans[fetch.key] = (min(start, fetch.start), max(end, fetch.end), names)
        checks = pool.map(lambda entry: self.chunks.check_range(entry[0], *entry[1]), spans.items())
        list(checks)  # raises the first failure, in object order

    def _in_place_target(self, need: _Need, planner: LoadPlanner) -> torch.Tensor | None:
        """Resolve a tensor need's destination (kept in `need.target`); return it when the
        stored bytes can be read straight into its memory: a CPU tensor, contiguous, of the
        stored dtype and shape, whose piece is contiguous in the chunk, block-aligned and at
        least half a read (`IN_PLACE_SHARE`)."""
        item = need.request
        if item.type == LoadItemType.BYTE_IO:
            return None
        target = need.target = planner.resolve_tensor(item).detach()
        dtype, _sizes = self.chunk_sizes[item.storage_index]
        stored = BY_NAME[dtype]
        nbytes = math.prod(item.lengths) * stored.itemsize
        need.contiguous = (
            need.wanted_end - need.wanted_start == nbytes
            and target.device.type == "cpu"
            and target.dtype == stored.torch_dtype
            and target.is_contiguous()
            and tuple(target.shape) == tuple(item.lengths)
        )
        aligned = (need.start, need.end) == (need.wanted_start, need.wanted_end)
        large = nbytes >= self.max_read_bytes // IN_PLACE_SHARE or bool(need.location.codec)
        return target if need.contiguous and aligned and large else None

    def _pieces(self, need: _Need, target: torch.Tensor) -> list[_Fetch]:
        """An in-place need as fetches of at most about `max_read_bytes`, each into its slice of
        the destination's memory, read in parallel; cut at CRC block boundaries, or, for a run
        of small tensors, at its members' boundaries (each member is checked whole)."""
        memory = target.reshape(-1).view(torch.uint8).numpy().data
        run = self.runs.get(need.request.storage_index.fqn)
        cuts = self._block_cuts(need) if run is None else _member_cuts(run, self.max_read_bytes)
        fetches = []
        offset = need.location.offset
        for start, end in itertools.pairwise([*cuts, need.end]):
            first_block = start // self.chunks.block_size
            piece = dataclasses.replace(need, start=start, end=end, first_block=first_block)
            into = memory[start - need.start : end - need.start]
            fetches.append(
                _Fetch(
                    need.location.key,
                    offset + start,
                    offset + end,
                    [piece],
                    [into],
                    [(piece, None)],
                )
            )
        return fetches

    def _run_into_members(
        self, need: _Need, planner: LoadPlanner, claims: _Claims
    ) -> tuple[torch.Tensor, list[_Fetch], Unpack | None] | None:
        """A whole run whose members' destinations the planner hands over (`RunDestinations`),
        as fetches straight into those members, no run buffer and no copy: pieces of about
        `max_read_bytes` cut at member boundaries, each one ranged read filling its members in
        turn (only where the store reads scattered in one request), each member checked on its
        own bytes. Returns the run's (untouched) buffer, committed once they all landed, the
        fetches and None; or, when members share memory (`_Claims`), fetches into the buffer
        and the `Unpack` that copies out of it. None when the planner keeps the run."""
        fqn = need.request.storage_index.fqn
        run = self.runs.get(fqn)
        whole = run is not None and (need.wanted_start, need.wanted_end) == (0, run.length)
        scattered = reads_scattered(self.store)  # else a read per member: far more requests
        if run is None or not whole or not scattered or not isinstance(planner, RunDestinations):
            return None
        unpack = planner.take_run(need.request.dest_index.fqn)
        if unpack is None:
            return None
        run_buffer = planner.resolve_tensor(need.request).detach()
        if not claims.claim(unpack.spans()):
            return run_buffer, self._pieces(need, run_buffer), unpack
        cuts = _member_cuts(run, self.max_read_bytes)
        views: list[list[memoryview]] = [[] for _ in cuts]
        members: list[list[RunMember]] = [[] for _ in cuts]
        for member, (target, _address, start, _end) in zip(
            run.members, unpack.targets, strict=True
        ):
            at = bisect.bisect_right(cuts, start) - 1
            views[at].append(target.data)
            members[at].append(member)
        fetches = []
        for (start, end), into, held in zip(
            itertools.pairwise([*cuts, run.length]), views, members, strict=True
        ):
            piece = dataclasses.replace(need, start=start, end=end, first_block=0)
            checks: list[tuple[_Need, RunMember | None]] = [(piece, member) for member in held]
            fetches.append(
                _Fetch(run.key, run.offset + start, run.offset + end, [piece], into, checks)
            )
        return run_buffer, fetches, None

    def _scatter(self, pieces: list[_Fetch]) -> list[_Fetch]:
        """In-place pieces back to back in an object joined into one ranged read each, which
        fills their destinations in turn. A request per 8 MiB piece costs more than its bytes
        (signing, a round trip, a first byte; on a 2-core loopback 32 reads of 8 MiB took 30 %
        longer than 8 of 32 MiB), so a read spans up to an even share of the in-place bytes per
        reader thread, at least `max_read_bytes` and at most ``SCATTER_SHARE`` times it."""
        if not reads_scattered(self.store):
            return pieces  # a read per view anyway: nothing to gain
        total = sum(piece.end - piece.start for piece in pieces)
        share = -(-total // max(1, self.max_parallel_reads))
        span = min(max(self.max_read_bytes, share), SCATTER_SHARE * self.max_read_bytes)
        joined: list[_Fetch] = []
        for piece in sorted(pieces, key=lambda fetch: (fetch.key, fetch.start)):
            last = joined[-1] if joined else None
            if (
                last is not None
                and last.into is not None
                and piece.into is not None
                and last.key == piece.key
                and last.end == piece.start
                and piece.end - last.start <= span
            ):
                last.end = piece.end
                last.needs += piece.needs
                last.into += piece.into
                last.checks += piece.checks
            else:
                joined.append(piece)
        return joined

    def _encoded_pieces(self, need: _Need, target: torch.Tensor | None) -> list[_Need]:
        """A need in an encoded chunk as pieces to decode: straight into the destination's
        memory when it can take the bytes as they are (`target`), in pieces of about
        `max_read_bytes` (decoded in parallel); else whole, into a buffer of its own."""
        if target is None:
            return [need]
        memory = target.reshape(-1).view(torch.uint8).numpy().data
        pieces = []
        for start, end in itertools.pairwise([*(self._block_cuts(need) or [need.start]), need.end]):
            first_block = start // self.chunks.block_size
            into = memory[start - need.start : end - need.start]
            pieces.append(
                dataclasses.replace(need, start=start, end=end, first_block=first_block, into=into)
            )
        return pieces

    def _encoded_fetches(self, pieces: list[_Need]) -> list[_Fetch]:
        """Pieces of encoded chunks as ranged reads of their stored blocks, neighbours in an
        object coalesced (as `_plan_fetches` does for raw bytes): a request of its own per
        encoded tensor would cost a first-byte latency each."""
        block = self.chunks.block_size
        fetches: list[_Fetch] = []
        for piece in pieces:
            end_block = -(-piece.end // block) if piece.end > piece.start else piece.first_block + 1
            start, end = piece.location.stored_span(piece.first_block, end_block, block)
            last = fetches[-1] if fetches else None
            if (
                last is not None
                and last.key == piece.location.key
                and last.end <= start <= last.end + self.coalesce_gap
                and end - last.start <= self.max_read_bytes
            ):
                last.end = end
                last.needs.append(piece)
            else:
                fetches.append(_Fetch(piece.location.key, start, end, [piece], decode=True))
        return fetches

    def _block_cuts(self, need: _Need) -> list[int]:
        block = self.chunks.block_size
        return list(range(need.start, need.end, max(1, self.max_read_bytes // block) * block))

    def _need(self, item: ReadItem) -> _Need:
        location = self.locations.get(item.storage_index)
        if location is None:
            raise CorruptCheckpointError(
                f"checkpoint step {self.manifest.step} has no stored item "
                f"{item.storage_index.fqn!r}"
            )
        if item.type == LoadItemType.BYTE_IO:
            wanted_start, wanted_end = 0, location.length
        else:
            dtype, sizes = self.chunk_sizes[item.storage_index]
            wanted_start, wanted_end = _element_span(
                sizes, item.storage_offsets, item.lengths, BY_NAME[dtype].itemsize
            )
        span = self.chunks.span(location, wanted_start, wanted_end)
        self.stats.bytes_needed += wanted_end - wanted_start
        return _Need(
            item, location, span.start, span.end, span.first_block, wanted_start, wanted_end
        )

    def _plan_fetches(self, needs: list[_Need]) -> list[_Fetch]:
        fetches: list[_Fetch] = []
        ordered = sorted(needs, key=lambda n: (n.location.key, n.location.offset + n.start))
        for need in ordered:
            start = need.location.offset + need.start
            end = need.location.offset + need.end
            last = fetches[-1] if fetches else None
            if (
                last is not None
                and last.key == need.location.key
                and start <= last.end + self.coalesce_gap
                and max(end, last.end) - last.start <= self.max_read_bytes
            ):
                last.end = max(last.end, end)
                last.needs.append(need)
            else:
                fetches.append(_Fetch(need.location.key, start, end, [need]))
        return fetches

    def _fetch(self, fetch: _Fetch) -> memoryview | None:
        """Read one fetch (into its destinations, or a buffer of its own, returned) and check
        the CRCs of every need it serves; runs in a reader thread."""
        names = [need.request.storage_index.fqn for need in fetch.needs]
        view: memoryview | None = None
        if fetch.into is None:
            view = memoryview(bytearray(fetch.end - fetch.start))
            self.chunks.read_into(fetch.key, fetch.start, view, names)
            for need in fetch.needs:
                base = need.location.offset + need.start - fetch.start
                self._verify(need, view[base : base + need.end - need.start])
        else:
            self.chunks.read_into_views(fetch.key, fetch.start, fetch.into, names)
            for (need, member), piece in zip(fetch.checks, fetch.into, strict=True):
                if member is None:
                    self._verify(need, piece)
                else:
                    self.chunks.verify(piece, member.location, 0, member.fqn)
        with self._stats_lock:
            self.stats.bytes_read += fetch.end - fetch.start
            self.stats.requests += 1
        return view

    def _verify(self, need: _Need, piece: memoryview) -> None:
        """Check the CRC32Cs of a need's bytes: a chunk's, or each member's of a run."""
        run = self.runs.get(need.request.storage_index.fqn)
        if run is None:
            self.chunks.verify(
                piece, need.location, need.first_block, need.request.storage_index.fqn
            )
        else:
            self._verify_run(run, need, piece)

    def _fetch_decoded(self, fetch: _Fetch) -> list[memoryview]:
        """Read one fetch of stored blocks and decode each need it serves (into its slice of
        the destination, or a buffer of its own), checking stored and raw CRC32Cs; runs in a
        reader thread."""
        names = [need.request.storage_index.fqn for need in fetch.needs]
        stored = memoryview(self.chunks.read(fetch.key, fetch.start, fetch.end, names))
        views = []
        for need in fetch.needs:
            view = need.into
            if view is None:
                view = memoryview(bytearray(need.end - need.start))
            fqn = need.request.storage_index.fqn
            self.chunks.decode_into(need.location, need.first_block, stored, fetch.start, view, fqn)
            self.chunks.verify(view, need.location, need.first_block, fqn)
            views.append(view)
        with self._stats_lock:
            self.stats.bytes_read += stored.nbytes
            self.stats.requests += 1
        return views

    def _verify_run(self, run: Run, need: _Need, piece: memoryview) -> None:
        """Check each member of a run, in the piece `need.start`..`need.end` of it (cut at
        member boundaries), on its own bytes."""
        start, end = run.offset + need.start, run.offset + need.end
        for member in run.members:
            at = member.location.offset
            empty_at_end = member.location.length == 0 and at == end == run.offset + run.length
            if start <= at < end or empty_at_end:
                member_bytes = piece[at - start : at - start + member.location.length]
                self.chunks.verify(member_bytes, member.location, 0, member.fqn)

    def _deliver(
        self,
        need: _Need,
        buffer: memoryview,
        buffer_start: int,
        planner: LoadPlanner,
        commit: Callable[[ReadItem, torch.Tensor], None],
    ) -> None:
        """Hand a need's verified bytes, read into a fetch buffer, to the planner (a tensor
        committed by `commit`)."""
        base = need.location.offset + need.start - buffer_start
        view = buffer[base : base + need.end - need.start]
        item = need.request
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, safe_value_stream(view, item.storage_index.fqn))
            return
        wanted = view[need.wanted_start - need.start : need.wanted_end - need.start]
        target = need.target if need.target is not None else planner.resolve_tensor(item).detach()
        if need.contiguous:
            target.reshape(-1).view(torch.uint8).numpy().data[:] = wanted
            commit(item, target)
            return
        dtype, sizes = self.chunk_sizes[item.storage_index]
        source = _strided_view(
            wanted, BY_NAME[dtype].torch_dtype, sizes, item.storage_offsets, item.lengths
        )
        if target.shape != source.shape:
            raise CorruptCheckpointError(
                f"{item.storage_index.fqn}: stored piece {tuple(source.shape)} does not fit the "
                f"destination {tuple(target.shape)}"
            )
        target.copy_(source)
        commit(item, target)


def _member_cuts(run: Run, step: int) -> list[int]:
    """Offsets within a run where pieces of about `step` bytes start, at member boundaries."""
    cuts = [0]
    for member in run.members:
        at = member.location.offset - run.offset
        if at - cuts[-1] >= step:
            cuts.append(at)
    return cuts


def _first_failure(pending: dict[PoolFuture[Any], _Fetch], error: BaseException) -> BaseException:
    """After `error`, the failure to report: cancel the fetches not started, wait for the
    running ones, and take the failed fetch first in object order (fetches are submitted in
    that order, so every earlier one has run), so that a damaged object always gets the same
    message; `error` itself when it did not come from a fetch."""
    for future in pending:
        future.cancel()
    wait(pending)
    failed = [
        (pending[f].key, pending[f].start, f.exception())
        for f in pending
        if not f.cancelled() and f.exception() is not None
    ]
    if not any(failure is error for _key, _start, failure in failed):
        return error
    return min(failed, key=lambda entry: (entry[0], entry[1]))[2] or error


def _element_span(
    sizes: tuple[int, ...], offsets: torch.Size, lengths: torch.Size, itemsize: int
) -> tuple[int, int]:
    """Byte range, within a row-major chunk, from the first to the last element of a sub-block."""
    if math.prod(lengths) == 0:
        return 0, 0
    if tuple(lengths) == sizes and not any(offsets):  # the whole chunk
        return 0, math.prod(sizes) * itemsize
    strides = _row_major_strides(sizes)
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    return first * itemsize, (last + 1) * itemsize


def _row_major_strides(sizes: tuple[int, ...]) -> list[int]:
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    return strides


def _strided_view(
    data: memoryview,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    offsets: torch.Size,
    lengths: torch.Size,
) -> torch.Tensor:
    """The sub-block `lengths` of a row-major chunk, given the bytes from its first element."""
    if math.prod(lengths) == 0:
        return torch.empty(tuple(lengths), dtype=dtype)
    raw = torch.frombuffer(data, dtype=torch.uint8)  # a fetch buffer: writable, no warning
    itemsize = torch.empty((), dtype=dtype).element_size()
    if raw.data_ptr() % itemsize:
        raw = raw.clone()
    flat = raw.view(dtype)
    return flat.as_strided(tuple(lengths), _row_major_strides(sizes), flat.storage_offset())


def safe_value_stream(view: memoryview, fqn: str) -> io.BytesIO:
    """Unpickle a stored value with weights_only=True, then hand DCP a re-serialised copy.

    DCP's default planner unpickles what a reader gives it with the unrestricted loader, so
    bytes from the bucket never reach it: only objects that survived the restricted unpickler do.
    Bytes that pass their CRCs but do not load raise ValueLoadError, which is not corruption.
    """
    value = load_plain(view, fqn)
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return stream
