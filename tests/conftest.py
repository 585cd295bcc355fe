"""Shared fixtures: every test starts and ends with the process flags it found."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fp32scope import _flags, _scope


@pytest.fixture(autouse=True)
def _restore_process_flags() -> Iterator[None]:
    """Restore the exact raw flag state after each test, so tests cannot leak into each other."""
    state = _flags.save_raw_state()
    yield
    _flags.restore_raw_state(state)
    # A test that fails inside a scope on another thread must not poison the next test.
    _scope._owner.clear()
    _scope._depth = 0
