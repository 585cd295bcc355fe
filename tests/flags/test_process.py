"""set_process_default and current_fp32_precision."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    Fp32ScopeError,
    current_fp32_precision,
    fp32_precision_scope,
    set_process_default,
)
from fp32scope._flags import torch_flags as _flags
from tests._support.common import ALL
from tests._support.releases import make_unusual_state, needs_new_api
from tests._support.torch_model import TorchModel, Write, apply_writes, flag_writes


@pytest.mark.parametrize("precision", ALL, ids=str)
def test_set_process_default_is_consistent_in_both_apis(precision: Fp32Precision) -> None:
    # Start from a mixed state with tf32 parents, the hardest place to be consistent from
    # (before torch 2.9, from a non-default legacy state: there is one API only).
    if _flags.HAS_NEW_API:
        torch.backends.fp32_precision = "tf32"  # type: ignore[attr-defined]
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        make_unusual_state()
    set_process_default(precision)
    readings = _flags.read_all()
    assert _flags.RAISES not in readings.values()
    assert torch.get_float32_matmul_precision() == precision.matmul
    assert torch.backends.cuda.matmul.allow_tf32 is (precision.matmul != "highest")
    assert torch.backends.cudnn.allow_tf32 is precision.cudnn_allow_tf32
    assert current_fp32_precision() == precision
    if not _flags.HAS_NEW_API:
        return
    tf32 = "tf32" if precision.cudnn_allow_tf32 else None
    for op in ("conv", "rnn"):
        assert (getattr(torch.backends.cudnn, op).fp32_precision == "tf32") is (tf32 is not None)
    if not precision.cudnn_allow_tf32:
        assert torch.backends.cudnn.fp32_precision != "tf32"


def test_a_none_field_is_left_as_it_is() -> None:
    torch.set_float32_matmul_precision("medium")
    before = _flags.read_all()
    set_process_default(Fp32Precision(None, False))
    after = _flags.read_all()
    matmul_names = [_flags.LEGACY_MATMUL, _flags.LEGACY_CUBLAS]
    if _flags.HAS_NEW_API:
        matmul_names.append(_flags.SLOT_NAMES["mkldnn", "matmul"])
    for name in matmul_names:
        assert after[name] == before[name]
    assert after[_flags.LEGACY_CUDNN] is False
    set_process_default(None)
    set_process_default(Fp32Precision())
    assert _flags.read_all() == after


@needs_new_api
@pytest.mark.parametrize(
    ("writes", "expected"),
    [
        # "high", then cuBLAS set to ieee: the legacy getter still says "high" (stale) and the
        # cuBLAS one raises; oneDNN still uses tf32, so the least precise setting is "high".
        ([("legacy", "high"), (("cuda", "matmul"), "ieee")], Fp32Precision("high", True)),
        (
            [("legacy", "high"), (("cuda", "matmul"), "ieee"), (("mkldnn", "matmul"), "ieee")],
            Fp32Precision("highest", True),
        ),
        ([(("mkldnn", "matmul"), "bf16")], Fp32Precision("medium", True)),
        ([(("cuda", "matmul"), "tf32")], Fp32Precision("high", True)),
        # What the legacy "medium" write makes, through the per-backend API (either order of
        # writes): bf16 on oneDNN is less precise than tf32 on cuBLAS, so "medium".
        ([(("cuda", "matmul"), "tf32"), (("mkldnn", "matmul"), "bf16")], Fp32Precision("medium", True)),
        ([(("mkldnn", "matmul"), "bf16"), (("cuda", "matmul"), "tf32")], Fp32Precision("medium", True)),
        ([(("cuda", "conv"), "ieee")], Fp32Precision("highest", True)),  # rnn still tf32
        ([(("cuda", "conv"), "ieee"), (("cuda", "rnn"), "ieee")], Fp32Precision("highest", False)),
        # cudnn.allow_tf32 = False under a tf32 parent: conv and rnn still resolve to tf32.
        ([(("generic", "all"), "tf32"), ("cudnn", "False")], Fp32Precision("high", True)),
    ],
)
def test_current_in_mixed_states_reports_the_least_precise_setting(
    writes: list[tuple[object, str]], expected: Fp32Precision
) -> None:
    _flags.restore_raw_state(TorchModel().raw())  # from a fresh process's state
    for key, value in writes:
        if key == "legacy":
            torch.set_float32_matmul_precision(value)
        elif key == "cudnn":
            torch.backends.cudnn.allow_tf32 = value == "True"
        else:
            _slot_object(key).fp32_precision = value  # type: ignore[arg-type, attr-defined]
    assert _flags.RAISES in _flags.read_all().values()
    assert current_fp32_precision() == expected


def _slot_object(key: tuple[str, str]) -> object:
    *path, _ = _flags.SLOT_NAMES[key].split(".")
    obj: object = torch
    for part in path[1:]:
        obj = getattr(obj, part)
    return obj


writes = flag_writes(max_size=8)


@settings(max_examples=300, deadline=None)
@given(writes)
def test_current_never_raises_and_agrees_with_torch_when_consistent(sequence: list[Write]) -> None:
    model = TorchModel()
    _flags.restore_raw_state(model.raw())
    apply_writes(model, sequence)
    current = current_fp32_precision()
    assert current.matmul in ("highest", "high", "medium")
    assert type(current.cudnn_allow_tf32) is bool
    readings = _flags.read_all()
    if readings[_flags.LEGACY_MATMUL] != _flags.RAISES and readings[_flags.LEGACY_CUBLAS] != _flags.RAISES:
        assert current.matmul == torch.get_float32_matmul_precision()
    if readings[_flags.LEGACY_CUDNN] != _flags.RAISES:
        assert current.cudnn_allow_tf32 is torch.backends.cudnn.allow_tf32


def test_set_process_default_inside_a_scope_on_the_same_thread_says_to_call_it_outside() -> None:
    torch.set_float32_matmul_precision("high")
    before = _flags.save_raw_state()
    with fp32_precision_scope(Fp32Precision("highest")):
        with pytest.raises(Fp32ScopeError) as caught:
            set_process_default(Fp32Precision("medium"))
    message = str(caught.value)
    assert message.startswith("Cannot call set_process_default inside an fp32_precision_scope")
    assert "Call set_process_default outside any scope: once at start-up, or between forwards." in message
    # Not the advice for two threads: there is only one here.
    assert "thread" not in message
    assert _flags.save_raw_state() == before


@pytest.mark.parametrize("precision", [None, Fp32Precision(), Fp32Precision("medium")], ids=str)
def test_set_process_default_inside_a_scope_is_refused_also_when_it_would_change_nothing(
    precision: Fp32Precision | None,
) -> None:
    # A call there is a mistake whatever it asks: None and an all-None precision too.
    torch.set_float32_matmul_precision("high")
    with fp32_precision_scope(Fp32Precision("highest")):
        inside = _flags.save_raw_state()
        with pytest.raises(Fp32ScopeError, match="Cannot call set_process_default inside an fp32_precision_scope"):
            set_process_default(precision)
        assert _flags.save_raw_state() == inside


@pytest.mark.parametrize("precision", [None, Fp32Precision()], ids=str)
def test_set_process_default_of_nothing_while_another_thread_is_in_a_scope_is_refused(
    precision: Fp32Precision | None,
) -> None:
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with fp32_precision_scope(Fp32Precision("highest")):
            inside.set()
            release.wait(30)

    holder = threading.Thread(target=hold, name="forward")
    holder.start()
    try:
        assert inside.wait(30)
        with pytest.raises(Fp32ScopeError, match="Cannot call set_process_default on thread"):
            set_process_default(precision)
    finally:
        release.set()
        holder.join(30)


def test_set_process_default_inside_a_scoped_nodes_forward_gets_the_same_advice() -> None:
    class SetsDefault(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            set_process_default(Fp32Precision("medium"))
            return x

    node = Fp32ScopedModule(SetsDefault(), Fp32Precision("highest"))
    with pytest.raises(Fp32ScopeError, match="Call set_process_default outside any scope"):
        node(torch.ones(1))


def test_set_process_default_while_another_thread_is_in_a_scope_keeps_the_thread_advice() -> None:
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with fp32_precision_scope(Fp32Precision("highest")):
            inside.set()
            release.wait(30)

    holder = threading.Thread(target=hold, name="forward")
    holder.start()
    try:
        assert inside.wait(30)
        with pytest.raises(Fp32ScopeError) as caught:
            set_process_default(Fp32Precision("medium"))
    finally:
        release.set()
        holder.join(30)
    message = str(caught.value)
    assert message.startswith("Cannot call set_process_default on thread 'MainThread'")
    assert "while thread 'forward'" in message
    assert "Run all scoped calls on one thread" in message
