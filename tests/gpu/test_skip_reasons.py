"""The GPU tests' skip reasons, as pytest reports them, say what this machine lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

GPU_TESTS = Path(__file__).resolve().parent
ROOT = GPU_TESTS.parent.parent


def test_skip_reasons_name_what_is_missing() -> None:
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "pytest", str(GPU_TESTS), "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    if torch.cuda.is_available():
        if torch.cuda.get_device_capability() >= (8, 0):
            assert skips == [], done.stdout
        else:
            assert skips, done.stdout
            assert all("TF32 needs an Ampere-or-newer GPU" in line for line in skips), done.stdout
        return
    assert done.returncode == 0, done.stdout + done.stderr
    assert skips, done.stdout
    # Every one of them: also the TF32 tests, whose own mark pytest reports first.
    assert all(line.endswith("needs a CUDA GPU") for line in skips), "\n".join(skips)
    assert "Ampere" not in done.stdout
