"""The fast tier's worth under the cloud model: what a node loss and an emergency save cost by the
tier and its peers, against the bucket, in one run, beside the model's own prediction.

    python benchmarks/tier_worth.py            # 2 profiles x (replicate:2, ec:2+1), 3 reps
    python benchmarks/tier_worth.py --quick    # smaller states, 1 rep (a few minutes)

Against a loopback bucket the tier can only lose: the bucket answers as fast as the disk. Here
every rank process is one node and runs its own `CloudProxy` (benchmarks/cloud_model.py) in
front of moto's S3 server, and the tier's peer exchange (`spotckpt.tiers.exchange`, gloo traffic
that never passes the HTTP proxy) is paced by the same per-node links (`NodeLinks`: full duplex),
so a node's bucket traffic and its peer traffic share one interface, as on a real machine. The
profiles are scaled so that their limits bind far below what this machine moves on loopback:

- ``node-bound``: only the node's link limits (the bucket could take more than a node sends).
  The lost node must take its state in over its own link whether it comes from the bucket or
  from a peer, so the model predicts no gain for its restore, and a replicated save sends the
  state once as the bucket save does.
- ``connection-bound``: the bucket gives each connection less than the node's link (as S3's
  per-connection throughput, with few connections per rank), peers use the whole link.

Per profile and redundancy (``replicate:2`` on 4 nodes, ``ec:2+1`` on 3), the scenario is
`tiers_bench`'s: durable saves to the bucket and fast saves (tier and peers, the route an
emergency save takes when there is a tier) of the same state, timed job-wide; then one node is
SIGKILLed and its disk deleted, and a fresh job restores from the surviving copies, then from
the bucket. Every restore is checked against the saved values. For each operation the bytes
each node moved (to and from the bucket through its proxy, to and from peers) are counted, and
the model's prediction is the slowest node's time at its links' rates: ``max over nodes of
max((peer up + bucket up) / link, bucket up / bucket rate, (peer down + bucket down) / link,
bucket down / bucket rate)``, with the bucket rate ``min(link, connection rate x connections)``
(latencies and request rates left out: the bytes dominate at these sizes).

The peer restore must read 0 tensor bytes from the bucket (`last_restore_sources`); the run
fails otherwise. Nothing here contacts a non-loopback address.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import tiers_bench  # noqa: E402
from bench_servers import BUCKET, MotoServer, apply_fake_env  # noqa: E402
from cloud_model import MIB, CloudProxy, NodeLinks, Profile  # noqa: E402

CONNECTIONS = 2
"""Connections per rank to the bucket (the store's ``max_concurrency``)."""
PART_SIZE = 5 * MIB
PROFILES = (
    # name, node link (bytes/s each way), bucket per connection (None: the link's)
    ("node-bound", 6 * MIB, None),
    ("connection-bound", 8 * MIB, 1 * MIB),
)
REDUNDANCIES = (("replicate:2", 4, 2), ("ec:2+1", 3, 1))  # spec, nodes, the lost node's index
SAVE_OPS = ("bucket_save", "tier_save")
"""The operations `tiers_bench.node_save` times, in its order per repetition."""
RESTORE_OPS = ("tier_restore", "bucket_restore")
"""The operations `tiers_bench.node_restore` times, in its order per repetition."""


@dataclass(frozen=True)
class Case:
    """One profile on one redundancy."""

    profile: str
    link: float
    connection: float | None
    redundancy: str
    nodes: int
    lost: int

    @property
    def bucket_rate(self) -> float:
        """What one node gets from the bucket: its link, or its connections' sum if lower."""
        if self.connection is None:
            return self.link
        return min(self.link, self.connection * CONNECTIONS)

    def cloud_profile(self) -> Profile:
        """The proxy's limits: this case's link per node and rate per connection."""
        return Profile(self.profile, self.connection, self.link, 0.005, None, None)


# The rank process: its node's proxy and paced peer exchange around tiers_bench's worker -------


class Counters:
    """The bytes this node moved, by way and direction (all threads add to it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.peer_up = 0
        self.peer_down = 0

    def add(self, up: int = 0, down: int = 0) -> None:
        with self.lock:
            self.peer_up += up
            self.peer_down += down


def _wait_until(instant: float) -> None:
    delay = instant - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def pace_peer_exchange(node: NodeLinks, counters: Counters) -> None:
    """Make the tier's piece sends and receives pass this node's links: a send reserves its
    bytes on the way up when it is posted and is done no sooner than they could have gone; a
    receive reserves its bytes on the way down and returns no sooner than they could have come.
    Both directions run at once, as the exchange's rounds post sends before receiving."""
    from spotckpt.tiers import exchange

    post, receive = exchange._post, exchange._receive

    def paced_post(data: Any, piece: Any, target: int, group: Any, outcome: Any) -> Any:
        until = node.up.take(piece.length)
        counters.add(up=piece.length)
        sending = post(data, piece, target, group, outcome)
        finish = sending.finish

        def paced_finish(outcome: Any) -> None:
            finish(outcome)
            _wait_until(until)

        sending.finish = paced_finish
        return sending

    def paced_receive(piece: Any, group: Any, outcome: Any) -> Any:
        until = node.down.take(piece.length)
        got = receive(piece, group, outcome)
        _wait_until(until)
        counters.add(down=piece.length)
        return got

    exchange._post = paced_post  # type: ignore[assignment]
    exchange._receive = paced_receive  # type: ignore[assignment]


def record_each_timed_operation(
    proxy: CloudProxy, counters: Counters, out: Path, names: tuple[str, ...]
) -> None:
    """Wrap `tiers_bench.job_timed` so that each timed operation's bytes (this node's, by way
    and direction) are appended to `out`, named in turn by `names`."""
    timed = tiers_bench.job_timed
    calls = [0]

    def counted(fn: Callable[[], Any]) -> tuple[float, Any]:
        before = (proxy.bytes_in, proxy.bytes_out, counters.peer_up, counters.peer_down)
        seconds, value = timed(fn)
        after = (proxy.bytes_in, proxy.bytes_out, counters.peer_up, counters.peer_down)
        moved = [b - a for a, b in zip(before, after, strict=True)]
        line = {
            "op": names[calls[0] % len(names)],
            "rep": calls[0] // len(names),
            "seconds": seconds,
            "bucket_up": moved[0],
            "bucket_down": moved[1],
            "peer_up": moved[2],
            "peer_down": moved[3],
        }
        calls[0] += 1
        with open(out, "a") as lines:
            lines.write(json.dumps(line) + "\n")
        return seconds, value

    tiers_bench.job_timed = counted


def node_main(argv: list[str]) -> None:
    """A rank of `tiers_bench`'s multi-node scenario, behind its node's own proxy and links."""
    scenario, rank, world, port, raw = argv[1:6]
    args = json.loads(raw)
    case = Case(**args["case"])
    node = NodeLinks.of(case.link)
    proxy = CloudProxy(args["endpoint"], case.cloud_profile(), node)
    counters = Counters()
    pace_peer_exchange(node, counters)
    names = SAVE_OPS if scenario == "save" else RESTORE_OPS
    out = Path(args["out_bytes"]) / f"bytes-{scenario}-{rank}.jsonl"
    record_each_timed_operation(proxy, counters, out, names)
    behind_proxy = json.dumps({**args, "endpoint": proxy.endpoint})
    tiers_bench.main([argv[0], scenario, rank, world, port, behind_proxy])
    proxy.close()


# The parent --------------------------------------------------------------------------------


def predicted_s(case: Case, nodes: list[dict[str, Any]]) -> float:
    """The model's time for one operation from each node's bytes (see the module docstring)."""
    slowest = 0.0
    for moved in nodes:
        up = moved["bucket_up"] + moved["peer_up"]
        down = moved["bucket_down"] + moved["peer_down"]
        slowest = max(
            slowest,
            up / case.link,
            down / case.link,
            moved["bucket_up"] / case.bucket_rate,
            moved["bucket_down"] / case.bucket_rate,
        )
    return slowest


def _by_operation(folder: Path, scenario: str, ranks: int) -> dict[tuple[str, int], list[dict]]:
    """Each (operation, repetition)'s per-node byte counts and times."""
    found: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rank in range(ranks):
        path = folder / f"bytes-{scenario}-{rank}.jsonl"
        for text in path.read_text().splitlines():
            line = json.loads(text)
            found.setdefault((line["op"], line["rep"]), []).append(line)
    return found


def run_case(case: Case, server: MotoServer, work: Path, state_bytes: int, reps: int) -> dict:
    """`tiers_bench`'s node scenario for `case`, with each operation's measured and predicted
    time and the bucket bytes the peer restore read."""
    name = f"{case.profile}-{case.redundancy.replace(':', '-').replace('+', '-')}"
    folder = work / name
    folder.mkdir(parents=True)
    settings = tiers_bench.TierSettings(0, state_bytes, reps, PART_SIZE, CONNECTIONS, 1.0)
    args = {
        "endpoint": server.endpoint,
        "bucket": BUCKET,
        "reps": reps,
        "part_size": PART_SIZE,
        "concurrency": CONNECTIONS,
        "bytes_per_rank": state_bytes,
        "redundancy": case.redundancy,
        "lost": case.lost,
        "prefix": f"tier-worth/{name}-{os.urandom(4).hex()}",
        "case": asdict(case),
    }
    keep = work / f"{name}-bytes"  # the part's folder is removed at its end
    keep.mkdir()
    part = tiers_bench._nodes_part(
        settings, name, {**args, "out_bytes": str(keep)}, case.nodes, folder, Path(__file__)
    )
    result: dict[str, Any] = {"case": asdict(case), "status": part["status"]}
    if part["status"] != "ok":
        result["error"] = part.get("error", "")[-3000:]
        return result
    rows: dict[str, dict[str, list[float]]] = {}
    for scenario in ("save", "restore"):
        for (op, _), nodes in sorted(_by_operation(keep, scenario, case.nodes).items()):
            row = rows.setdefault(op, {"measured": [], "predicted": []})
            row["measured"].append(max(n["seconds"] for n in nodes))
            row["predicted"].append(predicted_s(case, nodes))
            if op == "tier_restore":
                row.setdefault("bucket_bytes_any", []).append(
                    float(sum(n["bucket_down"] for n in nodes))
                )
    sources = [rep["peer_restore_sources"] for rep in part["reps"]]
    result["tier_restore_sources"] = sources
    result["tier_restore_bucket_tensor_bytes"] = max(s.get("bucket", 0) for s in sources)
    result["ops"] = {
        op: {key: statistics.median(values) for key, values in row.items()}
        for op, row in rows.items()
    }
    result["bytes_per_rank"] = part["bytes_per_rank"]
    return result


def report(results: list[dict[str, Any]]) -> list[str]:
    """The table: per case, each route's median time, the model's, and the tier's gain."""
    lines = [
        "| profile | redundancy | operation | tier s (model) | bucket s (model) | tier gain "
        "(model) | bucket tensor bytes of the tier restore |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for result in results:
        case = result["case"]
        if result["status"] != "ok":
            lines.append(f"| {case['profile']} | {case['redundancy']} | {result['status']} |")
            continue
        ops = result["ops"]
        for label, tier, bucket in (
            ("save (the emergency route)", "tier_save", "bucket_save"),
            ("restore after one node loss", "tier_restore", "bucket_restore"),
        ):
            t, b = ops[tier], ops[bucket]
            bytes_read = (
                str(result["tier_restore_bucket_tensor_bytes"]) if tier == "tier_restore" else ""
            )
            lines.append(
                f"| {case['profile']} | {case['redundancy']} | {label} | "
                f"{t['measured']:.2f} ({t['predicted']:.2f}) | "
                f"{b['measured']:.2f} ({b['predicted']:.2f}) | "
                f"{b['measured'] / t['measured']:.2f}x ({b['predicted'] / t['predicted']:.2f}x) | "
                f"{bytes_read} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "node":
        node_main(argv)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller states, 1 repetition")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--keep", help="keep the logs and byte counts under this folder")
    options = parser.parse_args(argv)
    apply_fake_env()
    state_bytes = (12 if options.quick else 24) * MIB
    reps = 1 if options.quick else 3
    cases = [
        Case(name, link, connection, spec, nodes, lost)
        for name, link, connection in PROFILES
        for spec, nodes, lost in REDUNDANCIES
    ]
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="spotckpt-tier-worth-") as folder:
        work = Path(options.keep or folder)
        work.mkdir(parents=True, exist_ok=True)
        server = MotoServer(work)
        server.start()
        try:
            for case in cases:
                print(f"  {case.profile} {case.redundancy} ({case.nodes} nodes)", flush=True)
                results.append(run_case(case, server, work, state_bytes, reps))
                print("\n".join(report(results[-1:])[2:]), flush=True)
        finally:
            server.stop()
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
    for line in report(results):
        print(line)
    failed = [r for r in results if r["status"] != "ok"]
    leaked = [r for r in results if r.get("tier_restore_bucket_tensor_bytes", 0)]
    for result in failed:
        print(f"FAILED {result['case']}: {result.get('error', '')}")
    for result in leaked:
        print(f"the tier restore read bucket tensor bytes: {result['case']}")
    return 1 if failed or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
