"""``assert_fp32_flags_unchanged``: fails exactly when a block changes any flag, names it, and restores."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, note, settings

from fp32scope import Fp32Precision, Fp32ScopedModule, assert_fp32_flags_unchanged, fp32_precision_scope
from fp32scope._flags import torch_flags as _flags
from tests._support.releases import needs_new_api
from tests._support.torch_model import TorchModel, Write, apply_writes, flag_writes

writes = flag_writes(max_size=6)


@settings(max_examples=100, deadline=None)
@given(writes, writes)
def test_fails_exactly_when_the_raw_state_changed_and_restores_it(start: list[Write], block: list[Write]) -> None:
    model = TorchModel()
    _flags.restore_raw_state(model.raw())
    apply_writes(model, start)
    before = model.raw()
    note(f"before: {before}")
    # Whether the block changes the state is known only once the model has seen its writes
    # (they go to torch and the model together), so the outcome is checked either way.
    try:
        with assert_fp32_flags_unchanged():
            apply_writes(model, block)
    except AssertionError as error:
        note(str(error))
        assert model.raw() != before
        assert str(error).startswith(  # noqa: PT017  (the outcome depends on the example)
            "the block changed torch's float32 precision flags (now restored):\n  "
        )
    else:
        assert model.raw() == before
    assert _flags.save_raw_state() == before


def test_names_each_changed_flag_with_both_values() -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    with pytest.raises(AssertionError) as caught:
        with assert_fp32_flags_unchanged():
            torch.set_float32_matmul_precision("medium")
            torch.backends.cudnn.allow_tf32 = False
    lines = str(caught.value).splitlines()
    assert "  torch.get_float32_matmul_precision(): 'highest' -> 'medium'" in lines
    assert "  torch.backends.cuda.matmul.allow_tf32: False -> True" in lines
    assert "  torch.backends.cudnn.allow_tf32: True -> False" in lines
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cudnn.allow_tf32 is True


@needs_new_api
def test_sees_a_change_no_reading_shows() -> None:
    # A slot that inherits "ieee" and one that holds "ieee" read the same; only a later
    # write to the parent tells them apart.
    mkldnn_matmul: Any = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]
    torch.backends.fp32_precision = "ieee"  # type: ignore[attr-defined]
    mkldnn_matmul.fp32_precision = "none"
    assert mkldnn_matmul.fp32_precision == "ieee"
    with pytest.raises(AssertionError, match="reads the same, but its raw slot changed 'none' -> 'ieee'"):
        with assert_fp32_flags_unchanged():
            mkldnn_matmul.fp32_precision = "ieee"
    # Restored: the slot inherits again, so a write to its parent reaches it.
    torch.backends.fp32_precision = "tf32"  # type: ignore[attr-defined]
    assert mkldnn_matmul.fp32_precision == "tf32"


def test_scopes_and_wrappers_pass() -> None:
    torch.set_float32_matmul_precision("high")
    node = Fp32ScopedModule(torch.nn.Linear(4, 4), Fp32Precision("highest", False))
    with assert_fp32_flags_unchanged():
        with fp32_precision_scope(Fp32Precision("medium", True)):
            node(torch.randn(2, 4)).sum().backward()


def test_restore_false_leaves_the_change() -> None:
    torch.set_float32_matmul_precision("highest")
    with pytest.raises(AssertionError, match=r"\(left as the block set them\)"):
        with assert_fp32_flags_unchanged(restore=False):
            torch.set_float32_matmul_precision("high")
    assert torch.get_float32_matmul_precision() == "high"


def test_a_block_that_raises_keeps_its_exception() -> None:
    torch.set_float32_matmul_precision("highest")
    with pytest.raises(KeyError):
        with assert_fp32_flags_unchanged(restore=False):
            torch.set_float32_matmul_precision("high")
            raise KeyError


def test_as_a_decorator_each_call_is_checked_and_nesting_works() -> None:
    check = assert_fp32_flags_unchanged()

    @check
    def step(depth: int, leak: bool) -> int:
        if depth:
            return step(depth - 1, leak)
        if leak:
            torch.set_float32_matmul_precision("medium")
        return depth

    torch.set_float32_matmul_precision("highest")
    assert step(3, False) == 0
    with pytest.raises(AssertionError, match="'highest' -> 'medium'"):
        step(2, True)
    assert torch.get_float32_matmul_precision() == "highest"


def test_restore_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="restore must be True or False; got 1 of type int"):
        assert_fp32_flags_unchanged(restore=1)  # type: ignore[arg-type]
