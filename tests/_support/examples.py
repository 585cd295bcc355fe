"""Run a script of examples/ as a user would: used by tests/docs/test_examples.py and the training tests."""

from __future__ import annotations

import subprocess
import sys

from tests._support.common import ROOT

EXAMPLES = ROOT / "examples"
# Generous: on a machine whose cores are busy, importing torch and compiling in each fresh
# interpreter takes minutes (the training loop compiles forward and backward graphs).
TIMEOUT_S = 300


def run_example(name: str) -> str:
    """Run ``examples/<name>`` in a fresh interpreter; return its stdout, failing on a non-zero exit."""
    result = subprocess.run(  # noqa: S603
        [sys.executable, str(EXAMPLES / name)],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout
