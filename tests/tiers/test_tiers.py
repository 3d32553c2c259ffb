"""The fast tier: placement, erasure coding, and restores from the nearest surviving copy.

"Nodes" are gloo rank processes, each with its own ``SPOTCKPT_NODE`` and its own machine folder
(`tier_worker`: a private mount namespace per rank, so no rank can read another machine's disk);
a lost node is a rank killed by SIGKILL whose folder is then deleted. The
bucket's rank objects are deleted before a restore that must not touch the bucket, so a read
of one would fail the restore rather than only show in a counter.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager, Config
from spotckpt.catalog import Catalog
from spotckpt.errors import IncompleteRestoreError, InvalidArgumentError, ManifestError
from spotckpt.redundancy import parse_redundancy
from spotckpt.storage import open_store
from spotckpt.tiers.erasure import data_block, parity_block
from spotckpt.tiers.folder import folder_id, resolve_local_dir
from spotckpt.tiers.node import NodeIdentity, node_identity
from spotckpt.tiers.record import GroupRecord, ParityRecord, TierRecord
from spotckpt.tiers.recovery import HeldStep, NodeReport, Scope, choose_step, merge_ranges
from spotckpt.tiers.redundancy import Placement

from tests_support import corrupt_keeping_crc32c
from tier_worker import finish, launch_nodes, node_folder, run_nodes

NODES = [f"node{i}" for i in range(4)]


# Specs and placement -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["replicate:0", "ec:2", "ec:0+1", "ec:2+0", "raid5", "replicate:2 ", "ec:200+100"]
)
def test_bad_redundancy_specs_are_refused(spec: str) -> None:
    with pytest.raises(InvalidArgumentError, match="redundancy must be"):
        parse_redundancy(spec)


def test_replicas_go_to_the_next_nodes_in_other_zones_first() -> None:
    identities = [NodeIdentity(f"n{i}", "a" if i < 2 else "b") for i in range(4)]
    placement = Placement(parse_redundancy("replicate:2"), identities)
    assert placement.ring == ["n0", "n2", "n1", "n3"]
    for rank in range(4):
        (holder,) = placement.replica_holders(rank)
        assert identities[holder].zone != identities[rank].zone


def test_several_ranks_per_node_copy_to_the_same_local_rank_elsewhere() -> None:
    identities = [NodeIdentity(f"n{r // 2}") for r in range(6)]
    placement = Placement(parse_redundancy("replicate:3"), identities)
    assert placement.replica_holders(1) == [3, 5]
    assert placement.leader("n1") == 2 and placement.is_leader(2) and not placement.is_leader(3)


def test_erasure_groups_cover_every_rank_and_keep_members_apart() -> None:
    identities = [NodeIdentity(f"n{i}") for i in range(5)]
    placement = Placement(parse_redundancy("ec:2+1"), identities)
    covered = {rank for group in placement.groups for rank in group.data}
    assert covered == set(range(5))
    for group in placement.groups:
        assert len(set(group.data) | set(group.parity)) == 3


@pytest.mark.parametrize(
    ("spec", "nodes", "per_node"),
    [
        ("replicate:1", 2, 1),
        ("replicate:2", 2, 1),
        ("replicate:2", 4, 2),
        ("replicate:3", 5, 1),
        ("ec:2+1", 3, 1),
        ("ec:2+1", 5, 2),
        ("ec:3+2", 6, 1),
    ],
)
def test_what_survives_the_loss_of_any_set_of_nodes(spec: str, nodes: int, per_node: int) -> None:
    """An emergency save counts the fast tier only if its copies outlive the evicted nodes:
    every subset of lost nodes, against the spec's promise (any F-1, or any M, may go)."""
    identities = [NodeIdentity(f"n{r // per_node}") for r in range(nodes * per_node)]
    redundancy = parse_redundancy(spec)
    placement = Placement(redundancy, identities)
    names = [f"n{i}" for i in range(nodes)]
    tolerated = redundancy.parity if redundancy.erasure else redundancy.copies - 1
    for size in range(nodes + 1):
        for lost in itertools.combinations(names, size):
            survives = placement.survives(set(lost))
            if size <= tolerated:
                assert survives, (spec, lost)
            if size == nodes:
                assert not survives, (spec, lost)
            if survives:  # fewer losses never hurt
                for smaller in itertools.combinations(lost, max(0, size - 1)):
                    assert placement.survives(set(smaller)), (spec, lost, smaller)
            readable = all(  # every rank's object: itself or a copy off the lost nodes
                any(placement.node_of(h) not in lost for h in [r, *placement.replica_holders(r)])
                for r in range(len(identities))
            )
            decodable = all(
                sum(placement.node_of(m) not in lost for m in g.data + g.parity) >= len(g.data)
                for g in placement.groups
            )
            assert survives == (decodable if redundancy.erasure else readable), (spec, lost)


def test_too_few_nodes_for_the_spec_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgumentError, match=r"needs at least 3 nodes.*runs on 2"):
        Placement(parse_redundancy("ec:2+1"), [NodeIdentity("a"), NodeIdentity("b")])


def test_node_names_that_could_escape_the_folder_are_refused() -> None:
    for bad in ["../x", "a/b", ".hidden", "x" * 64, "n\n"]:
        with pytest.raises(InvalidArgumentError):
            node_identity({"SPOTCKPT_NODE": bad})
    assert node_identity({"SPOTCKPT_NODE": "gpu-7", "SPOTCKPT_ZONE": "us-east-1a"}) == (
        NodeIdentity("gpu-7", "us-east-1a")
    )


def test_node_and_zone_variables_are_not_taken_for_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPOTCKPT_NODE", "n1")
    monkeypatch.setenv("SPOTCKPT_ZONE", "z")
    monkeypatch.setenv("SPOTCKPT_LOCAL_DIR", "/nvme/{node}")
    monkeypatch.setenv("SPOTCKPT_REDUNDANCY", "ec:4+2")
    config = Config.load(uri="s3://b/r")
    assert (config.local_dir, config.redundancy) == ("/nvme/{node}", "ec:4+2")


# Erasure coding and recovery planning --------------------------------------------------------


def test_any_k_of_k_plus_m_blocks_give_back_every_data_block() -> None:
    rng = random.Random(7)
    data_count, parity = 3, 2
    blocks = [rng.randbytes(1000) for _ in range(data_count)]
    pieces = dict(enumerate(blocks))
    pieces.update({data_count + j: parity_block(blocks, parity, j) for j in range(parity)})
    for lost in [(0, 1), (1, 2), (0, 4), (2, 3), (3, 4)]:
        left = {n: b for n, b in pieces.items() if n not in lost}
        for index in range(data_count):
            assert data_block(left, data_count, parity, index) == blocks[index]


def _held(step: int, keys: set[str], objects: dict[str, int]) -> HeldStep:
    return HeldStep(
        step, f"d{step}", objects, frozenset(keys), TierRecord(step, "a", "replicate:2")
    )


def test_the_newest_step_with_every_object_somewhere_wins_and_others_say_why() -> None:
    objects = {"a/r0": 10, "a/r1": 10}
    reports = [
        NodeReport("n0", "", 0, (_held(8, {"a/r0"}, objects), _held(6, {"a/r0"}, objects))),
        NodeReport("n1", "", 1, (_held(6, {"a/r1"}, objects),)),
    ]
    choice, reasons = choose_step(reports, not_older_than=4)
    assert choice is not None and choice.step == 6
    assert reasons == [
        "fast-tier step 8: no intact copy survives of a/r1 (1 node(s) hold the step)"
    ]
    assert choose_step(reports, not_older_than=7)[0] is None


def test_ranges_merge() -> None:
    assert merge_ranges([(5, 9), (0, 2), (2, 4), (8, 12), (20, 20)]) == [(0, 4), (5, 12)]


JOB = "0123456789abcdef0123456789abcdef"


def test_forged_tier_records_are_refused() -> None:
    good = TierRecord(5, "abc", "ec:2+1", job=JOB).to_json()
    assert TierRecord.from_json(good, step=5, attempt="abc").job == JOB
    with pytest.raises(ManifestError, match="not the manifest"):
        TierRecord.from_json(good, step=6, attempt="abc")
    forged = json.loads(good)
    forged["groups"] = [{"data": ["../../etc/passwd"], "parity": [], "block_size": 1}]
    with pytest.raises(ManifestError, match="malformed"):
        TierRecord.from_json(json.dumps(forged).encode(), step=5, attempt="abc")


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda d: b"", "not valid JSON"),
        (lambda d: d[: len(d) // 2], "not valid JSON"),
        (lambda d: b"\xff" + d, "not UTF-8"),
        (lambda d: d.replace(b'"groups": []', b'"groups": [' + b"[" * 100 + b"]" * 100), "nests"),
        (lambda d: d.replace(b'"step": 5', b'"step": ' + b"9" * 5000), "digits"),
        (lambda d: d.replace(JOB.encode(), b"../x"), "not a job id"),
        (lambda d: d.replace(b'"replicate:2"', b'"raid5"'), "malformed"),
        (lambda d: d.replace(b'"groups": []', b'"groups": [7]'), "malformed"),
        (lambda d: d.replace(b'"groups": []', b'"groups": [{"data": []}]'), "malformed"),
    ],
)
def test_damaged_tier_records_are_manifest_errors(damage: Any, why: str) -> None:
    """Whatever a crash or a forger leaves, a record is a ManifestError (the tier step is then
    unusable), never another exception."""
    good = TierRecord(5, "abc", "replicate:2", job=JOB).to_json()
    with pytest.raises(ManifestError, match=why):
        TierRecord.from_json(damage(good), step=5, attempt="abc")


def test_record_numbers_must_fit_the_manifest_before_use() -> None:
    sizes = {"a-abc/r00000-000.safetensors": 100, "a-abc/r00001-000.safetensors": 70}
    parity = ParityRecord("a-abc/parity-g00000-p000.ec", 100, 7)
    group = GroupRecord(tuple(sizes), (parity,), 100)
    TierRecord(5, "abc", "ec:2+1", (group,), JOB).check(sizes)
    forged = [
        dataclasses.replace(group, block_size=10**17),
        dataclasses.replace(group, parity=(dataclasses.replace(parity, size=10**17),)),
        dataclasses.replace(group, parity=(dataclasses.replace(parity, key="a-abc/other"),)),
        dataclasses.replace(group, data=("a-abc/r00000-000.safetensors", "a-abc/elsewhere")),
    ]
    for bad in forged:
        with pytest.raises(ManifestError, match="tier record of step 5"):
            TierRecord(5, "abc", "ec:2+1", (bad,), JOB).check(sizes)
    huge = json.loads(TierRecord(5, "abc", "ec:2+1", (group,), JOB).to_json())
    huge["groups"][0]["block_size"] = 2**63
    with pytest.raises(ManifestError, match="malformed"):
        TierRecord.from_json(json.dumps(huge).encode(), step=5, attempt="abc")


def test_a_scope_admits_only_this_jobs_steps_and_never_another_commit_of_the_durable_step() -> None:
    scope = Scope(JOB, durable=4, durable_attempt="bucket")
    assert scope.refusal(6, "later", JOB) is None
    assert scope.refusal(4, "bucket", JOB) is None  # the very commit the bucket holds
    assert "another commit" in str(scope.refusal(4, "other", JOB))
    assert "older than" in str(scope.refusal(3, "bucket", JOB))
    assert "another job" in str(scope.refusal(6, "later", "f" * 32))
    assert "names no job" in str(scope.refusal(6, "later", None))
    assert "no job identity" in str(Scope(None).refusal(6, "later", JOB))
    assert Scope(JOB).refusal(6, "later", JOB) is None  # nothing durable yet


def test_a_step_damaged_on_one_node_or_recorded_differently_is_unusable_everywhere() -> None:
    objects = {"a/r0": 10, "a/r1": 10}
    reports = [
        NodeReport("n0", "", 0, (_held(6, {"a/r0", "a/r1"}, objects),)),
        NodeReport("n1", "", 1, (_held(6, {"a/r1"}, objects),), ((8, "truncated"),)),
    ]
    assert choose_step(reports, None)[0] is not None
    damaged = [reports[0], dataclasses.replace(reports[1], damaged=((6, "truncated"),))]
    choice, reasons = choose_step(damaged, None)
    assert choice is None and reasons == ["fast-tier step 6 is damaged on node n1: truncated"]
    other = dataclasses.replace(reports[1].steps[0], record=TierRecord(6, "a", "replicate:3"))
    disagreeing = [reports[0], dataclasses.replace(reports[1], steps=(other,))]
    choice, reasons = choose_step(disagreeing, None)
    assert choice is None and reasons == ["fast-tier step 6: its nodes hold different tier records"]


# One process: the tier alone ----------------------------------------------------------------


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(512, 128), "b": torch.randn(128)}  # w: four 64 KiB blocks


@pytest.mark.process
def test_a_missing_or_unwritable_local_dir_fails_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        CheckpointManager(str(tmp_path / "b"), local_dir=str(tmp_path / "no" / "{node}"))
    with pytest.raises(InvalidArgumentError, match="not writable"):
        CheckpointManager(str(tmp_path / "b"), local_dir="/proc/{node}", preemption=False)


def test_fast_saves_between_durable_ones_restore_from_the_tier(tmp_path: Path) -> None:
    (tmp_path / "fast").mkdir()
    options = {"local_dir": str(tmp_path / "fast" / "{node}"), "preemption": False}
    mgr = CheckpointManager(
        str(tmp_path / "bucket"), interval_steps=4, local_interval_steps=1, **options
    )
    saved = {}
    for step in range(1, 7):
        state = _state(step)
        saved[step] = {k: v.clone() for k, v in state.items()}
        mgr.maybe_save(step, state)
    mgr.close()
    assert mgr.steps() == [4]  # fast saves are not durable commits
    fresh = _state(0)
    again = CheckpointManager(str(tmp_path / "bucket"), **options)
    assert again.restore(fresh) == 6
    assert again.last_restore_sources["store"] == 0 and again.last_restore_sources["local"] > 0
    assert all(torch.equal(fresh[k], saved[6][k]) for k in fresh)
    again.close()


def test_no_room_in_the_tier_skips_the_fast_save_with_a_warning(
    small_disk: Path | None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert small_disk is not None, "no small real disk could be mounted here (needs mount)"
    mgr = CheckpointManager(
        str(tmp_path / "bucket"),
        local_dir=str(small_disk / "{node}"),
        interval_steps=2,
        local_interval_steps=1,
        preemption=False,
    )
    big = {"w": torch.ones(1 << 19)}  # 2 MiB: more than the 1 MiB disk
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        mgr.maybe_save(1, big)  # fast only: skipped
        mgr.maybe_save(2, big)  # durable: straight to the store
    assert "not enough free space" in caplog.text
    assert mgr.steps() == [2]
    small = {"w": torch.ones(16), "blob": "x" * 1_200_000}  # the estimate counts tensors only
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        mgr.maybe_save(3, small)  # the write itself runs out of space: a warning, no error
    assert "fast-tier save of step 3 failed" in caplog.text
    mgr.close()


# One process: what a tier step must be to be used ----------------------------------------------


def _tier_options(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "fast").mkdir(parents=True, exist_ok=True)
    return {"local_dir": str(tmp_path / "fast" / "{node}"), "preemption": False}


def _run(bucket: Path, options: dict[str, Any], steps: range, seed: int = 0, **kw: Any) -> Any:
    """Save `steps` through `maybe_save` (each step's state seeded by seed + step); returns
    the states saved, by step."""
    mgr = CheckpointManager(str(bucket), **options, **kw)
    saved = {}
    for step in steps:
        state = _state(seed + step)
        saved[step] = {k: v.clone() for k, v in state.items()}
        mgr.maybe_save(step, state)
    mgr.close()
    return saved


def _restored(bucket: Path, options: dict[str, Any]) -> tuple[int | None, Any, dict[str, int]]:
    """A restore into a fresh state: its step, the state, and where its bytes came from."""
    fresh = _state(0)
    mgr = CheckpointManager(str(bucket), **options)
    step = mgr.restore(fresh)
    mgr.close()
    return step, fresh, mgr.last_restore_sources


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tier_steps(tmp_path: Path) -> list[int]:
    (node,) = (tmp_path / "fast").iterdir()
    return sorted(int(p.name.removeprefix("step-")) for p in node.glob("step-*"))


def test_a_tier_step_is_used_only_by_the_job_that_wrote_it(tmp_path: Path) -> None:
    """Two runs on one machine share its local_dir: one's tier steps are never the other's."""
    options = _tier_options(tmp_path)
    _run(tmp_path / "a", options, range(1, 8), interval_steps=100, local_interval_steps=1)
    untouched = _state(0)
    step, state, _ = _restored(tmp_path / "b", options)  # an empty bucket: nothing to restore
    assert step is None and _same_state(state, untouched)

    ours = _run(tmp_path / "c", {"preemption": False}, range(7, 8), seed=70, interval_steps=1)
    _run(tmp_path / "a", options, range(1, 8), interval_steps=100, local_interval_steps=1)
    step, state, sources = _restored(tmp_path / "c", options)  # A's tier step 7 is not C's 7
    assert step == 7 and _same_state(state, ours[7]) and sources["store"] > 0


def test_the_durable_step_comes_from_the_tier_only_when_it_is_that_very_commit(
    tmp_path: Path,
) -> None:
    options = _tier_options(tmp_path)
    durable = _run(tmp_path / "b", options, range(1, 3), interval_steps=2, local_interval_steps=1)
    step, state, sources = _restored(tmp_path / "b", options)
    assert step == 2 and _same_state(state, durable[2]) and sources["store"] == 0
    # The same job saves step 2 again, to the tier only: another commit of the step number.
    _run(tmp_path / "b", options, range(2, 3), seed=20, interval_steps=100, local_interval_steps=1)
    step, state, sources = _restored(tmp_path / "b", options)
    assert step == 2 and _same_state(state, durable[2]) and sources["store"] > 0


def test_a_tier_record_without_a_job_is_not_used_and_the_bucket_is(tmp_path: Path) -> None:
    """Records written before job identities: the bucket's step is restored, not the tier's."""
    options = _tier_options(tmp_path)
    saved = _run(tmp_path / "b", options, range(1, 4), interval_steps=2, local_interval_steps=1)
    for record in (tmp_path / "fast").glob("*/step-*/tier.json"):
        document = json.loads(record.read_bytes())
        del document["job"]
        record.write_text(json.dumps(document))
    step, state, sources = _restored(tmp_path / "b", options)
    assert step == 2 and _same_state(state, saved[2]) and sources["store"] > 0


@pytest.mark.parametrize(
    "damage",
    [
        lambda data, keys: b"",
        lambda data, keys: data[: len(data) // 2],
        lambda data, keys: b"\0" * len(data),
        lambda data, keys: data.replace(b'"step": 3', b'"step": 2'),
        lambda data, keys: data.replace(b'"groups": []', _groups(keys, 10**17)),
        lambda data, keys: data.replace(b'"groups": []', _groups(keys, 10**30)),
    ],
    ids=["empty", "truncated", "zeros", "forged-step", "forged-block-size", "huge-number"],
)
def test_a_damaged_tier_record_is_skipped_for_older_steps_with_a_warning(
    tmp_path: Path, damage: Any, caplog: pytest.LogCaptureFixture
) -> None:
    options = _tier_options(tmp_path)
    saved = _run(tmp_path / "b", options, range(1, 4), interval_steps=2, local_interval_steps=1)
    (record,) = (tmp_path / "fast").glob("*/step-000000003/tier.json")
    (manifest,) = (tmp_path / "fast").glob("*/step-000000003/manifest.json")
    keys = [entry["key"] for entry in json.loads(manifest.read_bytes())["objects"]]
    record.write_bytes(damage(record.read_bytes(), keys))
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        step, state, _ = _restored(tmp_path / "b", options)
    assert step == 2 and _same_state(state, saved[2])
    assert re.search(r"fast-tier step 3 on node \S+ is damaged and not used", caplog.text)


def _groups(keys: list[str], block_size: int) -> bytes:
    groups = [{"data": keys, "parity": [], "block_size": block_size}]
    return b'"groups": ' + json.dumps(groups).encode()


@pytest.mark.process
def test_tier_records_and_manifests_are_fsynced_before_and_after_their_rename(
    tmp_path: Path,
) -> None:
    """Seen in the system calls: each is fsynced under its temporary name, linked into place,
    and its folder fsynced, so a host crash leaves the whole record or none."""
    assert shutil.which("strace"), "strace is needed to see the system calls"
    (tmp_path / "fast").mkdir()
    script = (
        "import sys, torch; from spotckpt import CheckpointManager\n"
        "m = CheckpointManager(sys.argv[1], local_dir=sys.argv[2], local_interval_steps=1,"
        " preemption=False)\n"
        "m.maybe_save(1, {'w': torch.ones(8)}); m.close()\n"
    )
    trace = tmp_path / "trace.txt"
    strace = ["strace", "-f", "-y", "-o", str(trace), "-e", "trace=fsync,linkat"]
    done = subprocess.run(
        [*strace, sys.executable, "-c", script, str(tmp_path / "b"), str(tmp_path / "fast/{node}")],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    calls = trace.read_text().splitlines()
    for name in ("tier.json", "manifest.json"):
        (link,) = [i for i, c in enumerate(calls) if "linkat(" in c and f'"{name}"' in c]
        folder = calls[link].split("<", 1)[1].split(">", 1)[0]
        assert folder.endswith("/step-000000001") and "/fast/" in folder
        temp = f"{folder}/.spotckpt-tmp-{name}."
        assert any("fsync(" in c and f"<{temp}" in c for c in calls[:link]), name
        assert any(c.split()[1].startswith("fsync(") and f"<{folder}>" in c for c in calls[link:])


def test_a_tier_load_that_fails_after_writing_into_the_state_never_returns_none(
    tmp_path: Path,
) -> None:
    """It completes from an older step (here the bucket's, from the tier's copy of that very
    commit), or raises: never "nothing restored" over a changed state."""
    options = _tier_options(tmp_path)
    saved = _run(tmp_path / "b", options, range(1, 4), interval_steps=2, local_interval_steps=1)
    (obj,) = (tmp_path / "fast").glob("*/step-000000003/a-*/r00000-000.safetensors")
    corrupt_keeping_crc32c(obj)  # the node's whole-object check passes; the load's does not
    step, state, _ = _restored(tmp_path / "b", options)
    assert step == 2 and _same_state(state, saved[2])


def test_a_tier_step_that_fails_to_load_is_set_aside_and_the_older_tier_step_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No bucket step: the tier's older step completes the restore, with a warning and an
    event, and the step that failed no longer counts as committed in the tier."""
    options = _tier_options(tmp_path)
    saved = _run(tmp_path / "b", options, range(1, 4), local_interval_steps=1)
    (obj,) = (tmp_path / "fast").glob("*/step-000000003/a-*/r00000-000.safetensors")
    corrupt_keeping_crc32c(obj)
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        step, state, sources = _restored(tmp_path / "b", options)
    assert step == 2 and _same_state(state, saved[2]) and sources["store"] == 0
    assert "fast-tier copy of step 3 did not load" in caplog.text and "set aside" in caplog.text
    (event,) = (tmp_path / "b" / "events").glob("*-quarantine-*.json")
    document = json.loads(event.read_bytes())
    assert (document["step"], document["tier"]) == (3, True), document
    assert "CRC32C mismatch" in document["reason"], document
    assert not list((tmp_path / "fast").glob("*/step-000000003/manifest.json"))


def test_a_tier_step_that_fails_to_load_never_fails_the_next_restart(tmp_path: Path) -> None:
    """Every tier step fails to load and the bucket has none: that restore raises (the state
    is half written), but the steps are set aside, so the next one starts from nothing
    instead of failing the same way for ever."""
    options = _tier_options(tmp_path)
    _run(tmp_path / "b", options, range(1, 4), local_interval_steps=1)
    for step in (2, 3):
        (obj,) = (tmp_path / "fast").glob(f"*/step-00000000{step}/a-*/r00000-000.safetensors")
        corrupt_keeping_crc32c(obj)
    with pytest.raises(IncompleteRestoreError, match=r"fast-tier step 2: .*holds no committed"):
        _restored(tmp_path / "b", options)
    for step in (2, 3):
        (record,) = (tmp_path / "fast").glob(f"*/step-00000000{step}/quarantined-*/reason.json")
        assert "CRC32C mismatch" in json.loads(record.read_bytes())["reason"]
    untouched = _state(0)
    step, state, _ = _restored(tmp_path / "b", options)
    assert step is None and _same_state(state, untouched)


def test_retention_removes_other_jobs_uncommitted_and_stale_folders(tmp_path: Path) -> None:
    options = _tier_options(tmp_path)
    _run(tmp_path / "a", options, range(1, 7), interval_steps=100, local_interval_steps=1)
    (node,) = (tmp_path / "fast").iterdir()
    assert _tier_steps(tmp_path) == [5, 6]  # another job's committed steps
    (node / "step-000000003" / "a-dead").mkdir(parents=True)  # an interrupted save
    (node / "step-000000003" / "a-dead" / "r00000-000.safetensors").write_bytes(b"x" * 100)
    (node / "step-000000009").mkdir()  # a stale newer one, only a killed write's temp file
    (node / "step-000000009" / ".spotckpt-tmp-tier.json.0123").write_bytes(b"{")
    for step in range(1, 4):
        _run(tmp_path / "b", options, range(step, step + 1), local_interval_steps=1)
        assert len(_tier_steps(tmp_path)) <= 2
    assert _tier_steps(tmp_path) == [2, 3]


# Nodes ----------------------------------------------------------------------------------------


def _args(tmp_path: Path, uri: str, redundancy: str | None, **extra: Any) -> dict[str, Any]:
    (tmp_path / "fast").mkdir(exist_ok=True)
    (tmp_path / "out").mkdir(exist_ok=True)
    return {
        "uri": uri,
        "local_dir": str(tmp_path / "fast" / "{node}"),
        "redundancy": redundancy,
        "interval_steps": 4,
        "local_interval_steps": 2,
        "steps": 7,
        "out": str(tmp_path / "out"),
        **extra,
    }


def _lose(args: dict[str, Any], nodes: list[str]) -> None:
    for node in nodes:
        shutil.rmtree(node_folder(args, node))


def _drop_bucket_objects(bucket: Path) -> None:
    """Leave only the manifests: restoring from the bucket now fails on the first read."""
    objects = list(bucket.glob("step-*/a-*/**/*.safetensors"))
    assert objects
    for path in objects:
        path.unlink()


def _same(restored: Path, expected: Path) -> None:
    a, b = torch.load(restored, weights_only=True), torch.load(expected, weights_only=True)
    _equal(a, b)


def _equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _sources(tmp_path: Path, world: int) -> dict[str, Any]:
    return json.loads((tmp_path / "out" / f"sources-{world}.json").read_text())


def _save_and_kill(nodes: list[str], args: dict[str, Any]) -> None:
    results = finish(launch_nodes(nodes, "save_then_die", args))
    for rank, (status, output) in enumerate(results):
        wanted = -signal.SIGKILL if rank in args.get("kill", []) else 0
        assert status == wanted, f"rank {rank} exited {status}:\n{output[-6000:]}"


@pytest.mark.process
@pytest.mark.parametrize(
    ("redundancy", "count", "lost"),
    [("replicate:2", 4, [2]), ("ec:2+1", 3, [1]), ("ec:2+2", 4, [1, 2])],
)
def test_lost_nodes_restore_from_peers_without_the_bucket(
    tmp_path: Path, redundancy: str, count: int, lost: list[int]
) -> None:
    """Mirrors docs/fast-tier.md's set-up: a local_dir per node, fast saves, replicate:2 or EC."""
    nodes = NODES[:count]
    args = _args(tmp_path, str(tmp_path / "bucket"), redundancy, kill=lost)
    _save_and_kill(nodes, args)
    _lose(args, [nodes[i] for i in lost])
    _drop_bucket_objects(tmp_path / "bucket")
    run_nodes(nodes, "restore", args)
    found = _sources(tmp_path, count)
    assert found["step"] == 6  # the newest fast save, past the durable step 4
    assert found["sources"]["store"] == 0 and found["sources"]["peer"] > 0
    _same(tmp_path / "out" / f"restored-{count}.pt", tmp_path / "out" / "expected-6.pt")


@pytest.mark.process
def test_too_many_lost_nodes_fall_back_to_the_durable_step_and_say_why(tmp_path: Path) -> None:
    args = _args(tmp_path, str(tmp_path / "bucket"), "replicate:2", kill=[1, 2])
    _save_and_kill(NODES, args)
    _lose(args, ["node1", "node2"])  # rank 1's object lived on nodes 1 and 2 only
    outputs = run_nodes(NODES, "restore", args)
    assert "fast-tier step 6: no intact copy survives of" in outputs[0]
    assert "r00001-000.safetensors" in outputs[0]
    found = _sources(tmp_path, 4)
    assert found["step"] == 4 and found["sources"]["store"] > 0
    _same(tmp_path / "out" / "restored-4.pt", tmp_path / "out" / "expected-4.pt")


@pytest.mark.process
def test_corrupt_copies_are_skipped_for_intact_ones_then_for_an_older_step(tmp_path: Path) -> None:
    args = _args(tmp_path, str(tmp_path / "bucket"), "replicate:2")
    run_nodes(NODES, "save_then_die", args)

    def corrupt(node: str) -> None:
        (path,) = node_folder(args, node).glob("step-000000006/a-*/r00000-000.safetensors")
        with path.open("r+b") as file:
            file.seek(path.stat().st_size // 2)
            file.write(b"\xff" * 64)

    corrupt("node0")  # rank 0's own copy; node1 keeps an intact one
    run_nodes(NODES, "restore", args)
    found = _sources(tmp_path, 4)
    assert found["step"] == 6 and found["sources"]["store"] == 0
    _same(tmp_path / "out" / "restored-4.pt", tmp_path / "out" / "expected-6.pt")
    corrupt("node0")
    corrupt("node1")  # now no intact copy of rank 0's object: step 4 (also in the tiers)
    outputs = run_nodes(NODES, "restore", args)
    assert "fast-tier step 6: no intact copy survives of" in outputs[0]
    found = _sources(tmp_path, 4)
    assert found["step"] == 4 and found["sources"]["store"] == 0
    _same(tmp_path / "out" / "restored-4.pt", tmp_path / "out" / "expected-4.pt")


@pytest.mark.process
def test_restore_on_another_world_size_from_fast_tier_copies(tmp_path: Path) -> None:
    args = _args(tmp_path, str(tmp_path / "bucket"), "replicate:2")
    run_nodes(NODES, "save_then_die", args)
    job = Catalog(open_store(str(tmp_path / "bucket"))).job()
    records = [json.loads(p.read_bytes()) for p in tmp_path.glob("machines/*/*/step-*/tier.json")]
    assert job is not None and len(records) == 8  # steps 4 and 6 on each of the four nodes
    assert {record["job"] for record in records} == {job.id}  # shared with every rank
    _drop_bucket_objects(tmp_path / "bucket")
    # Two of the four machines come back: between them they hold every object once.
    run_nodes(["node0", "node2"], "restore", args)
    found = _sources(tmp_path, 2)
    assert found["step"] == 6 and found["sources"]["store"] == 0
    _same(tmp_path / "out" / "restored-2.pt", tmp_path / "out" / "expected-6.pt")


@pytest.mark.parametrize("noticed", [["node1"], ["node0", "node1"]], ids=["one node", "both"])
def test_sigterm_saves_where_the_step_outlives_the_evicted_nodes(
    tmp_path: Path, s3_uri: str, noticed: list[str]
) -> None:
    """The tier's upload predicted not to fit the notice. One node evicted: the emergency save
    stays in the tier and its peer, and a restart without that node's disk reads 0 bucket bytes.
    Both nodes evicted: every tier copy goes with them, so the step is uploaded all the same,
    and a restart with no disk left resumes from the bucket."""
    args = _args(
        tmp_path, s3_uri, "replicate:2", interval_steps=1000, ready_at=3, drain_never_fits=True
    )
    processes = launch_nodes(NODES[:2], "evicted", args)
    ready = tmp_path / "out" / "ready"
    try:
        _wait_for(ready, processes)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    for node, process in zip(NODES, processes, strict=False):  # torchrun signals a node's ranks
        if node in noticed:
            os.killpg(process.pid, signal.SIGTERM)
    results = finish(processes)
    for rank, (status, output) in enumerate(results):
        assert status == 75, f"rank {rank} exited {status}:\n{output[-6000:]}"
    evicted_at = int((tmp_path / "out" / "evicted-at.txt").read_text())
    _lose(args, noticed)  # the evicted machines' disks are gone
    run_nodes(NODES[:2], "restore", args)
    found = _sources(tmp_path, 2)
    assert found["step"] == evicted_at
    if len(noticed) == 1:
        assert found["sources"]["store"] == 0
        assert "resuming will use the fast-tier copies on the surviving nodes" in results[0][1]
    else:
        assert found["sources"]["store"] > 0
        assert "no fast-tier copy that outlives the evicted nodes" in results[0][1]
    _same(tmp_path / "out" / "restored-2.pt", tmp_path / "out" / f"expected-{evicted_at}.pt")


def _wait_for(path: Path, processes: list[Any], timeout: float = 240) -> None:
    """Until `path` exists; fails at once if a rank exits first."""
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        for process in processes:
            if process.poll() is not None:
                raise AssertionError(f"a rank exited {process.returncode} before {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear within {timeout} s")
        time.sleep(0.05)


# Nodes in trouble -----------------------------------------------------------------------------


def _results(tmp_path: Path, name: str, ranks: range | list[int]) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / "out" / f"{name}-{r}.json").read_text()) for r in ranks]


@pytest.mark.process
@pytest.mark.parametrize("damage", ["forged-block-size-everywhere", "truncated-on-one-node"])
def test_a_damaged_tier_record_on_any_node_makes_every_rank_restore_an_older_step(
    tmp_path: Path, damage: str
) -> None:
    """No rank raises and none hangs: the step is unusable on every rank, the restore goes on."""
    args = _args(tmp_path, str(tmp_path / "bucket"), "ec:2+1", kill=[1])
    _save_and_kill(NODES[:3], args)
    _lose(args, ["node1"])  # its object must be rebuilt from parity: the groups are read
    records = {n: node_folder(args, n) / "step-000000006" / "tier.json" for n in ("node0", "node2")}
    if damage == "truncated-on-one-node":
        records["node2"].write_bytes(records["node2"].read_bytes()[:40])
    else:
        for record in records.values():
            document = json.loads(record.read_bytes())
            for group in document["groups"]:
                group["block_size"] = 10**17
            record.write_text(json.dumps(document))
    outputs = run_nodes(NODES[:3], "restore", args)
    assert "fast-tier step 6 on node" in "".join(outputs) and "is damaged" in "".join(outputs)
    assert [r["step"] for r in _results(tmp_path, "restore", range(3))] == [4, 4, 4]
    _same(tmp_path / "out" / "restored-3.pt", tmp_path / "out" / "expected-4.pt")


def _serve_corrupt_step_6(tmp_path: Path, args: dict[str, Any]) -> None:
    """Tier steps 4 and 6 on four nodes (replicate:2), node1 lost: rank 1's object of step 6
    comes from node2's copy, whose bytes are flipped so that node2's whole-object check passes
    and the load's block checks fail, on rank 1 after the other ranks loaded theirs. The bucket
    has no committed step (its step 4's manifest is held aside, in `held-manifest.json`)."""
    run_nodes(NODES, "save_then_die", args)
    _lose(args, ["node1"])
    (copy,) = node_folder(args, "node2").glob("step-000000006/a-*/r00001-000.safetensors")
    corrupt_keeping_crc32c(copy)
    held = tmp_path / "bucket" / "step-000000004" / "manifest.json"
    held.rename(tmp_path / "held-manifest.json")


@pytest.mark.process
def test_a_peer_serving_corrupt_bytes_for_a_step_the_bucket_lacks_sets_it_aside_and_goes_on(
    tmp_path: Path,
) -> None:
    """The load of tier step 6 fails on every rank: the step is set aside on every node (a
    warning, an event) and the restore goes on with tier step 4; a second restart does not meet
    step 6 again."""
    args = _args(tmp_path, str(tmp_path / "bucket"), "replicate:2")
    _serve_corrupt_step_6(tmp_path, args)
    outputs = run_nodes(NODES, "restore", args)
    assert [r.get("step") for r in _results(tmp_path, "restore", range(4))] == [4, 4, 4, 4]
    assert "fast-tier copy of step 6 did not load" in outputs[0] and "set aside" in outputs[0]
    assert _sources(tmp_path, 4)["sources"]["store"] == 0
    _same(tmp_path / "out" / "restored-4.pt", tmp_path / "out" / "expected-4.pt")
    (event,) = (tmp_path / "bucket" / "events").glob("*-quarantine-*.json")
    assert json.loads(event.read_bytes())["step"] == 6
    assert not list(tmp_path.glob("machines/*/*/step-000000006/manifest.json"))
    outputs = run_nodes(NODES, "restore", args)
    assert [r.get("step") for r in _results(tmp_path, "restore", range(4))] == [4, 4, 4, 4]
    assert not any("step 6" in output for output in outputs)


@pytest.mark.process
def test_a_peer_serving_corrupt_bytes_never_leaves_a_half_restored_state_behind(
    tmp_path: Path,
) -> None:
    """With no older step anywhere, every rank raises (its state is half written); the step is
    set aside on every node that held it, so the next restart never loads it again: here it
    restores the bucket's step 4, once that is back."""
    args = _args(tmp_path, str(tmp_path / "bucket"), "replicate:2")
    _serve_corrupt_step_6(tmp_path, args)
    for node in ("node0", "node2", "node3"):
        shutil.rmtree(node_folder(args, node) / "step-000000004")
    run_nodes(NODES, "restore", args)
    for result in _results(tmp_path, "restore", range(4)):
        assert result.get("error") == "IncompleteRestoreError", result
        assert "fast-tier step 6" in result["message"]
    for node in ("node0", "node2", "node3"):
        folder = node_folder(args, node) / "step-000000006"
        assert not (folder / "manifest.json").exists(), node
        assert len(list(folder.glob("quarantined-*/reason.json"))) == 1, node
    (tmp_path / "held-manifest.json").rename(
        tmp_path / "bucket" / "step-000000004" / "manifest.json"
    )
    outputs = run_nodes(NODES, "restore", args)
    assert [r["step"] for r in _results(tmp_path, "restore", range(4))] == [4, 4, 4, 4]
    assert not any("step 6" in output for output in outputs)
    assert _sources(tmp_path, 4)["sources"]["store"] > 0
    _same(tmp_path / "out" / "restored-4.pt", tmp_path / "out" / "expected-4.pt")


def _loop_args(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    extra = {"collective_timeout_s": 60, **extra}
    return _args(tmp_path, str(tmp_path / "bucket"), "replicate:2", **extra)


def test_a_full_disk_on_one_node_in_the_copy_phase_is_a_warning_on_every_rank(
    tmp_path: Path, small_disk: Path | None
) -> None:
    """node1 has room for its own object but not for node0's copy: every rank learns it from
    the collective, skips the fast save and trains on; the durable save still reaches the
    bucket, uploaded from each rank's own copy."""
    assert small_disk is not None, "no small real disk could be mounted here (needs mount)"
    args = _loop_args(
        tmp_path, interval_steps=2, local_interval_steps=1, steps=3, blob_bytes=600_000
    )
    results = finish(
        launch_nodes(NODES[:2], "save_loop", args, disks={"node1": small_disk}), timeout=600
    )
    assert [status for status, _ in results] == [0, 0], results[1][1][-4000:]
    assert _results(tmp_path, "loop", range(2)) == [{"steps": [1, 2, 3]}] * 2
    log = results[0][1]
    for step in (1, 3):
        assert f"fast-tier save of step {step} failed" in log
    assert "fast save of step 2 failed: rank 1: DiskFullError" in log
    assert "uploading it to the store" in log
    bucket = CheckpointManager(str(tmp_path / "bucket"), preemption=False)
    assert bucket.steps() == [2] and bucket.verify(2).ok
    bucket.close()
    for node in ("node0", "node1"):  # nothing committed in the tier, and nothing left behind
        assert not list(node_folder(args, node).glob("step-*")), node


@pytest.mark.process
def test_a_node_lost_in_the_copy_phase_is_a_clear_error_naming_it_on_every_other_rank(
    tmp_path: Path,
) -> None:
    """node2 dies (SIGKILL) as it starts writing node1's copy: the others raise PeerLostError
    naming rank 2, within the collective timeout, never a raw gloo error."""
    die = {"rank": 2, "name": "r00001-000.safetensors"}
    args = _loop_args(  # the survivors wait out the collective timeout: a short one
        tmp_path,
        interval_steps=None,
        local_interval_steps=1,
        steps=3,
        die=die,
        collective_timeout_s=20,
    )
    results = finish(launch_nodes(NODES, "save_loop", args), timeout=600)
    assert [status for status, _ in results] == [0, 0, -signal.SIGKILL, 0], results
    for result in _results(tmp_path, "loop", [0, 1, 3]):
        assert result["error"] == "PeerLostError" and result["steps"] == [], result
        assert "rank(s) 2 (node node2) left the job" in result["message"]


@pytest.mark.process
def test_a_hostile_node_id_on_one_rank_stops_every_rank_at_start_with_a_clear_error(
    tmp_path: Path,
) -> None:
    args = _loop_args(tmp_path)
    nodes = ["node0", "../../escape"]
    results = finish(launch_nodes(nodes, "start", args, machines=["m0", "m1"]), timeout=600)
    assert [status for status, _ in results] == [0, 0], results
    for result in _results(tmp_path, "start", range(2)):
        assert result["error"] == "InvalidArgumentError", result
        assert "rank 1: SPOTCKPT_NODE must be" in result["message"]
        assert "'../../escape'" in result["message"]
    assert not list((tmp_path / "machines").rglob("escape"))


@pytest.mark.process
def test_two_machines_with_one_node_id_are_refused_at_start_naming_the_setting(
    tmp_path: Path,
) -> None:
    """A reused host name: each machine would hold half of every tier step and a restart would
    restore nothing, silently. Every rank refuses at start-up instead; two ranks of one machine
    (one folder) are one node, as they should be."""
    args = _args(tmp_path, str(tmp_path / "bucket"), None, local_interval_steps=1)
    processes = launch_nodes(["localhost"] * 2, "start", args, machines=["m0", "m1"])
    assert [status for status, _ in finish(processes, timeout=600)] == [0, 0]
    for result in _results(tmp_path, "start", range(2)):
        assert result.get("error") == "InvalidArgumentError", result
        assert "ranks 0 and 1 both claim node id 'localhost'" in result["message"]
        assert "set SPOTCKPT_NODE" in result["message"]
    processes = launch_nodes(["localhost"] * 2, "start", args, machines=["m0", "m0"])
    assert [status for status, _ in finish(processes, timeout=600)] == [0, 0]
    assert _results(tmp_path, "start", range(2)) == [{}, {}]


@pytest.mark.parametrize("code", ["EPERM", "EOPNOTSUPP", "EXDEV"])
def test_a_folder_id_is_placed_where_the_file_system_has_no_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    """vfat and some FUSE mounts refuse hard links: the tier still starts, with an id written by
    an exclusive create, which the next start (and another rank) keeps."""

    def no_links(source: Any, target: Any) -> None:
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(os, "link", no_links)
    root = resolve_local_dir(str(tmp_path / "{node}"), "n0")
    first = folder_id(root)
    assert re.fullmatch(r"[0-9a-f]{32}", first)
    assert folder_id(resolve_local_dir(str(tmp_path / "{node}"), "n0")) == first
    assert not list(root.glob(".spotckpt-probe-*"))
