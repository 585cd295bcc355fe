"""A user's tests of a node in full float32, checked with fp32scope's pytest plugin.

Run with ``--fp32scope-strict``: a test that leaves torch's float32 precision flags
changed fails at teardown. Scopes restore what they change, and so does the
``fp32_flags`` fixture for a test that sets the flags directly.
``assert_fp32_flags_unchanged`` checks one block.
"""

from __future__ import annotations

import torch

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    assert_fp32_flags_unchanged,
    current_fp32_precision,
    set_process_default,
)

HIGHEST = Fp32Precision("highest", cudnn_allow_tf32=False)


class Head(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Fp32Precision]:
        return x + 1, current_fp32_precision()


def test_node_runs_in_its_precision() -> None:
    # No fixture needed: the scope restores what it changes, so strict mode passes.
    before = current_fp32_precision()
    head = Fp32ScopedModule(Head(), HIGHEST)
    _, inside = head(torch.zeros(1))
    assert inside == HIGHEST
    assert current_fp32_precision() == before


def test_engine_default(fp32_flags: object) -> None:
    # This test sets the process default; fp32_flags puts the flags back afterwards.
    del fp32_flags
    set_process_default(Fp32Precision("medium", cudnn_allow_tf32=True))
    head = Fp32ScopedModule(Head(), HIGHEST)
    _, inside = head(torch.zeros(1))
    assert inside == HIGHEST
    assert current_fp32_precision() == Fp32Precision("medium", cudnn_allow_tf32=True)


def test_torch_flags_directly(fp32_flags: object) -> None:
    # Writing torch's own flags, in either API, is fine under the fixture too.
    del fp32_flags
    torch.backends.cudnn.allow_tf32 = False
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    else:
        torch.set_float32_matmul_precision("medium")
        assert torch.get_float32_matmul_precision() == "medium"


def test_warmup_leaves_the_flags_as_it_found_them() -> None:
    # Works without the plugin too: assert_fp32_flags_unchanged fails this test,
    # naming each flag, if the block changes any of them (and puts them back).
    head = Fp32ScopedModule(Head(), HIGHEST)
    with assert_fp32_flags_unchanged():
        for _ in range(3):
            head(torch.zeros(1))
