"""Compressed chunks (`compression`): the codec on real bytes, bit-exact saves and restores (one
rank, gloo ranks resharded onto other world sizes, S3 over HTTP, incremental), partial reads,
verify and export, and adversarial stored bytes and manifests (corrupt blocks, forged lengths,
decompression bombs, a reader that does not know the feature)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from torch import nn

import spotckpt
import spotckpt.format.features
from spotckpt import CheckpointManager, TrainState
from spotckpt.catalog import Catalog
from spotckpt.config import Config
from spotckpt.engine.chunks import ChunkReader
from spotckpt.errors import (
    ChecksumMismatchError,
    ConfigError,
    CorruptBlockError,
    InvalidArgumentError,
    ManifestError,
    UnknownFormatError,
)
from spotckpt.export import export_hf
from spotckpt.format.compression import (
    CODECS,
    Compression,
    decode_block_into,
    encode_block,
    pays_off,
)
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from dist_worker import run_ranks
from tests_support import assert_equal, load_saved, write_signing_key

BLOCK = 64 << 10


def trained_state(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """bf16 weights (compressible exponents) and AdamW moments, an int64 and an fp32 buffer, odd
    sizes (a last block shorter than the others, a tensor smaller than a block), all small
    enough to be packed."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(300, 700), nn.Linear(700, 129), nn.Linear(129, 3))
    model.to(torch.bfloat16)
    model.register_buffer("counts", torch.arange(50_000, dtype=torch.int64) % 17)
    model.register_buffer("ema", torch.randn(40_000) * 0.01)  # fp32
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 300, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer_state = {
        k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
        for k, s in optimizer.state_dict()["state"].items()
    }
    return {"model": model_state, "optimizer": optimizer_state}


def scramble(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.add_(3)
        for state in optimizer.state.values():
            for value in state.values():
                value.add_(5)


def objects(root: Path, step: int) -> list[Path]:
    return sorted(p for p in (root / f"step-{step:09d}").rglob("r*") if p.is_file())


def read_manifest(root: Path, step: int) -> Manifest:
    return Catalog(open_store(str(root))).read_manifest(step)


# The codec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("planes", sorted(set(CODECS.values())))
@pytest.mark.parametrize("size", [1, 7, 4096, BLOCK - 3, BLOCK])
@pytest.mark.parametrize("kind", ["floats", "random", "zeros"])
def test_a_block_decodes_to_its_bytes(planes: int, size: int, kind: str) -> None:
    generator = np.random.default_rng(size * planes)
    if kind == "floats":
        raw = (generator.standard_normal(size) * 0.02).astype(np.float32).tobytes()[:size]
    elif kind == "random":
        raw = generator.integers(0, 256, size, dtype=np.uint8).tobytes()
    else:
        raw = bytes(size)
    stored = encode_block(memoryview(raw), planes, zstandard.ZstdCompressor(level=1))
    assert len(stored) <= len(raw)
    if kind == "random":
        assert stored == raw  # incompressible: stored as it is, never longer
    if kind == "zeros" and size >= 4096:
        assert len(stored) < len(raw) // 20
    out = bytearray(size)
    decode_block_into(memoryview(stored), memoryview(out), planes)
    assert bytes(out) == raw


def test_grouped_planes_beat_plain_zstd_on_float_bytes() -> None:
    weights = (torch.randn(BLOCK // 2) * 0.02).to(torch.bfloat16)
    raw = memoryview(weights.view(torch.uint8).numpy().tobytes())
    plain = len(zstandard.ZstdCompressor(level=1).compress(raw))
    grouped = len(encode_block(raw, 2, zstandard.ZstdCompressor(level=1)))
    assert grouped < plain < len(raw)


def forged_block(plane_lengths: list[int], body: bytes) -> memoryview:
    return memoryview(struct.pack(f"<{len(plane_lengths)}I", *plane_lengths) + body)


def test_a_stored_block_never_decodes_beyond_its_raw_length() -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))  # 64 MiB of zeros
    out = bytearray(BLOCK)
    with pytest.raises(CorruptBlockError):
        decode_block_into(forged_block([len(bomb)], bomb), memoryview(out), 1)
    short = zstandard.ZstdCompressor().compress(bytes(100))
    with pytest.raises(CorruptBlockError, match="declares 100 bytes"):
        decode_block_into(forged_block([len(short)], short), memoryview(out), 1)
    short = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(100))
    with pytest.raises(CorruptBlockError, match="decodes to 100 bytes"):
        decode_block_into(forged_block([len(short)], short), memoryview(out), 1)
    with pytest.raises(CorruptBlockError, match="do not add up"):
        decode_block_into(forged_block([10, 10], b"x" * 30), memoryview(out), 2)
    with pytest.raises(CorruptBlockError, match="does not decode"):
        decode_block_into(forged_block([50], b"\x00" * 50), memoryview(out), 1)


def test_auto_compresses_only_where_the_link_is_slower_than_compression() -> None:
    mib = 1 << 20
    assert not pays_off(1.5, 400 * mib, None)  # nothing measured yet: raw
    assert not pays_off(1.5, 400 * mib, 2000 * mib)  # a local disk: compression is the cap
    assert pays_off(1.5, 400 * mib, 100 * mib)  # a 100 MiB/s link
    assert not pays_off(1.02, 400 * mib, 100 * mib)  # too little to gain


# Saves and restores ---------------------------------------------------------------------------


def test_a_compressed_save_restores_bit_exact_and_is_smaller(tmp_path: Path) -> None:
    model, optimizer = trained_state()
    state = TrainState(model=model, optimizer=optimizer)
    for root, mode in ((tmp_path / "raw", "off"), (tmp_path / "packed", "on")):
        with CheckpointManager(str(root), compression=mode, preemption=False) as mgr:
            mgr.save(4, state)
    saved = snapshot(model, optimizer)
    scramble(model, optimizer)
    with CheckpointManager(str(tmp_path / "packed"), preemption=False) as mgr:
        assert mgr.restore(state) == 4
    assert_equal(saved, snapshot(model, optimizer))
    [raw] = objects(tmp_path / "raw", 4)
    [packed] = objects(tmp_path / "packed", 4)
    assert raw.suffix == ".safetensors" and packed.suffix == ".zblocks"
    assert packed.stat().st_size < raw.stat().st_size / 1.1
    manifest = read_manifest(tmp_path / "packed", 4)
    assert manifest.format == "spotckpt/1+compressed"
    codecs = {fqn: t.chunks[0].location.codec for fqn, t in manifest.tensors.items() if t.chunks}
    assert codecs["model.0.weight"] == "zstd-planes-2"
    assert codecs["optimizer.state.0.weight.exp_avg"] == "zstd-planes-2"
    assert codecs["model.ema"] == "zstd-planes-4"
    assert codecs["model.counts"] == "zstd-planes-8"
    assert codecs["model.2.weight"] == ""  # under one block: stored raw
    # the raw save's small tensors lie back to back: packed records (compressed ones never are)
    assert read_manifest(tmp_path / "raw", 4).format == "spotckpt/1+packed"


def test_partial_reads_verify_and_export_read_compressed_chunks(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model, optimizer = trained_state()
    root = tmp_path / "ckpt"
    with CheckpointManager(str(root), compression="on", preemption=False) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=optimizer))
    weight = model[0].weight.detach()
    with spotckpt.open_checkpoint(str(root)) as ckpt:
        rows = ckpt.get_slice("model.0.weight")[650:661]  # blocks in the middle only
        columns = ckpt.get_slice("model.0.weight")[:, 17:19]  # strided, every block
        assert torch.equal(rows, weight[650:661])
        assert torch.equal(columns, weight[:, 17:19])
        assert torch.equal(ckpt.get_tensor("model.counts"), model.counts)
    report = verify_checkpoint(open_store(str(root)), 1)
    assert report.ok, report
    export_hf(open_store(str(root)), 1, str(tmp_path / "hf"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["0.weight"], weight)


def flip_stored_byte(root: Path, step: int, fqn: str, block: int) -> None:
    """Flip one stored byte inside block `block` of the tensor's (compressed) chunk."""
    location = read_manifest(root, step).tensors[fqn].chunks[0].location
    assert location.codec and location.stored_lengths[block] < BLOCK  # a compressed block
    start, _end = location.stored_span(block, block + 1, BLOCK)
    [path] = objects(root, step)
    data = bytearray(path.read_bytes())
    data[start + 10] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupt_stored_block_is_caught_and_restore_falls_back(tmp_path: Path) -> None:
    model, optimizer = trained_state()
    state = TrainState(model=model, optimizer=optimizer)
    root = tmp_path / "ckpt"
    with CheckpointManager(str(root), compression="on", preemption=False) as mgr:
        mgr.save(1, state)
        first = snapshot(model, optimizer)
        scramble(model, optimizer)
        mgr.save(2, state)
    flip_stored_byte(root, 2, "model.0.weight", 3)
    report = verify_checkpoint(open_store(str(root)), 2)
    assert not report.ok and "model.0.weight" in str(report.error)
    with (
        spotckpt.open_checkpoint(str(root), step=2) as ckpt,
        pytest.raises(ChecksumMismatchError, match="stored block 3"),
    ):
        ckpt.get_tensor("model.0.weight")
    scramble(model, optimizer)
    with CheckpointManager(str(root), preemption=False) as mgr:
        assert mgr.restore(state) == 1  # step 2 is set aside, step 1 restores
    assert_equal(first, snapshot(model, optimizer))


def rewrite_manifest(root: Path, step: int, change: Any) -> None:
    path = root / manifest_key(step)
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def weight_entry(document: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = document["tensors"]["model.0.weight"]["chunks"][0]
    return entry


def saved_compressed(tmp_path: Path) -> Path:
    model, optimizer = trained_state()
    root = tmp_path / "ckpt"
    with CheckpointManager(str(root), compression="on", preemption=False) as mgr:
        mgr.save(1, TrainState(model=model, optimizer=optimizer))
    return root


def _longer_block(document: dict[str, Any]) -> None:
    weight_entry(document)["stored_lengths"][0] = BLOCK + 1


def _missing_length(document: dict[str, Any]) -> None:
    weight_entry(document)["stored_lengths"].pop()


def _unknown_codec(document: dict[str, Any]) -> None:
    weight_entry(document)["codec"] = "lz4-planes-2"


def _no_feature(document: dict[str, Any]) -> None:
    document["format"] = "spotckpt/1"


def _beyond_object(document: dict[str, Any]) -> None:
    weight_entry(document)["offset"] = 10**9


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_longer_block, "longer than its raw block"),
        (_missing_length, "one entry per block"),
        (_unknown_codec, "unknown codec"),
        (_no_feature, "does not name the feature"),
        (_beyond_object, "beyond the"),
    ],
)
def test_a_forged_compressed_location_is_refused(tmp_path: Path, change: Any, message: str) -> None:
    root = saved_compressed(tmp_path)
    rewrite_manifest(root, 1, change)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json((root / manifest_key(1)).read_bytes())


def test_a_forged_block_with_matching_crcs_still_cannot_decode_wrong_bytes(tmp_path: Path) -> None:
    """A forger who rewrites a stored block and its stored CRC32C gets a decode error, or the
    raw CRC32C refuses what it decoded to: never wrong bytes."""
    root = saved_compressed(tmp_path)
    manifest = read_manifest(root, 1)
    location = manifest.tensors["model.0.weight"].chunks[0].location
    start, end = location.stored_span(0, 1, BLOCK)
    [path] = objects(root, 1)
    data = bytearray(path.read_bytes())
    length = end - start
    forged = struct.pack("<2I", 4, length - 8 - 4) + b"\x00" * (length - 8)  # plausible lengths
    data[start:end] = forged
    path.write_bytes(bytes(data))
    from spotckpt.checksum import crc32c

    def forge(document: dict[str, Any]) -> None:
        weight_entry(document)["stored_crc32c"][0] = crc32c(forged)
        document["objects"][0]["crc32c"] = crc32c(bytes(data))

    rewrite_manifest(root, 1, forge)
    with spotckpt.open_checkpoint(str(root), step=1) as ckpt, pytest.raises(ChecksumMismatchError):
        ckpt.get_tensor("model.0.weight")


def test_a_reader_that_does_not_know_compression_refuses_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = saved_compressed(tmp_path)
    older = spotckpt.format.features.KNOWN_FEATURES - {"compressed"}
    monkeypatch.setattr(spotckpt.format.features, "KNOWN_FEATURES", older)
    with pytest.raises(UnknownFormatError, match="upgrade spotckpt"):
        Manifest.from_json((root / manifest_key(1)).read_bytes())


def test_incremental_saves_reference_compressed_chunks(tmp_path: Path) -> None:
    model, optimizer = trained_state()
    frozen = (torch.randn(800_000) * 0.02).to(torch.bfloat16)  # above the packing bound
    model.register_buffer("frozen", frozen)
    state = TrainState(model=model, optimizer=optimizer)
    root = tmp_path / "ckpt"
    options: dict[str, Any] = {"compression": "on", "incremental": True, "keep_last": None}
    with CheckpointManager(str(root), preemption=False, **options) as mgr:
        mgr.save(1, state)
        with torch.no_grad():
            model[1].weight.add_(1)
        mgr.save(2, state)
    saved = snapshot(model, optimizer)
    second = read_manifest(root, 2)
    assert second.format == "spotckpt/1+compressed+references"
    location = second.tensors["model.frozen"].chunks[0].location
    assert location.key.startswith("step-000000001/") and location.codec == "zstd-planes-2"
    assert not second.tensors["model.1.weight"].chunks[0].location.key.startswith("step-")
    assert verify_checkpoint(open_store(str(root)), 2).ok
    scramble(model, optimizer)
    with CheckpointManager(str(root), preemption=False) as mgr:
        assert mgr.restore(state) == 2
    assert_equal(saved, snapshot(model, optimizer))


def test_compressed_saves_over_s3_restore_bit_exact(s3_uri: str) -> None:
    model, optimizer = trained_state()
    state = TrainState(model=model, optimizer=optimizer)
    with CheckpointManager(s3_uri, compression="on", preemption=False) as mgr:
        mgr.save(3, state)
    saved = snapshot(model, optimizer)
    scramble(model, optimizer)
    with CheckpointManager(s3_uri, preemption=False) as mgr:
        assert mgr.restore(state) == 3
        manifest = mgr.catalog.read_manifest(3)
    assert_equal(saved, snapshot(model, optimizer))
    assert {key.rsplit(".", 1)[1] for key in manifest.objects} == {"zblocks"}


def test_auto_compresses_once_a_slow_link_was_measured(tmp_path: Path) -> None:
    model, optimizer = trained_state()
    state = TrainState(model=model, optimizer=optimizer)
    root = tmp_path / "ckpt"
    with CheckpointManager(str(root), compression="auto", keep_last=None, preemption=False) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        assert mgr._link.rate is None  # small uploads say nothing of the link: raw
        mgr._link.observe(64 << 20, 3.2)  # as a 20 MiB/s link would have measured
        mgr.save(3, state)
        mgr._link.observe(64 << 20, 0.016)  # 4 GiB/s: faster than compression here
        mgr.save(4, state)
    suffixes = [objects(root, step)[0].suffix for step in (1, 2, 3, 4)]
    assert suffixes == [".safetensors", ".safetensors", ".zblocks", ".safetensors"]


def test_the_setting_comes_from_the_environment_and_is_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPOTCKPT_COMPRESSION", "on")
    assert Config.load(cwd=tmp_path, uri=str(tmp_path)).compression == "on"
    monkeypatch.setenv("SPOTCKPT_COMPRESSION", "fast")
    with pytest.raises(ConfigError, match='SPOTCKPT_COMPRESSION: must be "auto", "on" or "off"'):
        Config.load(cwd=tmp_path, uri=str(tmp_path))
    with pytest.raises(ConfigError, match="compression"):
        CheckpointManager(str(tmp_path), compression="zstd", preemption=False)
    with pytest.raises(InvalidArgumentError, match="compression must be one of"):
        spotckpt.engine.writer.WriterOptions(encodings=Compression("x"))


def test_a_chunk_reader_refuses_an_unknown_codec(tmp_path: Path) -> None:
    root = saved_compressed(tmp_path)
    manifest = read_manifest(root, 1)
    location = manifest.tensors["model.0.weight"].chunks[0].location
    import dataclasses

    reader = ChunkReader(
        open_store(str(root)),
        "step-000000001",
        BLOCK,
        {k: r.size for k, r in manifest.objects.items()},
    )
    with pytest.raises(InvalidArgumentError, match="unknown chunk codec"):
        reader.read_chunk(dataclasses.replace(location, codec="zstd-planes-3"), "w")


# Ranks ----------------------------------------------------------------------------------------


@pytest.mark.process
def test_fsdp_ranks_save_compressed_and_restore_on_other_world_sizes(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    args = {"uri": str(root), "out": str(out), "compression": "on"}
    run_ranks(2, "fsdp_save", args)
    manifest = read_manifest(root, 2)
    assert "compressed" in manifest.features and len(manifest.objects) == 2
    for world in (1, 3):
        run_ranks(world, "fsdp_restore", {"uri": str(root), "out": str(out)})
        assert_equal(load_saved(out / "saved.pt"), load_saved(out / f"restored-{world}.pt"))
    assert_equal(load_saved(out / "continued.pt"), load_saved(out / "resumed-continued.pt"))


def test_a_signed_compressed_step_restores_and_verifies_its_stored_bytes(tmp_path: Path) -> None:
    """A signed manifest's BLAKE3 of each object is over its stored (compressed) bytes, as
    `verify` reads them: the step verifies, and a flipped stored byte does not."""
    key = write_signing_key(tmp_path / "key.pem")
    model, optimizer = trained_state()
    state = TrainState(model=model, optimizer=optimizer)
    root = tmp_path / "ckpt"
    options: dict[str, Any] = {"compression": "on", "signing_key": str(key), "preemption": False}
    with CheckpointManager(str(root), **options) as mgr:
        mgr.save(1, state)
    manifest = read_manifest(root, 1)
    assert {"compressed", "signed"} <= manifest.features
    assert all(record.blake3 for record in manifest.objects.values())
    saved = snapshot(model, optimizer)
    scramble(model, optimizer)
    with CheckpointManager(str(root), **options) as mgr:
        assert mgr.restore(state) == 1
        assert verify_checkpoint(mgr.store, 1, keyring=mgr.keyring).ok
        flip_stored_byte(root, 1, "model.0.weight", 2)
        report = verify_checkpoint(mgr.store, 1, keyring=mgr.keyring)
        assert not report.ok and "model.0.weight" in str(report.error)
    assert_equal(saved, snapshot(model, optimizer))
