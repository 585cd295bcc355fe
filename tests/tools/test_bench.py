"""The benchmarks run: each script, with tiny loops, exits 0 and prints its figures (no figure is checked here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._support.common import ROOT

TINY = ("--number", "4", "--repeats", "1")
#: The decode bench's tiny run: a 1-token prompt, whose graph is the decode steps' (one compile per variant, not two).
DECODE = (
    "--layers",
    "1",
    "--cache-length",
    "64",
    "--prompt",
    "1",
    "--steps",
    "2",
    "--repeats",
    "1",
    "--caches",
    "static",
)


@pytest.mark.parametrize(
    ("script", "args", "printed"),
    [
        ("bench_scope.py", TINY, "each feature's cost per scoped call"),
        ("bench_training.py", TINY, "fp32scope's overhead"),
        # (These two also exit 1 when what they time as compiled runs a Python forward it should not.)
        (
            "bench_compiled.py",
            TINY,
            (
                "Python forward frames in a warm train step",
                "a region's op against its node's compiled code alone",
                "fp32scope's ops against bare ones",
            ),
        ),
        (
            "bench_decode.py",
            DECODE,
            "cost per scoped attention",
        ),
    ],
)
def test_a_benchmark_runs_and_leaves_the_flags_as_it_found_them(
    script: str, args: tuple[str, ...], printed: str | tuple[str, ...]
) -> None:
    # Each script exits 1 when it left the flags changed; tiny loops, so that only that is tested.
    done = subprocess.run(  # noqa: S603  (this interpreter, the repository's own script)
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode == 2 and script == "bench_decode.py":
        pytest.skip(done.stderr.strip())  # transformers does not run its models on this torch
    assert done.returncode == 0, done.stderr
    for line in (printed,) if isinstance(printed, str) else printed:
        assert line in done.stdout
