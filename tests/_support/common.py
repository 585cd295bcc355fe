"""What many test modules share: the repository root, the full-fp32 precision, an error to raise."""

from __future__ import annotations

from pathlib import Path

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
