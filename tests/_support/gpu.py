"""What the GPU tests (tests/gpu/) share: whether the GPU can run TF32, and the skip mark saying so."""

from __future__ import annotations

import pytest
import torch


def tf32_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


# pytest reports the first skip mark that holds, the test's own before the module's: without
# any GPU, say that, not that this one is too old.
needs_tf32 = pytest.mark.skipif(
    not tf32_capable(),
    reason="TF32 needs an Ampere-or-newer GPU" if torch.cuda.is_available() else "needs a CUDA GPU",
)
