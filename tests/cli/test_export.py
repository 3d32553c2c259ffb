"""export_hf: weights saved sharded by 4 FSDP2 ranks come out as Hugging Face safetensors whole.

The 4-rank checkpoints are made once per session (`fsdp_checkpoints`); tests copy them
(``fsdp_copy``, ``tied_copy``) before changing anything. Tied weights are written once, extra
files are copied beside the weights, and with ``transformers`` installed the export loads with
``from_pretrained``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file
from torch import nn

from spotckpt import CheckpointManager, CorruptCheckpointError, NoCheckpointError, TrainState
from spotckpt.checksum import crc32c
from spotckpt.errors import InvalidArgumentError
from spotckpt.export import (
    INDEX_FILE,
    TiedWeightsMismatchError,
    export_hf,
    plan_shards,
    shard_names,
)
from spotckpt.format.dtypes import BY_NAME
from spotckpt.format.manifest import Manifest
from spotckpt.format.safetensors_io import TensorSpec
from spotckpt.layout import manifest_key
from spotckpt.storage import AlreadyExistsError, open_store

from fsdp_checkpoints import (
    DIM,
    SEED,
    STEP,
    VOCAB,
    WORLD,
    TinyLM,
    assert_same,
    full_weights,
    raw_bits,
    tied_weights,
)


@pytest.mark.process
def test_checkpoint_really_is_sharded_by_four_ranks(fsdp_copy: Path) -> None:
    manifest = Manifest.from_json((fsdp_copy / manifest_key(STEP)).read_bytes())
    assert manifest.world_size == WORLD
    assert len({o.rank for o in manifest.objects.values()}) == WORLD
    weight = manifest.tensors["model.0.weight"]
    assert weight.shape == (30, 16)
    assert sorted(c.sizes[0] for c in weight.chunks) == [6, 8, 8, 8]


@pytest.mark.process
def test_export_single_file_matches_unsharded_model(fsdp_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    seen: list[tuple[int, int]] = []
    report = export_hf(
        open_store(str(fsdp_copy)), STEP, str(out), progress=lambda d, t: seen.append((d, t))
    )
    assert report.files == ["model.safetensors"] and report.index is None
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    want = full_weights()
    assert_same(load_file(out / "model.safetensors"), want)
    assert report.total_size == sum(t.numel() * t.element_size() for t in want.values())
    assert report.total_parameters == sum(t.numel() for t in want.values())
    assert report.tied == {} and report.included == []
    assert seen[-1] == (report.total_size, report.total_size)


@pytest.mark.process
def test_sharded_export_writes_index(fsdp_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    report = export_hf(open_store(str(fsdp_copy)), STEP, str(out), max_shard_size=1000)
    count = len(report.files)
    assert count >= 3
    expected = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert report.files == expected
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([*expected, "model.safetensors.index.json"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    want = full_weights()
    assert index["metadata"] == {
        "total_parameters": sum(t.numel() for t in want.values()),
        "total_size": sum(t.numel() * t.element_size() for t in want.values()),
    }
    assert index["metadata"]["total_parameters"] == report.total_parameters
    assert sorted(index["weight_map"]) == sorted(want)
    loaded: dict[str, torch.Tensor] = {}
    for name in expected:
        part = load_file(out / name)
        assert all(index["weight_map"][k] == name for k in part)
        nbytes = sum(t.numel() * t.element_size() for t in part.values())
        assert nbytes <= 1000 or len(part) == 1
        loaded.update(part)
    assert_same(loaded, want)


@pytest.mark.process
def test_dtype_cast_touches_floats_only(fsdp_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export_hf(open_store(str(fsdp_copy)), STEP, str(out), dtype=torch.bfloat16)
    want = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full_weights().items()
    }
    got = load_file(out / "model.safetensors")
    assert got["counts"].dtype == torch.int64
    assert_same(got, want)


@pytest.mark.process
def test_keep_prefix_and_unknown_prefix(fsdp_copy: Path, tmp_path: Path) -> None:
    store = open_store(str(fsdp_copy))
    export_hf(store, STEP, str(tmp_path / "kept"), strip_prefix=False)
    got = load_file(tmp_path / "kept" / "model.safetensors")
    assert sorted(got) == sorted(f"model.{k}" for k in full_weights())
    with pytest.raises(ValueError, match=r"no tensor of step 7 starts with 'encoder\.'.*model\."):
        export_hf(store, STEP, str(tmp_path / "none"), prefix="encoder.")
    with pytest.raises(NoCheckpointError, match="step 8"):
        export_hf(store, 8, str(tmp_path / "none"))


@pytest.mark.process
def test_corrupt_chunk_is_refused(fsdp_copy: Path, tmp_path: Path) -> None:
    manifest = Manifest.from_json((fsdp_copy / manifest_key(STEP)).read_bytes())
    chunk = next(c for c in manifest.tensors["model.0.weight"].chunks if c.sizes[0])
    path = fsdp_copy / f"step-{STEP:09d}" / chunk.location.key
    data = bytearray(path.read_bytes())
    data[chunk.location.offset + 5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"CRC32C mismatch.*model\.0\.weight"):
        export_hf(open_store(str(fsdp_copy)), STEP, str(tmp_path / "hf"))


@pytest.mark.process
def test_existing_export_needs_overwrite(fsdp_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    store = open_store(str(fsdp_copy))
    export_hf(store, STEP, str(out), max_shard_size=1000)
    with pytest.raises(AlreadyExistsError, match="overwrite"):
        export_hf(store, STEP, str(out))
    export_hf(store, STEP, str(out), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert_same(load_file(out / "model.safetensors"), full_weights())


def test_export_to_s3(fsdp_copy: Path, s3_uri: str, s3_client: Any, s3_bucket: str) -> None:
    out = open_store(f"{s3_uri}-hf")
    report = export_hf(open_store(str(fsdp_copy)), STEP, out, max_shard_size=1000)
    key = f"runs/exp1-hf/{report.files[0]}"
    part = load(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    want = full_weights()
    for name, tensor in part.items():
        assert torch.equal(raw_bits(tensor), raw_bits(want[name]))
    index = s3_client.get_object(Bucket=s3_bucket, Key="runs/exp1-hf/model.safetensors.index.json")
    assert sorted(json.loads(index["Body"].read())["weight_map"]) == sorted(want)


def test_plan_shards_is_greedy_and_isolates_big_tensors() -> None:
    f32 = BY_NAME["float32"]
    specs = [TensorSpec(n, f32, (s,)) for n, s in [("a", 10), ("b", 10), ("c", 100), ("d", 1)]]
    shards = plan_shards(specs, 80)
    assert [[s.name for s in shard] for shard in shards] == [["a", "b"], ["c"], ["d"]]
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(2) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


# Tied weights -------------------------------------------------------------------------------------


def _save_single(root: Path, model: nn.Module) -> None:
    """Save `model` as step `STEP` from this one process."""
    with CheckpointManager(str(root), preemption=False) as manager:
        manager.save(STEP, TrainState(model=model, rng=False))


def _header_names(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as file:
        return sorted(file.keys())


@pytest.mark.process
def test_tied_checkpoint_stores_both_names_sharded(tied_copy: Path) -> None:
    manifest = Manifest.from_json((tied_copy / manifest_key(STEP)).read_bytes())
    head = manifest.tensors["model.lm_head.weight"]
    embed = manifest.tensors["model.model.embed_tokens.weight"]
    assert sorted(c.sizes[0] for c in head.chunks) == [6, 8, 8, 8]
    assert {c.location.offset for c in head.chunks}.isdisjoint(
        {c.location.offset for c in embed.chunks}
    )  # two stored copies, not one


@pytest.mark.process
def test_tied_weight_is_written_once(tied_copy: Path, tmp_path: Path) -> None:
    store = open_store(str(tied_copy))
    report = export_hf(store, STEP, str(tmp_path / "hf"))
    assert report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    path = tmp_path / "hf" / "model.safetensors"
    want = tied_weights()
    assert _header_names(path) == sorted(want)
    assert_same(load_file(path), want)
    assert report.tensors == len(want)
    assert report.total_parameters == sum(t.numel() for t in want.values())
    assert report.total_size == sum(t.numel() * t.element_size() for t in want.values())
    assert path.stat().st_size < report.total_size + 1024  # the embedding is stored once

    sharded = export_hf(store, STEP, str(tmp_path / "sharded"), max_shard_size=1000)
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(want)
    assert index["metadata"] == {
        "total_parameters": VOCAB * DIM + 2 * DIM,
        "total_size": (VOCAB * DIM + 2 * DIM) * 4,
    }
    loaded: dict[str, torch.Tensor] = {}
    for name in sharded.files:
        loaded.update(load_file(tmp_path / "sharded" / name))
    assert_same(loaded, want)


@pytest.mark.process
def test_keep_tied_writes_every_name(tied_copy: Path, tmp_path: Path) -> None:
    report = export_hf(open_store(str(tied_copy)), STEP, str(tmp_path / "hf"), dedupe_tied=False)
    assert report.tied == {}
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert_same(got, {k: v.detach() for k, v in TinyLM().state_dict().items()})
    assert report.total_parameters == 2 * VOCAB * DIM + 2 * DIM


@pytest.mark.process
def test_config_saying_untied_keeps_both(tied_copy: Path, tmp_path: Path) -> None:
    template = tmp_path / "template"
    template.mkdir()
    config = json.dumps({"model_type": "llama", "tie_word_embeddings": False}).encode()
    (template / "config.json").write_bytes(config)
    out = tmp_path / "hf"
    report = export_hf(open_store(str(tied_copy)), STEP, str(out), include=[template])
    assert report.tied == {} and report.included == ["config.json"]
    assert "lm_head.weight" in _header_names(out / "model.safetensors")
    assert (out / "config.json").read_bytes() == config

    (template / "config.json").write_text('{"model_type": "llama"}')  # true by default
    again = export_hf(
        open_store(str(tied_copy)), STEP, str(out), include=[template], overwrite=True
    )
    assert again.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in _header_names(out / "model.safetensors")


def test_untied_head_is_written_and_a_tying_config_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    model = TinyLM(tied=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * 2)
    _save_single(root, model)
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        report = export_hf(
            open_store(str(root)), STEP, str(tmp_path / "hf"), include=[tmp_path / "config.json"]
        )
    assert report.tied == {}
    assert_same(
        load_file(tmp_path / "hf" / "model.safetensors"),
        {k: v.detach() for k, v in model.state_dict().items()},
    )
    assert "lm_head.weight differs from model.embed_tokens.weight" in caplog.text


def test_equal_values_under_other_names_are_all_written(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        for layer in model:
            layer.weight.zero_()
            layer.bias.zero_()
    _save_single(tmp_path / "ckpt", model)
    report = export_hf(open_store(str(tmp_path / "ckpt")), STEP, str(tmp_path / "hf"))
    assert report.tied == {}
    assert _header_names(tmp_path / "hf" / "model.safetensors") == [
        "0.bias",
        "0.weight",
        "1.bias",
        "1.weight",
    ]


def _crc_preserving_change(data: bytes, start: int) -> bytes:
    """`data` with some of the 64 bits from byte `start` flipped, keeping its CRC32C.

    CRC32C is affine over GF(2): for equal lengths crc(a ^ d) == crc(a) ^ crc(d) ^ crc(zeros), so
    a nonzero d with crc(d) == crc(zeros) keeps the CRC. 64 candidate bits span at most 32
    dimensions, so Gaussian elimination finds such a combination."""
    zeros = crc32c(bytes(len(data)))
    pivots: dict[int, tuple[int, int]] = {}  # top bit -> (syndrome, bits combined)
    for bit in range(64):
        single = bytearray(len(data))
        single[start + bit // 8] = 1 << (bit % 8)
        syndrome, combo = crc32c(single) ^ zeros, 1 << bit
        while syndrome and (syndrome.bit_length() - 1) in pivots:
            other, other_combo = pivots[syndrome.bit_length() - 1]
            syndrome, combo = syndrome ^ other, combo ^ other_combo
        if syndrome:
            pivots[syndrome.bit_length() - 1] = (syndrome, combo)
            continue
        changed = bytearray(data)
        for flipped in range(64):
            if combo >> flipped & 1:
                changed[start + flipped // 8] ^= 1 << (flipped % 8)
        return bytes(changed)
    raise AssertionError("64 bits always hold a CRC-preserving combination")


def test_equal_crcs_with_different_bytes_are_no_tie(tmp_path: Path) -> None:
    model = TinyLM(tied=False)
    embed = model.model.embed_tokens.weight.detach()
    forged = _crc_preserving_change(bytes(embed.numpy().tobytes()), start=100)
    assert forged != embed.numpy().tobytes() and crc32c(forged) == crc32c(embed.numpy().tobytes())
    with torch.no_grad():
        model.lm_head.weight.copy_(
            torch.frombuffer(bytearray(forged), dtype=torch.float32).view(embed.shape)
        )
    root = tmp_path / "ckpt"
    _save_single(root, model)
    manifest = Manifest.from_json((root / manifest_key(STEP)).read_bytes())
    crcs = [
        [c.location.block_crc32c for c in manifest.tensors[name].chunks]
        for name in ("model.lm_head.weight", "model.model.embed_tokens.weight")
    ]
    assert crcs[0] == crcs[1]  # the manifest alone cannot tell them apart

    out = tmp_path / "hf"
    with pytest.raises(
        TiedWeightsMismatchError, match=r"lm_head\.weight.*different bytes.*keep-tied"
    ):
        export_hf(open_store(str(root)), STEP, str(out))
    assert not (out / "model.safetensors").exists()
    export_hf(open_store(str(root)), STEP, str(out), dedupe_tied=False)
    assert_same(
        load_file(out / "model.safetensors"),
        {k: v.detach() for k, v in model.state_dict().items()},
    )


# Included files -----------------------------------------------------------------------------------


@pytest.mark.process
def test_include_copies_files_and_folders(tied_copy: Path, tmp_path: Path) -> None:
    snapshot = tmp_path / "snapshot"  # like a Hugging Face cache snapshot: links to blobs
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snapshot.mkdir()
    files = {
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": b'{"version": "1.0"}' + bytes(range(256)) * 40000,  # > one copy piece
        "generation_config.json": b"{}",
    }
    for name, data in files.items():
        (blobs / name).write_bytes(data)
        (snapshot / name).symlink_to(blobs / name)
    (snapshot / "model.safetensors").write_bytes(b"the base model's weights")
    (snapshot / "pytorch_model.bin.index.json").write_text("{}")
    (snapshot / ".gitattributes").write_text("*.bin lfs")
    (snapshot / "original").mkdir()
    (snapshot / "original" / "consolidated.pth").write_bytes(b"x")
    loose = tmp_path / "loose"
    (loose / "nested").mkdir(parents=True)
    (loose / "tokenizer_config.json").write_text('{"model_max_length": 64}')

    out = tmp_path / "hf"
    report = export_hf(
        open_store(str(tied_copy)),
        STEP,
        str(out),
        max_shard_size=1000,
        include=[snapshot, str(loose / "nested" / ".." / "tokenizer_config.json")],
    )
    assert sorted(report.included) == sorted([*files, "tokenizer_config.json"])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*report.files, INDEX_FILE, *report.included]
    )
    for name, data in files.items():
        assert (out / name).read_bytes() == data and not (out / name).is_symlink()
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    loaded: dict[str, torch.Tensor] = {}
    for name in report.files:
        loaded.update(load_file(out / name))
    assert_same(loaded, tied_weights())


@pytest.mark.process
@pytest.mark.parametrize(
    "name",
    [
        "a\\..\\..\\escape.json",  # separators on other systems
        "tokenizer.json\x1b[2J",  # a control character
        "\u202enosj.gifnoc",  # a right-to-left override
        "\u200bconfig.json",  # a zero-width space
        "config.json ",  # a trailing space
        "\uff0e\uff0e",  # full-width dots: '..' once normalised
        "con\ufb01g.json",  # the 'fi' ligature
        "Model.safetensors",  # the export's own file, but for case
        "MODEL-00001-OF-00002.SAFETENSORS",
        "model.safetensors.index.json",
    ],
)
def test_include_refuses_names_that_escape_or_look_alike(
    tied_copy: Path, tmp_path: Path, name: str
) -> None:
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / name).write_text("{}")
    out = tmp_path / "hf"
    with pytest.raises(InvalidArgumentError, match="include"):
        export_hf(open_store(str(tied_copy)), STEP, str(out), include=[odd / name])
    if name.casefold().endswith((".safetensors", ".index.json")):  # weights: skipped in folders
        assert export_hf(open_store(str(tied_copy)), STEP, str(out), include=[odd]).included == []
        shutil.rmtree(out)
    else:
        with pytest.raises(InvalidArgumentError, match="include"):
            export_hf(open_store(str(tied_copy)), STEP, str(out), include=[odd])
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd", "tied"]


@pytest.mark.process
def test_include_refuses_two_files_of_one_name(tied_copy: Path, tmp_path: Path) -> None:
    for folder, name in (("a", "tokenizer.json"), ("b", "Tokenizer.json")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text("{}")
    store = open_store(str(tied_copy))
    with pytest.raises(InvalidArgumentError, match=r"would both be written as 'tokenizer\.json'"):
        export_hf(store, STEP, str(tmp_path / "hf"), include=[tmp_path / "a", tmp_path / "b"])
    with pytest.raises(InvalidArgumentError, match="no such file or folder"):
        export_hf(store, STEP, str(tmp_path / "hf"), include=[tmp_path / "missing.json"])
    (tmp_path / "a" / "config.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="not a JSON model config"):
        export_hf(store, STEP, str(tmp_path / "hf"), include=[tmp_path / "a"])
    assert not (tmp_path / "hf").exists()


@pytest.mark.process
def test_include_replaces_a_file_only_with_overwrite(tied_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("old")
    victim = tmp_path / "victim.json"
    victim.write_text("outside the export")
    (out / "tokenizer.json").symlink_to(victim)  # a planted link is replaced, never written through
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    store = open_store(str(tied_copy))
    include = [tmp_path / "config.json", tmp_path / "tokenizer.json"]
    with pytest.raises(AlreadyExistsError, match=r"already holds config\.json.*overwrite"):
        export_hf(store, STEP, str(out), include=include)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json"]
    assert (out / "config.json").read_text() == "old"

    export_hf(store, STEP, str(out), include=include, overwrite=True)
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not (out / "tokenizer.json").is_symlink()
    assert victim.read_text() == "outside the export"


# transformers -------------------------------------------------------------------------------------


def test_from_pretrained_loads_the_export(tmp_path: Path) -> None:
    """Mirrors docs/cli.md's `--include` block: an export with a config from_pretrained loads."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _save_single(tmp_path / "ckpt", model)
    template = tmp_path / "template"
    config.save_pretrained(template)
    reference = tmp_path / "reference"
    model.save_pretrained(reference, max_shard_size=20_000)  # Hugging Face's own layout

    out = tmp_path / "hf"
    report = export_hf(
        open_store(str(tmp_path / "ckpt")),
        STEP,
        str(out),
        max_shard_size=20_000,
        include=[template],
    )
    assert report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    ours = json.loads((out / INDEX_FILE).read_text())
    theirs = json.loads((reference / INDEX_FILE).read_text())
    assert ours["metadata"] == theirs["metadata"]  # total_parameters and total_size
    assert sorted(ours["weight_map"]) == sorted(theirs["weight_map"])

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert_same(dict(loaded.state_dict()), {k: v.detach() for k, v in model.state_dict().items()})
    tokens = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


TINY_FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 16, "n_layer": 1, "n_head": 2}),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "ffn_dim": 32},
    ),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2},
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        {
            "d_model": 16,
            "encoder_layers": 1,
            "decoder_layers": 1,
            "encoder_attention_heads": 2,
            "decoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "decoder_ffn_dim": 32,
        },
    ),
}


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tie_rule_matches_save_pretrained(tmp_path: Path, family: str) -> None:
    transformers = pytest.importorskip("transformers")
    config_name, model_name, sizes = TINY_FAMILIES[family]
    config = getattr(transformers, config_name)(vocab_size=40, max_position_embeddings=32, **sizes)
    torch.manual_seed(SEED)
    model = getattr(transformers, model_name)(config).eval()
    _save_single(tmp_path / "ckpt", model)
    config.save_pretrained(tmp_path / "template")
    model.save_pretrained(tmp_path / "reference")
    out = tmp_path / "hf"
    report = export_hf(
        open_store(str(tmp_path / "ckpt")), STEP, str(out), include=[tmp_path / "template"]
    )
    assert report.tied  # every one of these families ties its head to its embeddings
    reference = tmp_path / "reference" / "model.safetensors"
    assert _header_names(out / "model.safetensors") == _header_names(reference)
    loaded = getattr(transformers, model_name).from_pretrained(out).eval()
    assert_same(dict(loaded.state_dict()), {k: v.detach() for k, v in model.state_dict().items()})
