"""Reporting for the resume matrix: the sample's seed and case ids after collection, and the
table of the cases that ran (one line each) at the end of the session."""

from __future__ import annotations

from typing import Any

import pytest

from . import harness


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    matrix = [item for item in items if "resume_matrix/test_matrix.py" in item.nodeid]
    if not matrix:
        return []
    from . import test_matrix

    return [
        f"resume matrix: SPOTCKPT_MATRIX_SEED={test_matrix.SEED}, sample of "
        f"{len(test_matrix.SAMPLE)} of {len(test_matrix.CASES)} cases: "
        + " ".join(case.id for case in test_matrix.SAMPLE),
        f"resume matrix: {len(matrix)} cases selected",
    ]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    results = [result for session in harness.SESSIONS for result in session.results]
    if results:
        terminalreporter.section("resume matrix")
        for line in harness.iter_lines(results):
            terminalreporter.write_line(line)
