"""What many test modules share: the repository root, precisions, an error, a Python autograd node, a runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from fp32scope import Fp32Precision

#: The repository root (this file is tests/_support/common.py): docs/, examples/, noxfile.py.
ROOT = Path(__file__).resolve().parents[2]

#: Full fp32: matmul "highest", cuDNN TF32 off. The precision most tests scope a node to.
FULL = Fp32Precision("highest", False)


class BoomError(Exception):
    """Raised by test code to check that what it interrupts is undone."""


#: The process default most tests set: matmul "high", cuDNN TF32 on (torch's own default is "highest").
DEFAULT = Fp32Precision("high", True)

#: Every precision of the legacy vocabulary: three matmul levels, cuDNN TF32 on and off.
ALL = [Fp32Precision(m, c) for m in ("highest", "high", "medium") for c in (True, False)]

#: What the package says when a scope is entered inside a region torch.compile traces.
COMPILING_MESSAGE = "cannot change torch's float32 precision flags inside a region that torch.compile is tracing"


class PythonIdentity(torch.autograd.Function):
    """The identity as a Python autograd node: inside a scoped node, the leaves are accumulated in its nested engine."""

    @staticmethod
    def forward(_ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(_ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def run_module(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args`` from the repository root (one thread, warnings off, ``env`` added)."""
    return subprocess.run(  # noqa: S603  # this interpreter, a module of this repository
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def run_harness(module: str, out: Path, what: str) -> dict[str, Any]:
    """Run ``python -m module out`` from the repository root (one thread, warnings off); the JSON it wrote."""
    proc = run_module(module, str(out))
    assert out.exists(), f"the {what} run wrote nothing (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    found: dict[str, Any] = json.loads(out.read_text())
    return found
