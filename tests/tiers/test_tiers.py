"""The fast tier: placement, erasure coding, and restores from the nearest surviving copy.

"Nodes" are gloo rank processes, each with its own ``SPOTCKPT_NODE`` and its own machine folder
(`tier_worker`: a private mount namespace per rank, so no rank can read another machine's disk);
a lost node is a rank killed by SIGKILL whose folder is then deleted. The
bucket's rank objects are deleted before a restore that must not touch the bucket, so a read
of one would fail the restore rather than only show in a counter.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager, Config
from spotckpt.errors import InvalidArgumentError, ManifestError
from spotckpt.tiers.erasure import data_block, parity_block
from spotckpt.tiers.node import NodeIdentity, node_identity
from spotckpt.tiers.record import GroupRecord, ParityRecord, TierRecord
from spotckpt.tiers.recovery import HeldStep, NodeReport, Scope, choose_step, merge_ranges
from spotckpt.tiers.redundancy import Placement, parse_redundancy

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
    return {"w": torch.randn(256, 64), "b": torch.randn(64)}


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


@pytest.mark.parametrize(
    ("redundancy", "count", "lost"),
    [("replicate:2", 4, [2]), ("ec:2+1", 3, [1]), ("ec:2+2", 4, [1, 2])],
)
def test_lost_nodes_restore_from_peers_without_the_bucket(
    tmp_path: Path, redundancy: str, count: int, lost: list[int]
) -> None:
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


def test_restore_on_another_world_size_from_fast_tier_copies(tmp_path: Path) -> None:
    args = _args(tmp_path, str(tmp_path / "bucket"), "replicate:2")
    run_nodes(NODES, "save_then_die", args)
    _drop_bucket_objects(tmp_path / "bucket")
    # Two of the four machines come back: between them they hold every object once.
    run_nodes(["node0", "node2"], "restore", args)
    found = _sources(tmp_path, 2)
    assert found["step"] == 6 and found["sources"]["store"] == 0
    _same(tmp_path / "out" / "restored-2.pt", tmp_path / "out" / "expected-6.pt")


def test_sigterm_saves_to_the_tier_and_peers_then_resumes_at_that_step(
    tmp_path: Path, s3_uri: str
) -> None:
    args = _args(tmp_path, s3_uri, "replicate:2", interval_steps=1000, ready_at=3)
    processes = launch_nodes(NODES[:2], "evicted", args)
    ready = tmp_path / "out" / "ready"
    try:
        _wait_for(ready, processes)
    except BaseException:
        for process in processes:
            process.kill()
        raise
    for process in processes:  # torchrun passes the signal to every rank
        os.killpg(process.pid, signal.SIGTERM)
    results = finish(processes)
    for rank, (status, output) in enumerate(results):
        assert status == 75, f"rank {rank} exited {status}:\n{output[-6000:]}"
    evicted_at = int((tmp_path / "out" / "evicted-at.txt").read_text())
    _lose(args, ["node1"])  # the evicted machine's disk is gone
    run_nodes(NODES[:2], "restore", args)
    found = _sources(tmp_path, 2)
    assert found["step"] == evicted_at and found["sources"]["store"] == 0
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
