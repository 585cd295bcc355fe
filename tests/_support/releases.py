"""What the torch release under test offers, for tests that depend on it.

fp32scope supports torch >= 2.4 and is tested on several releases (``nox -s tests_matrix``).
A test that needs something a release lacks says why in its skip reason; a test of the
legacy-only path runs on a legacy release for real. Detected as the library itself
detects it, through :mod:`fp32scope._compat` (by presence), never by parsing the version here.
"""

from __future__ import annotations

import pytest
import torch

from fp32scope import _compat
from fp32scope._flags import torch_flags as _flags

#: torch's release, e.g. "2.13.0" (without the local "+cpu" part).
TORCH_RELEASE = _compat.TORCH_RELEASE

#: For tests of the per-backend ``fp32_precision`` API and the mixed states it allows.
needs_new_api = pytest.mark.skipif(
    not _flags.HAS_NEW_API,
    reason=(
        f"torch {TORCH_RELEASE} has no per-backend fp32_precision API (torch >= 2.9): "
        "only the legacy flags exist, and they cannot disagree with each other"
    ),
)

#: For tests of what only a release without that API does.
needs_legacy_only = pytest.mark.skipif(
    _flags.HAS_NEW_API,
    reason=f"torch {TORCH_RELEASE} has the fp32_precision API: this tests releases before 2.9",
)

#: For tests of cuda matmul "bfx9" (torch >= 2.15).
needs_bfx9 = pytest.mark.skipif(
    not _compat.HAS_BFX9,
    reason=(
        f"torch {TORCH_RELEASE} has no cuda matmul fp32_precision 'bfx9' (torch >= {_compat.BFX9_RELEASE}): "
        "no state can hold it, and Fp32Precision('bfx9') is refused (tested there)"
    ),
)

#: For tests of what a release without "bfx9" does with it.
needs_no_bfx9 = pytest.mark.skipif(
    _compat.HAS_BFX9,
    reason=f"torch {TORCH_RELEASE} has cuda matmul 'bfx9': this tests releases before {_compat.BFX9_RELEASE}",
)


def make_unusual_state() -> None:
    """Put the process somewhere no default leaves it, for tests that it is left exactly as is.

    With the new API, a mixed state: the legacy getter says "high" (stale) while cuBLAS
    runs in full fp32, and the legacy cuBLAS getter raises. Before it, a non-default
    legacy state ("medium" and cuDNN TF32 off).
    """
    if _flags.HAS_NEW_API:
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = False
