"""Decompression bombs in compressed chunks (`spotckpt.format.compression`): a stored block whose
plane is a Zstandard frame that declares (or decodes to) more than the manifest promises is
refused from its frame header, before anything is allocated for it, and every path that decodes
(restore, `get_tensor`, verify, export) treats it as corrupt data, as a CRC32C mismatch: restore
quarantines the step and falls back, verify reports it. The forged blocks keep their stored
length and the manifest's CRC32Cs are rewritten to match them (as the writer of an unsigned
manifest can), so only the decoder stands between the frame and memory."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

import spotckpt
from spotckpt import CheckpointManager, TrainState
from spotckpt.catalog import Catalog
from spotckpt.checksum import crc32c
from spotckpt.errors import ChecksumMismatchError, CorruptBlockError
from spotckpt.export import export_hf
from spotckpt.format.compression import decode_block_into
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from tests_support import assert_equal

BLOCK = 64 << 10
FQN = "model.0.weight"
SMALL_PEAK = 32 << 20
"""Traced bytes a refused bomb may cost at most, restore included (the model is ~2 MB)."""

_MAGIC = b"\x28\xb5\x2f\xfd"


def _rle_blocks(total: int) -> bytes:
    """Zstandard RLE blocks (4 bytes per 128 KiB of output) that decode to `total` zero bytes."""
    blocks = []
    while total:
        size = min(total, 128 << 10)
        total -= size
        header = int(not total) | (1 << 1) | (size << 3)  # last flag, type RLE, size
        blocks.append(header.to_bytes(3, "little") + b"\x00")
    return b"".join(blocks)


def declaring_frame(content_size: int, decoded: int) -> bytes:
    """A frame whose header declares `content_size` bytes (single segment: the window is that
    size too) and whose blocks decode to `decoded`."""
    return _MAGIC + b"\xe0" + content_size.to_bytes(8, "little") + _rle_blocks(decoded)


def wide_window_frame(window_log: int, decoded: int) -> bytes:
    """A frame that declares no content size and a window of ``2**window_log`` bytes (what a
    streaming decoder allocates up front), decoding to `decoded`."""
    return _MAGIC + b"\x00" + bytes([(window_log - 10) << 3]) + _rle_blocks(decoded)


FRAMES: dict[str, bytes] = {
    "declares-and-decodes-512MiB": declaring_frame(512 << 20, 512 << 20),  # 16 KiB
    "declares-1TiB": declaring_frame(1 << 40, 256 << 10),  # 21 bytes
    "window-128MiB": wide_window_frame(27, 1 << 20),
}


def one_plane_block(frame: bytes) -> bytes:
    """A stored block of one plane (codec ``zstd-planes-1``) that is `frame`."""
    return struct.pack("<I", len(frame)) + frame


def two_plane_block(frame: bytes, length: int) -> bytes:
    """A stored block of `length` bytes of two planes (``zstd-planes-2``): `frame`, then
    zeros."""
    rest = length - 8 - len(frame)
    return struct.pack("<2I", len(frame), rest) + frame + bytes(rest)


# The codec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_a_bomb_frame_is_refused_from_its_header_before_allocating(name: str) -> None:
    block = memoryview(one_plane_block(FRAMES[name]))
    out = bytearray(BLOCK)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptBlockError, match=r"declares|window"):
            decode_block_into(block, memoryview(out), 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * BLOCK


def test_frames_with_or_without_a_declared_size_decode_and_a_wrong_size_is_refused() -> None:
    raw = bytes(range(256)) * (BLOCK // 256)
    out = bytearray(BLOCK)
    for sized in (True, False):
        frame = zstandard.ZstdCompressor(write_content_size=sized).compress(raw)
        decode_block_into(memoryview(one_plane_block(frame)), memoryview(out), 1)
        assert bytes(out) == raw
    short = zstandard.ZstdCompressor().compress(raw[:100])
    with pytest.raises(CorruptBlockError, match="declares 100 bytes"):
        decode_block_into(memoryview(one_plane_block(short)), memoryview(out), 1)


@pytest.mark.process
def test_no_bomb_allocates_beyond_a_low_address_space_limit(tmp_path: Path) -> None:
    """What tracemalloc cannot see (the decoder's own window buffer) under RLIMIT_AS: a child
    with 64 MiB of address space to spare refuses every bomb as corrupt, never by running out
    of memory."""
    blocks = tmp_path / "blocks.json"
    forged = {name: one_plane_block(frame).hex() for name, frame in FRAMES.items()}
    blocks.write_text(json.dumps(forged))
    script = textwrap.dedent(
        f"""
        import json, resource
        from spotckpt.errors import CorruptBlockError
        from spotckpt.format.compression import decode_block_into
        blocks = json.load(open({str(blocks)!r}))
        with open("/proc/self/status") as status:
            size = next(int(l.split()[1]) for l in status if l.startswith("VmSize:")) << 10
        limit = size + (64 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        out = memoryview(bytearray({BLOCK}))
        for name, block in sorted(blocks.items()):
            try:
                decode_block_into(memoryview(bytes.fromhex(block)), out, 1)
            except CorruptBlockError as error:
                print(name, "refused:", error)
            except MemoryError:
                print(name, "MemoryError")
        """
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True
    )
    lines = done.stdout.splitlines()
    assert len(lines) == len(FRAMES), done.stdout + done.stderr
    for line in lines:
        assert "refused:" in line and ("declares" in line or "window" in line), line
        assert "memory" not in line.lower(), line


# Saved checkpoints ---------------------------------------------------------------------------


def _state() -> tuple[TrainState, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.Linear(700, 3))
    model.to(torch.bfloat16)
    return TrainState(model=model), model


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _bomb_step(root: Path, step: int, frame: bytes) -> None:
    """Replace stored block 0 of `FQN`'s chunk with one whose first plane is `frame`, keeping
    its stored length, and rewrite the manifest's CRC32Cs to match."""
    catalog = Catalog(open_store(str(root)))
    location = catalog.read_manifest(step).tensors[FQN].chunks[0].location
    assert location.codec == "zstd-planes-2"
    start, end = location.stored_span(0, 1, BLOCK)
    [path] = sorted(p for p in (root / f"step-{step:09d}").rglob("r*") if p.is_file())
    data = bytearray(path.read_bytes())
    block = two_plane_block(frame, end - start)
    data[start:end] = block
    path.write_bytes(bytes(data))
    manifest_path = root / manifest_key(step)
    document = json.loads(manifest_path.read_text())
    document["tensors"][FQN]["chunks"][0]["stored_crc32c"][0] = crc32c(block)
    [record] = document["objects"]
    record["crc32c"] = crc32c(bytes(data))
    manifest_path.write_text(json.dumps(document))


def _saved_with_bomb(tmp_path: Path, frame: bytes) -> tuple[Path, dict[str, torch.Tensor]]:
    """Steps 1 and 2 saved compressed, step 2's first block of `FQN` replaced by the bomb;
    returns the root and step 1's state."""
    state, model = _state()
    root = tmp_path / "ckpt"
    with CheckpointManager(str(root), compression="on", preemption=False) as mgr:
        mgr.save(1, state)
        first = _snapshot(model)
        with torch.no_grad():
            model[0].weight.mul_(2)
        mgr.save(2, state)
    _bomb_step(root, 2, frame)
    return root, first


def _traced_peak(action: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        result = action()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["declares-and-decodes-512MiB", "declares-1TiB"])
def test_restore_quarantines_a_bombed_step_and_falls_back(tmp_path: Path, name: str) -> None:
    root, first = _saved_with_bomb(tmp_path, FRAMES[name])
    state, model = _state()
    with torch.no_grad():
        model[0].weight.add_(3)

    def restore() -> int | None:
        with CheckpointManager(str(root), preemption=False) as mgr:
            return mgr.restore(state)

    restored, peak = _traced_peak(restore)
    assert restored == 1
    assert_equal(first, _snapshot(model))
    catalog = Catalog(open_store(str(root)))
    assert catalog.steps() == [1] and catalog.quarantined_attempts(2)
    assert peak < SMALL_PEAK


@pytest.mark.parametrize("name", ["declares-and-decodes-512MiB", "declares-1TiB"])
def test_verify_reports_a_bombed_step_corrupt(tmp_path: Path, name: str) -> None:
    root, _first = _saved_with_bomb(tmp_path, FRAMES[name])
    report, peak = _traced_peak(lambda: verify_checkpoint(open_store(str(root)), 2))
    assert [(p.kind, p.tensors) for p in report.problems] == [("blocks", (FQN,))]
    assert isinstance(report.error(), ChecksumMismatchError)
    assert verify_checkpoint(open_store(str(root)), 1).ok
    assert peak < SMALL_PEAK


@pytest.mark.parametrize("name", ["declares-and-decodes-512MiB", "declares-1TiB"])
def test_reads_and_export_refuse_a_bombed_block_as_corrupt(tmp_path: Path, name: str) -> None:
    root, _first = _saved_with_bomb(tmp_path, FRAMES[name])

    def get_tensor() -> None:
        with spotckpt.open_checkpoint(str(root), step=2) as ckpt:
            ckpt.get_tensor(FQN)

    def export() -> None:
        export_hf(open_store(str(root)), 2, str(tmp_path / "hf"))

    for action in (get_tensor, export):
        tracemalloc.start()
        try:
            with pytest.raises(ChecksumMismatchError, match=r"does not decode.*declares"):
                action()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < SMALL_PEAK
