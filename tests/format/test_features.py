"""The format versioning scheme: a layout version plus named features a reader must understand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spotckpt.catalog import Catalog
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.errors import UnknownFormatError
from spotckpt.format import features
from spotckpt.format.features import format_string, parse_format
from spotckpt.format.index import INDEXED_FORMAT
from spotckpt.format.manifest import FORMAT_VERSION, Manifest
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store

LAYOUTS = (FORMAT_VERSION, INDEXED_FORMAT)


@pytest.fixture
def known_feature(monkeypatch: pytest.MonkeyPatch) -> str:
    """A feature this spotckpt reads, for as long as the test runs."""
    monkeypatch.setattr(features, "KNOWN_FEATURES", frozenset({"alpha", "beta"}))
    return "alpha"


def test_a_featureless_manifest_keeps_the_old_spelling() -> None:
    assert format_string(FORMAT_VERSION) == "spotckpt/1"
    assert format_string(INDEXED_FORMAT, []) == "spotckpt/2"


def test_features_have_one_spelling(known_feature: str) -> None:
    assert format_string(INDEXED_FORMAT, ["beta", "alpha", "beta"]) == "spotckpt/2+alpha+beta"
    assert parse_format("spotckpt/2+beta+alpha", LAYOUTS) == (
        INDEXED_FORMAT,
        frozenset({"alpha", "beta"}),
    )


def test_a_writer_cannot_use_a_feature_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="unknown manifest feature"):
        format_string(FORMAT_VERSION, ["from-the-future"])


@pytest.mark.parametrize(
    "declared, match",
    [
        ("spotckpt/99", "unknown manifest format"),
        ("spotckpt/1+from-the-future", r"feature\(s\) \['from-the-future'\].*upgrade spotckpt"),
        ("spotckpt/1+alpha+from-the-future", "from-the-future"),
        ("Spotckpt/1", "unknown manifest format"),
        ("spotckpt/1 ", "unknown manifest format"),
        (7, "unknown manifest format"),
        (None, "unknown manifest format"),
        ("spotckpt/1+" + "a" * 1000, "unknown manifest format"),
    ],
)
def test_unknown_layouts_and_features_are_refused(
    known_feature: str, declared: object, match: str
) -> None:
    with pytest.raises(UnknownFormatError, match=match):
        parse_format(declared, LAYOUTS)


def _flat(root: Path) -> None:
    writer = ObjectStoreWriter(open_store(str(root)), 1)
    dcp.save(
        {"w": torch.arange(8.0)},
        storage_writer=writer,
        planner=writer.save_planner(1),
        no_dist=True,
    )


def _indexed(root: Path) -> None:
    writer = ObjectStoreWriter(open_store(str(root)), 1, WriterOptions(index_parts=True))
    dcp.save(
        {"w": torch.arange(8.0)},
        storage_writer=writer,
        planner=writer.save_planner(1),
        no_dist=True,
    )


def _declare(root: Path, declared: str) -> None:
    path = root / manifest_key(1)
    document = json.loads(path.read_text())
    document["format"] = declared
    path.write_text(json.dumps(document))


@pytest.mark.parametrize(("save", "layout"), [(_flat, FORMAT_VERSION), (_indexed, INDEXED_FORMAT)])
def test_a_manifest_naming_an_unknown_feature_is_not_read(
    tmp_path: Path, save: object, layout: str
) -> None:
    save(tmp_path)  # type: ignore[operator]
    catalog = Catalog(open_store(str(tmp_path)))
    assert catalog.read_manifest(1).format == layout
    _declare(tmp_path, layout + "+from-the-future")
    with pytest.raises(UnknownFormatError, match="from-the-future"):
        catalog.read_manifest(1)


@pytest.mark.parametrize(("save", "layout"), [(_flat, FORMAT_VERSION), (_indexed, INDEXED_FORMAT)])
def test_a_manifest_naming_a_known_feature_keeps_it(
    tmp_path: Path, known_feature: str, save: object, layout: str
) -> None:
    save(tmp_path)  # type: ignore[operator]
    _declare(tmp_path, f"{layout}+{known_feature}")
    manifest = Catalog(open_store(str(tmp_path))).read_manifest(1)
    assert manifest.format == f"{layout}+{known_feature}"
    assert manifest.features == {known_feature}


def test_a_flat_manifest_round_trips_its_features(tmp_path: Path, known_feature: str) -> None:
    _flat(tmp_path)
    _declare(tmp_path, f"{FORMAT_VERSION}+{known_feature}")
    manifest = Catalog(open_store(str(tmp_path))).read_manifest(1)
    again = Manifest.from_json(manifest.to_json(), expected_step=1)
    assert again.features == {known_feature}
