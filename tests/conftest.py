"""Shared fixtures: every test starts and ends with the process flags it found; a fresh Dynamo on request.

Fixtures live here, never in a test module; helpers that are not fixtures live in tests/_support.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import hypothesis
import pytest

from fp32scope._flags import scope as _scope
from fp32scope._flags import torch_flags as _flags
from tests._support.releases import TORCH_RELEASE

# The suite runs on two xdist workers beside Inductor's compiles: how fast Hypothesis draws
# an input, or how long one example takes, says nothing about fp32scope (a draw of a few
# milliseconds once took a second, failing the too_slow health check). A test that needs
# its own settings still sets them with @settings. The profile builds on the one loaded
# already (the mutation plugin's, where it runs).
hypothesis.settings.register_profile(
    "fp32scope", hypothesis.settings(), suppress_health_check=[hypothesis.HealthCheck.too_slow], deadline=None
)
hypothesis.settings.load_profile("fp32scope")


def pytest_report_header() -> str:
    """Say which torch, and which of fp32scope's implementations, this run tests."""
    api = "legacy and per-backend fp32_precision" if _flags.HAS_NEW_API else "legacy only (before torch 2.9)"
    return f"fp32scope: torch {TORCH_RELEASE}, precision API: {api}"


@pytest.fixture(autouse=True)
def _restore_process_flags() -> Iterator[None]:
    """Restore the exact raw flag state after each test, so tests cannot leak into each other."""
    import torch

    state = _flags.save_raw_state()
    # torch 2.7+'s oneDNN TF32 bool (Intel GPUs) is no scope's business, but the state
    # machines write it: put it back too where this build stores it (elsewhere it reads None).
    onednn = torch._C._get_onednn_allow_tf32() if hasattr(torch._C, "_get_onednn_allow_tf32") else None
    yield
    _flags.restore_raw_state(state)
    if onednn is not None:
        torch._C._set_onednn_allow_tf32(onednn)
    # A test that fails inside a scope on another thread must not poison the next test.
    _scope._owner.clear()
    _scope._depth = 0
    # Nor a probe armed to fail, whichever module the next test is in (xdist's worksteal and
    # the region mutants' runner interleave modules); not imported here where no test did.
    probe = sys.modules.get("tests._support.probe")
    if probe is not None:
        probe.FAIL_IN_BACKWARD.clear()
        probe.SEEN.clear()


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Reset Dynamo (its caches and counters) before and after the test: no compile leaks in or out."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
