"""The benchmarks run: each script, with tiny loops, exits 0 and prints its figures (no figure is checked here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._support.common import ROOT


@pytest.mark.parametrize(
    ("script", "printed"),
    [
        ("bench_scope.py", "each feature's cost per scoped call"),
        ("bench_training.py", "fp32scope's overhead"),
        # (It also exits 1 when a variant it times as compiled runs a Python forward it should not.)
        ("bench_compiled.py", "Python forward frames in a warm train step"),
    ],
)
def test_a_benchmark_runs_and_leaves_the_flags_as_it_found_them(script: str, printed: str) -> None:
    # Each script exits 1 when it left the flags changed; tiny loops, so that only that is tested.
    done = subprocess.run(  # noqa: S603  (this interpreter, the repository's own script)
        [sys.executable, str(ROOT / "benchmarks" / script), "--number", "4", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert printed in done.stdout
