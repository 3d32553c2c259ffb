"""What runs inside each benchmark child process: the state dicts, the methods, the measuring.

A child runs one *unit*: one method doing one operation (save, restore, stall, copy) on one
state dict against one store, repeated `reps` times. Around every repetition it measures the
wall time, the process's CPU time (user + system, all threads: `getrusage(RUSAGE_SELF)`), and
the peak extra resident memory: the kernel's high-water mark (VmHWM) is reset through
``/proc/self/clear_refs`` just before the operation, so the peak minus the resident size at that
moment is what the operation itself added. Results go back to the orchestrator over a pipe, one
message per repetition, so that a unit killed by its timeout still reports what it finished.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from bench_units import MIB, REGION, Rep, StateSpec, Unit, varied_elements

warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

MODEL_KEY = "model"
LARGE_TENSOR_BYTES = 64 * MIB
SMALL_TENSOR_ELEMENTS = 1024


# State dicts ---------------------------------------------------------------------------------


def build_state(spec: StateSpec, seed: int = 1234) -> dict[str, torch.Tensor]:
    """The same values for the same spec in every process (fixed generator seed).

    Large tensors are one random tensor plus a different offset each (drawing 1 GiB of random
    numbers takes seconds here; an add runs at memory speed); every tensor's bytes differ.
    """
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    if spec.kind == "large":
        per = spec.tensor_bytes or min(LARGE_TENSOR_BYTES, max(spec.size_bytes // 4, MIB))
        count = max(1, spec.size_bytes // per)
        # Rows of 1,024 elements when the tensor size is given, so that it is exact (8 MiB).
        side = 1024 if spec.tensor_bytes else int((per // 4) ** 0.5)
        rows = (per // 4) // side
        base = torch.empty(rows, side).uniform_(generator=gen)
        for i in range(count):
            state[f"layers.{i:03d}.weight"] = base + float(i)
    elif spec.kind == "small":
        values = torch.empty(spec.count, SMALL_TENSOR_ELEMENTS).uniform_(generator=gen)
        for i in range(spec.count):
            state[f"blocks.{i // 10:05d}.p{i % 10}"] = values[i].clone()
    elif spec.kind == "varied":
        # One random buffer, each tensor a prefix of it plus its own offset (as for `large`).
        sizes = varied_elements(spec.count)
        base = torch.empty(max(sizes)).uniform_(generator=gen)
        for i, size in enumerate(sizes):
            state[f"blocks.{i // 10:05d}.p{i % 10}"] = base[:size] + float(i)
    else:
        raise ValueError(f"unknown state kind {spec.kind!r}")
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def zeros_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A destination to restore into: same shapes, zero-filled (so its pages are resident)."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flat_bytes(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The state's tensor bytes back to back, as one uint8 tensor (for the raw cases)."""
    return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in state.values()])


# Measuring -----------------------------------------------------------------------------------


def _cpu_times() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


_CAN_RESET_HWM: bool | None = None


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    global _CAN_RESET_HWM
    if _CAN_RESET_HWM is False:
        return False
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        _CAN_RESET_HWM = True
    except OSError:
        _CAN_RESET_HWM = False
    return _CAN_RESET_HWM


def _peak_rss_bytes() -> int:
    if _CAN_RESET_HWM:
        return _status_kib("VmHWM") * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(op: Callable[[], dict[str, Any] | None]) -> Rep:
    """Run `op` once; wall time, CPU time and peak extra RSS around it."""
    _reset_peak()
    before = _status_kib("VmRSS") * 1024
    user, system = _cpu_times()
    started = time.perf_counter()
    info = op() or {}
    seconds = time.perf_counter() - started
    user, system = _cpu_times()[0] - user, _cpu_times()[1] - system
    peak = max(0, _peak_rss_bytes() - before)
    return Rep(seconds, user + system, peak, before, user, system, info)


# Small file-like adapters for boto3 ----------------------------------------------------------


class _ViewFile(io.RawIOBase):
    """A seekable file over a memoryview; subclasses add reading or writing."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view.cast("B")
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos


class ViewReader(_ViewFile):
    """A read-only file over a memoryview, without copying it up front."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(buffer)]
        memoryview(buffer).cast("B")[: chunk.nbytes] = chunk
        self._pos += chunk.nbytes
        return chunk.nbytes

    def read(self, size: int = -1) -> bytes:
        end = self._view.nbytes if size is None or size < 0 else self._pos + size
        chunk = bytes(self._view[self._pos : end])
        self._pos += len(chunk)
        return chunk


class ViewWriter(_ViewFile):
    """A writable file over a preallocated memoryview (for download_fileobj)."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = memoryview(data).cast("B")
        self._view[self._pos : self._pos + chunk.nbytes] = chunk
        self._pos += chunk.nbytes
        return chunk.nbytes


# Methods -------------------------------------------------------------------------------------


class Context:
    """Everything a method needs in a child: the unit, its state, and scratch objects."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        # What a training script hands over: the model's flat state dict under one key (DCP
        # flattens it; a flat dict of 20,000 top-level keys would add DCP's per-key overheads).
        self.tensors = build_state(unit.state)
        self.state: dict[str, Any] = {MODEL_KEY: self.tensors}
        self.nbytes = state_bytes(self.tensors)
        self.dest: dict[str, torch.Tensor] | None = None
        self.raw: torch.Tensor | None = None

    def s3_key(self, rep: int) -> str:
        return f"{self.unit.prefix}/r{rep}"

    def s3_uri(self, rep: int) -> str:
        return f"s3://{self.unit.bucket}/{self.s3_key(rep)}"

    def local_path(self, rep: int) -> Path:
        return Path(self.unit.workdir) / f"r{rep}"

    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.unit.endpoint,
            "part_size": self.unit.part_size,
            "max_concurrency": self.unit.concurrency,
        }

    def transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.unit.part_size,
            multipart_chunksize=self.unit.part_size,
            max_concurrency=self.unit.concurrency,
            use_threads=True,
            preferred_transfer_client="classic",
        )

    def boto3_client(self) -> Any:
        import boto3
        import botocore.config

        config = botocore.config.Config(max_pool_connections=self.unit.concurrency + 2)
        return boto3.client(
            "s3", endpoint_url=self.unit.endpoint, region_name=REGION, config=config
        )

    def destination(self) -> dict[str, Any]:
        """A zeroed state of the same shapes to restore into, nested like `state`."""
        if self.dest is None:
            self.dest = zeros_like_state(self.tensors)
        else:
            for tensor in self.dest.values():
                tensor.zero_()
        return {MODEL_KEY: self.dest}

    def raw_bytes(self) -> torch.Tensor:
        if self.raw is None:
            self.raw = flat_bytes(self.tensors)
        return self.raw


class Method:
    """A way to save and restore the state; `prepare_*` runs outside the timed region."""

    name = "method"

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        raise NotImplementedError

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        raise NotImplementedError

    def check_restore(self, ctx: Context) -> None:
        if ctx.dest is None or not same_state(ctx.dest, ctx.tensors):
            raise AssertionError(f"{self.name}: restored state differs from the saved one")

    def cleanup(self) -> None:
        return None


class SpotckptMethod(Method):
    """spotckpt's CheckpointManager, blocking save and restore, on s3:// or file://."""

    name = "spotckpt"

    def __init__(self, local: bool) -> None:
        self.local = local
        self.manager: Any = None

    def _manager(self, ctx: Context, rep: int, **kwargs: Any) -> Any:
        from spotckpt import CheckpointManager

        if self.manager is not None:
            self.manager.close()
        if self.local:
            uri = ctx.local_path(rep).as_uri()
            self.manager = CheckpointManager(uri, preemption=False, **kwargs)
        else:
            self.manager = CheckpointManager(
                ctx.s3_uri(rep),
                preemption=False,
                storage_options=ctx.storage_options(),
                **kwargs,
            )
        return self.manager

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        manager = self._manager(ctx, rep)

        def run() -> None:
            manager.save(1, ctx.state, blocking=True)

        return run

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        manager = self._manager(ctx, rep)
        dest = ctx.destination()

        def run() -> dict[str, Any]:
            step = manager.restore(dest)
            if step != 1:
                raise AssertionError(f"restored step {step}, expected 1")
            stats = manager.last_read_stats
            if stats is None:
                return {}
            return {"read_ratio": stats.ratio, "requests": stats.requests}

        return run

    def cleanup(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None


class DcpFsspecMethod(Method):
    """DCP's own fsspec writer and reader (s3fs), default settings apart from the endpoint."""

    name = "dcp_fsspec"

    def _kwargs(self, ctx: Context) -> dict[str, Any]:
        return {"client_kwargs": {"endpoint_url": ctx.unit.endpoint}}

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(ctx.s3_uri(rep), **self._kwargs(ctx))

        def run() -> None:
            dcp.save(ctx.state, storage_writer=writer, no_dist=True)

        return run

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(ctx.s3_uri(rep), **self._kwargs(ctx))
        dest = ctx.destination()

        def run() -> None:
            dcp.load(dest, storage_reader=reader, no_dist=True)

        return run


class TorchSaveBoto3Method(Method):
    """torch.save into memory, then boto3 upload_fileobj; and the reverse."""

    name = "torch_save_boto3"

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        client, config = ctx.boto3_client(), ctx.transfer_config()

        def run() -> None:
            buffer = io.BytesIO()
            torch.save(ctx.state, buffer)
            buffer.seek(0)
            client.upload_fileobj(buffer, ctx.unit.bucket, ctx.s3_key(rep), Config=config)

        return run

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        client, config = ctx.boto3_client(), ctx.transfer_config()
        dest = ctx.destination()

        def run() -> None:
            buffer = io.BytesIO()
            client.download_fileobj(ctx.unit.bucket, ctx.s3_key(rep), buffer, Config=config)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=True)[MODEL_KEY]
            for key, tensor in dest[MODEL_KEY].items():
                tensor.copy_(loaded[key])

        return run


class S3TorchConnectorMethod(Method):
    """s3torchconnector's DCP writer and reader (AWS CRT), endpoint from AWS_ENDPOINT_URL."""

    name = "s3torchconnector"

    def _config(self, ctx: Context) -> Any:
        from s3torchconnector import S3ClientConfig

        os.environ["AWS_ENDPOINT_URL"] = ctx.unit.endpoint
        return S3ClientConfig(part_size=ctx.unit.part_size, force_path_style=True)

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(REGION, ctx.s3_uri(rep), s3client_config=self._config(ctx))

        def run() -> None:
            dcp.save(ctx.state, storage_writer=writer, no_dist=True)

        return run

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(REGION, ctx.s3_uri(rep), s3client_config=self._config(ctx))
        dest = ctx.destination()

        def run() -> None:
            dcp.load(dest, storage_reader=reader, no_dist=True)

        return run


class RawBoto3Method(Method):
    """The limit: one boto3 multipart put / parallel ranged get of the same number of bytes."""

    name = "raw_boto3"

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        client, config = ctx.boto3_client(), ctx.transfer_config()
        view = memoryview(ctx.raw_bytes().numpy())

        def run() -> None:
            client.upload_fileobj(ViewReader(view), ctx.unit.bucket, ctx.s3_key(rep), Config=config)

        return run

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        client, config = ctx.boto3_client(), ctx.transfer_config()
        ctx.raw_bytes()
        self.out = torch.zeros(ctx.nbytes, dtype=torch.uint8)
        view = memoryview(self.out.numpy())

        def run() -> None:
            client.download_fileobj(
                ctx.unit.bucket, ctx.s3_key(rep), ViewWriter(view), Config=config
            )

        return run

    def check_restore(self, ctx: Context) -> None:
        if not torch.equal(self.out, ctx.raw_bytes()):
            raise AssertionError("raw_boto3: downloaded bytes differ")


class RawBoto3SingleMethod(RawBoto3Method):
    """The other limit: one PUT and one whole-object GET of the same bytes, the body read in
    1 MiB pieces into preallocated memory (no ranges, no threads)."""

    name = "raw_boto3_single"

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        client = ctx.boto3_client()
        view = memoryview(ctx.raw_bytes().numpy())

        def run() -> None:
            client.put_object(Bucket=ctx.unit.bucket, Key=ctx.s3_key(rep), Body=ViewReader(view))

        return run

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        client = ctx.boto3_client()
        ctx.raw_bytes()
        self.out = torch.zeros(ctx.nbytes, dtype=torch.uint8)
        view = memoryview(self.out.numpy())

        def run() -> None:
            body = client.get_object(Bucket=ctx.unit.bucket, Key=ctx.s3_key(rep))["Body"]
            placed = 0
            for piece in body.iter_chunks(1 << 20):
                view[placed : placed + len(piece)] = piece
                placed += len(piece)
            if placed != ctx.nbytes:
                raise AssertionError(f"raw_boto3_single: got {placed} of {ctx.nbytes} bytes")

        return run


class DcpFileSystemMethod(Method):
    """DCP's FileSystemWriter / FileSystemReader on local disk (defaults: fsync per file)."""

    name = "dcp_fs"

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(ctx.local_path(rep)))

        def run() -> None:
            dcp.save(ctx.state, storage_writer=writer, no_dist=True)

        return run

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(ctx.local_path(rep)))
        dest = ctx.destination()

        def run() -> None:
            dcp.load(dest, storage_reader=reader, no_dist=True)

        return run


class TorchSaveFileMethod(Method):
    """torch.save to a file followed by fsync; torch.load(weights_only=True) and copy back."""

    name = "torch_save_file"

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        path = ctx.local_path(rep)
        path.parent.mkdir(parents=True, exist_ok=True)

        def run() -> None:
            with open(path, "wb") as file:
                torch.save(ctx.state, file)
                file.flush()
                os.fsync(file.fileno())

        return run

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        path = ctx.local_path(rep)
        dest = ctx.destination()

        def run() -> None:
            loaded = torch.load(path, weights_only=True)[MODEL_KEY]
            for key, tensor in dest[MODEL_KEY].items():
                tensor.copy_(loaded[key])

        return run


class RawFileMethod(Method):
    """The limit on disk: one write of the same number of bytes, then fsync; one readinto."""

    name = "raw_file"

    def prepare_save(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        path = ctx.local_path(rep)
        path.parent.mkdir(parents=True, exist_ok=True)
        view = memoryview(ctx.raw_bytes().numpy())

        def run() -> None:
            with open(path, "wb", buffering=0) as file:
                file.write(view)
                os.fsync(file.fileno())

        return run

    def prepare_restore(self, ctx: Context, rep: int) -> Callable[[], dict[str, Any] | None]:
        path = ctx.local_path(rep)
        ctx.raw_bytes()
        self.out = torch.zeros(ctx.nbytes, dtype=torch.uint8)
        view = memoryview(self.out.numpy())

        def run() -> None:
            with open(path, "rb", buffering=0) as file:
                got = file.readinto(view)
            if got != ctx.nbytes:
                raise AssertionError(f"raw_file: read {got} of {ctx.nbytes} bytes")

        return run

    def check_restore(self, ctx: Context) -> None:
        if not torch.equal(self.out, ctx.raw_bytes()):
            raise AssertionError("raw_file: read bytes differ")


def make_method(group: str, name: str) -> Method:
    local = group == "local"
    if name == "spotckpt":
        return SpotckptMethod(local)
    table: dict[str, type[Method]] = {
        "dcp_fsspec": DcpFsspecMethod,
        "torch_save_boto3": TorchSaveBoto3Method,
        "s3torchconnector": S3TorchConnectorMethod,
        "raw_boto3": RawBoto3Method,
        "raw_boto3_single": RawBoto3SingleMethod,
        "dcp_fs": DcpFileSystemMethod,
        "torch_save_file": TorchSaveFileMethod,
        "raw_file": RawFileMethod,
    }
    return table[name]()


# Stall of an asynchronous save ------------------------------------------------------------------


def _async_reps(ctx: Context, send: Callable[[Rep], None]) -> None:
    """Async save: time until save() returns (the stall), then until the upload committed."""
    from spotckpt import CheckpointManager

    unit = ctx.unit
    if unit.endpoint:
        manager = CheckpointManager(
            f"s3://{unit.bucket}/{unit.prefix}",
            async_save=True,
            preemption=False,
            storage_options=ctx.storage_options(),
            keep_last=1,
        )
    else:
        manager = CheckpointManager(
            Path(unit.workdir).as_uri(), async_save=True, preemption=False, keep_last=1
        )
    try:
        for rep in range(unit.reps):
            _reset_peak()
            before = _status_kib("VmRSS") * 1024
            user, system = _cpu_times()
            started = time.perf_counter()
            manager.save(rep + 1, ctx.state)
            stall = time.perf_counter() - started
            manager.wait()
            total = time.perf_counter() - started
            user, system = _cpu_times()[0] - user, _cpu_times()[1] - system
            peak = max(0, _peak_rss_bytes() - before)
            send(Rep(stall, user + system, peak, before, user, system, {"complete_s": total}))
    finally:
        manager.close()


def _copy_reps(ctx: Context, send: Callable[[Rep], None]) -> None:
    """The floor of any staging: copy each tensor into buffers allocated beforehand."""
    buffers = zeros_like_state(ctx.tensors)

    def run() -> None:
        for key, tensor in ctx.tensors.items():
            buffers[key].copy_(tensor)

    for _ in range(ctx.unit.reps):
        send(measure(run))


# Child entry point ---------------------------------------------------------------------------


def run_unit(unit_dict: dict[str, Any], conn: Any) -> None:
    """Child process body: run one unit, sending ("rep", Rep), ("skip"|"error", text), ("done")."""
    entered = time.time()
    os.environ.pop("AWS_ENDPOINT_URL", None)
    unit = Unit(**{**unit_dict, "state": StateSpec(**unit_dict["state"])})
    try:
        _run(unit, conn, entered)
    except Skip as skip:
        conn.send(("skip", str(skip), {}))
    except BaseException as error:
        text = f"{type(error).__name__}: {error}"
        conn.send(("error", text[:2000], {"traceback": traceback.format_exc()[-4000:]}))
    finally:
        with contextlib.suppress(Exception):
            conn.send(("done", "", {}))
        conn.close()


class Skip(Exception):
    """The unit cannot run here (a tool is missing); the reason is reported."""


def _run(unit: Unit, conn: Any, entered: float) -> None:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if unit.method == "s3torchconnector":
        try:
            import s3torchconnector.dcp  # noqa: F401
        except ImportError as error:
            raise Skip(
                f"s3torchconnector is not installed ({error}); "
                "`pip install s3torchconnector` to include it"
            ) from None
    import spotckpt

    built = time.time()
    ctx = Context(unit)
    conn.send(
        (
            "meta",
            "",
            {
                "bytes": ctx.nbytes,
                "tensors": len(ctx.tensors),
                "spotckpt_file": spotckpt.__file__,
                "child_entered_at": entered,
                "state_build_s": time.time() - built,
            },
        )
    )

    def send(rep: Rep) -> None:
        conn.send(("rep", "", asdict(rep)))

    if unit.group in ("stall", "memory") and unit.method == "spotckpt_async":
        _async_reps(ctx, send)
        return
    if unit.method == "memcpy":
        _copy_reps(ctx, send)
        return
    method = make_method(unit.group, unit.method)
    try:
        for rep in range(unit.reps):
            if unit.op == "save":
                send(measure(method.prepare_save(ctx, rep)))
            elif unit.op == "restore":
                # Every repetition restores the checkpoint that the save unit left behind.
                send(measure(method.prepare_restore(ctx, int(unit.location))))
                method.check_restore(ctx)
            else:
                raise ValueError(f"unknown op {unit.op!r}")
    finally:
        method.cleanup()
