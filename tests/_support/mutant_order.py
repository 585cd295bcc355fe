"""A pytest plugin for the region mutants' runner: tests in a chosen order, and what each run found.

``python -m pytest -p tests._support.mutant_order ...`` with ``FP32SCOPE_MUTANT_ORDER``
naming a JSON list of test ids runs those tests first, in that order (a file's name in
the list stands for its tests not named; the rest run after them, as collected). With
``FP32SCOPE_MUTANT_RECORD`` naming a file, it writes there, as JSON, the first test that
failed (``null`` if none) and each test's seconds. Without the variables it changes
nothing. ``tests/_support/region_mutants.py`` puts the test that killed a mutant last time
first, so that with ``-x`` a mutant costs one test rather than the suite.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ORDER = "FP32SCOPE_MUTANT_ORDER"
RECORD = "FP32SCOPE_MUTANT_RECORD"

_first_failure: list[str] = []
_seconds: dict[str, float] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the tests the order file names first, in its order (a stable sort keeps the others' order)."""
    path = os.environ.get(ORDER)
    if not path:
        return
    wanted: list[str] = json.loads(Path(path).read_text())
    rank = {node: index for index, node in enumerate(wanted)}
    # A test not named ranks where its file is named (a test added since the times were taken).
    items.sort(key=lambda item: rank.get(item.nodeid, rank.get(item.nodeid.split("::")[0], len(rank))))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that fails to import (a mutant that breaks the syntax) is the first failure."""
    if report.failed and not _first_failure:
        _first_failure.append(report.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each test's setup, call and teardown; keep the first test that failed."""
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    if report.failed and not _first_failure:
        _first_failure.append(report.nodeid)


def pytest_sessionfinish() -> None:
    """Write what the run found, where the record variable says."""
    path = os.environ.get(RECORD)
    if path:
        found = {"failed": _first_failure[0] if _first_failure else None, "seconds": _seconds}
        Path(path).write_text(json.dumps(found))
