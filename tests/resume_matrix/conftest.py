"""Reporting for the resume matrix: the sample's seed and case ids, and the table of the cases
that ran (one line each), at the end of the session.

Under pytest-xdist (`make test` runs several workers) the controller neither collects nor runs
the cases, nor loads this file: each worker hands its lines over in ``workeroutput`` and
tests/conftest.py prints them on the controller.
"""

from __future__ import annotations

from typing import Any

import pytest

from . import harness


def _sample_lines() -> list[str]:
    from . import test_matrix

    return [
        f"resume matrix: SPOTCKPT_MATRIX_SEED={test_matrix.SEED}, sample of "
        f"{len(test_matrix.SAMPLE)} of {len(test_matrix.CASES)} cases: "
        + " ".join(case.id for case in test_matrix.SAMPLE)
    ]


def _local_lines() -> list[str]:
    results = [result for session in harness.SESSIONS for result in session.results]
    return [*_sample_lines(), *harness.iter_lines(results)] if results else []


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    matrix = [item for item in items if "resume_matrix/test_matrix.py" in item.nodeid]
    if not matrix:
        return []
    return [*_sample_lines(), f"resume matrix: {len(matrix)} cases selected"]


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the lines to the controller
        workeroutput["resume_matrix_lines"] = _local_lines()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lines = _local_lines()
    if lines:
        terminalreporter.section("resume matrix")
        for line in lines:
            terminalreporter.write_line(line)
