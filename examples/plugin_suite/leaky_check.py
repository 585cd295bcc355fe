"""A test that forgets to restore the flags: ``--fp32scope-strict`` turns the leak into an error.

Not collected with the suite (its name does not start with ``test_``); the example script
runs it by path, to show the report.
"""

from __future__ import annotations

import torch


def test_forgets_to_restore() -> None:
    torch.set_float32_matmul_precision("medium")
    assert torch.get_float32_matmul_precision() == "medium"
