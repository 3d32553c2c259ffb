"""A long save or restore logs its progress at INFO: bytes done of total, rate, time left.

The transfer is made long for real: a proxy in front of the moto server holds the requests for
the rank object's later pieces until the progress line has been logged (an event, never a sleep),
so the line is seen mid-transfer, with part of the bytes done. A short transfer logs nothing.
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections.abc import Iterator

import boto3
import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.errors import ConfigError
from spotckpt.progress import ProgressLog
from spotckpt.storage.s3 import MIN_PART_SIZE
from spotckpt.units import human_duration, human_rate, human_size

from fault_proxy import FaultProxy

MIB = 1 << 20
HOLD_S = 300.0  # a held request waits for the log line at most this long (the test then fails)
LINE = re.compile(
    r"(?P<what>saving|restoring) step 1: (?P<done>[\d.]+) MiB of 32\.0 MiB \((?P<pct>\d+)%\), "
    r"[\d.]+ (?:B|KiB|MiB|GiB)/s, (?:\d+ s|\d+ min \d\d s|\d+ h \d\d min) left"
)


class LineSeen(logging.Handler):
    """Sets `seen` once a progress line of `what` is logged on the ``spotckpt`` logger."""

    def __init__(self, what: str) -> None:
        super().__init__(logging.INFO)
        self.what = what
        self.seen = threading.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        match = LINE.fullmatch(text)
        if match and match["what"] == self.what:
            self.lines.append(text)
            self.seen.set()


@pytest.fixture
def spotckpt_info() -> Iterator[logging.Logger]:
    logger = logging.getLogger("spotckpt")
    level = logger.level
    logger.setLevel(logging.INFO)
    yield logger
    logger.setLevel(level)


def _held_proxy(moto_endpoint: str, method: str, released: threading.Event) -> FaultProxy:
    """A proxy that lets the first `method` request on a rank object through and holds the
    others until `released`."""
    passed: list[str] = []
    lock = threading.Lock()

    def hold(verb: str, path: str) -> None:
        if verb != method or ".safetensors" not in path:
            return None
        with lock:
            first = not passed
            passed.append(path)
        if not first:
            released.wait(HOLD_S)
        return None

    return FaultProxy(moto_endpoint, rate=0.0, answer=hold)


def _state() -> dict[str, torch.Tensor]:
    return {"weights": torch.arange(8 * MIB, dtype=torch.float32)}  # 32 MiB


@pytest.mark.parametrize("what", ["saving", "restoring"])
def test_long_transfer_logs_its_progress_mid_way(
    moto_endpoint: str, spotckpt_info: logging.Logger, what: str
) -> None:
    bucket = f"progress-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    released = threading.Event()
    method = "PUT" if what == "saving" else "GET"
    proxy = _held_proxy(moto_endpoint, method, released)
    seen = LineSeen(what)
    spotckpt_info.addHandler(seen)
    # One part in flight and one being filled: the writer waits for the held part.
    options = {"endpoint_url": proxy.endpoint, "part_size": MIN_PART_SIZE, "max_concurrency": 1}
    try:
        with CheckpointManager(
            f"s3://{bucket}/run",
            preemption=False,
            storage_options=options,
            progress_interval_s=0.05,
        ) as mgr:
            releaser = threading.Thread(target=lambda: seen.seen.wait(HOLD_S) and released.set())
            if what == "saving":
                releaser.start()
                mgr.save(1, _state(), blocking=True)
            else:
                released.set()  # the save goes through unheld
                mgr.save(1, _state(), blocking=True)
                released.clear()
                releaser.start()
                target = {"weights": torch.zeros(8 * MIB)}
                assert mgr.restore(target) == 1
                assert torch.equal(target["weights"], _state()["weights"])
            releaser.join()
    finally:
        released.set()
        spotckpt_info.removeHandler(seen)
        proxy.close()
    assert seen.seen.is_set(), f"no progress line while {what}"
    first = LINE.fullmatch(seen.lines[0])
    assert first is not None
    assert 0 < float(first["done"]) < 32.0, seen.lines  # seen mid-way, in human units
    assert 0 <= int(first["pct"]) < 100


def test_short_save_logs_no_progress(
    memory_uri: str, spotckpt_info: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="spotckpt"),
        CheckpointManager(memory_uri, preemption=False) as mgr,  # the default interval: 5 s
    ):
        mgr.save(1, {"w": torch.ones(4)}, blocking=True)
        assert mgr.restore({"w": torch.zeros(4)}) == 1
    assert "committed in" in caplog.text
    assert not re.search(r"(saving|restoring) step 1: .* of ", caplog.text)
    assert "restored step 1 in" in caplog.text and " B read for 16 B needed" in caplog.text


def test_progress_line_in_human_units() -> None:
    progress = ProgressLog("saving step 7", lambda: (0, 0), None)
    line = progress.start().line(96 * MIB, 256 * MIB)
    assert re.fullmatch(
        r"saving step 7: 96\.0 MiB of 256\.0 MiB \(37%\), [\d.]+ [KMGTP]iB/s, .+ left", line
    ), line
    progress.stop()
    assert progress.start()._thread is None  # an interval of None starts no thread


def test_human_units() -> None:
    assert [human_size(n) for n in (0, 1023, 1024, 1536 * MIB, 3 << 40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 GiB",
        "3.0 TiB",
    ]
    assert human_rate(48.25 * MIB) == "48.2 MiB/s"
    assert [human_duration(s) for s in (0.4, 59.6, 200, 7500)] == [
        "0 s",
        "1 min 00 s",
        "3 min 20 s",
        "2 h 05 min",
    ]


def test_progress_interval_is_a_checked_setting() -> None:
    with pytest.raises(ConfigError, match="progress_interval_s: must be a positive number"):
        CheckpointManager("memory://x", preemption=False, progress_interval_s=0)
