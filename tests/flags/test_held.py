"""The held checks (the scope's fast path) against apply and restore, over every reachable state.

A held check must return exactly the token apply returns wherever apply writes nothing,
None wherever apply would write, and change nothing itself; on exit a scope trusts it in
place of restore, so it must also fail wherever restore would find the precision broken.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings

from fp32scope import Fp32Precision, _compat, fp32_precision_scope
from fp32scope._flags import dynamo_exclude
from fp32scope._flags import scope as _scope
from fp32scope._flags import torch_flags as _flags
from fp32scope._flags.scope import wrapper_scope
from tests._support.torch_model import TorchModel

BFX9: list[str] = ["bfx9"] if _compat.HAS_BFX9 else []
PRECISIONS = [
    (t, b) for t in (None, "highest", "high", "medium", *BFX9) for b in (None, True, False) if (t, b) != (None, None)
]
LEGACY_PRECISIONS = [(t, b) for t, b in PRECISIONS if t != "bfx9"]

_writes: list[st.SearchStrategy[tuple[Any, Any]]] = [
    st.tuples(st.just("legacy"), st.sampled_from(["highest", "high", "medium"])),
    st.tuples(st.just("cudnn"), st.booleans()),
    st.tuples(st.just("cublas"), st.booleans()),
]
if _flags.HAS_NEW_API:  # every slot value, the mixed states included
    _writes.append(
        st.tuples(
            st.sampled_from([(b, o) for b, o, _ in _flags.SLOTS]),
            st.sampled_from(["none", "ieee", "tf32", "bf16", *BFX9]),
        )
    )
writes = st.lists(st.one_of(*_writes), max_size=8)

# A state random writes rarely reach: cuDNN TF32 off by the legacy getter (conv and rnn pinned
# to ieee) while cuda/all itself reads tf32, which Inductor's conv templates read: not held.
CUDA_ALL_TF32 = [("cudnn", False), (("cuda", "conv"), "ieee"), (("cuda", "rnn"), "ieee"), (("cuda", "all"), "tf32")]


def _with_rare_states(**others: object) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def decorate(test: Callable[..., None]) -> Callable[..., None]:
        return example(sequence=CUDA_ALL_TF32, **others)(test) if _flags.HAS_NEW_API else test

    return decorate


def _reach(sequence: list[tuple[Any, Any]]) -> TorchModel:
    model = TorchModel()
    _flags.restore_raw_state(model.raw())
    _write(model, sequence)
    return model


def _write(model: TorchModel, sequence: list[tuple[Any, Any]]) -> None:
    """Make ``sequence``'s writes through ``model``, which makes each in torch too."""
    for key, value in sequence:
        if key == "legacy":
            model.set_matmul_precision(value)
        elif key == "cudnn":
            model.set_cudnn_allow_tf32(value)
        elif key == "cublas":
            model.set_cublas_allow_tf32(value)
        else:
            model.set_slot(key[0], key[1], value)


def _writes_nothing(token: _flags.Token) -> bool:
    return token[2] is None and type(token[3]) is not tuple


@settings(max_examples=300, deadline=None)
@given(sequence=writes)
@_with_rare_states()
def test_a_held_check_answers_what_apply_finds(sequence: list[tuple[Any, Any]]) -> None:
    model = _reach(sequence)
    for t, b in PRECISIONS:
        before = _flags.save_raw_state()
        found = _flags.held_check(t, b)()
        assert _flags.save_raw_state() == before, f"the held check of {(t, b)} wrote"
        token = _flags.apply(t, b)
        try:
            if _writes_nothing(token):
                assert found == token, (t, b)
            else:
                assert found is None, (t, b, token)
        finally:
            _flags.restore(token)
        assert _flags.save_raw_state() == model.raw()


@settings(max_examples=300, deadline=None)
@given(sequence=writes, inside=writes)
@_with_rare_states(inside=[])
def test_a_held_check_fails_wherever_restore_finds_the_precision_broken(
    sequence: list[tuple[Any, Any]], inside: list[tuple[Any, Any]]
) -> None:
    # Enter where the precision holds, then let the block write: the exit's held check must
    # pass exactly where restore finds nothing to report (and so writes nothing).
    _reach(sequence)
    for t, b in PRECISIONS:
        outer = _flags.apply(t, b)  # now it holds
        token = _flags.apply(t, b)
        assert _writes_nothing(token)
        state = _flags.save_raw_state()
        _write(TorchModel.from_raw(state), inside)
        passed = _flags.held_check(t, b)() is not None
        after = _flags.save_raw_state()
        changed = _flags.restore(token)
        assert passed == (changed is None), (t, b, changed)
        if passed:
            assert _flags.save_raw_state() == after, "restore wrote where the held check passed"
        _flags.restore_raw_state(state)
        _flags.restore(outer)


@pytest.mark.skipif(not _flags.HAS_NEW_API, reason="before torch 2.9 held_check is legacy_held_check: tested above")
@settings(max_examples=150, deadline=None)
@given(sequence=st.lists(st.one_of(*_writes[:2]), max_size=6))
def test_the_legacy_held_check_answers_what_legacy_apply_finds(sequence: list[tuple[Any, Any]]) -> None:
    model = _reach(sequence)
    model.set_matmul_precision(model.e)  # where legacy writes alone have been: what torch < 2.9 reaches
    model.set_cudnn_allow_tf32(model.b)
    for t, b in LEGACY_PRECISIONS:
        found = _flags.legacy_held_check(t, b)()
        token = _flags.legacy_apply(t, b)
        try:
            assert found == (token if _writes_nothing(token) else None), (t, b, token)
        finally:
            _flags.legacy_restore(token)
        assert _flags.save_raw_state() == model.raw()


def test_held_checks_are_made_once_per_precision() -> None:
    assert _flags.held_check("highest", False) is _flags.held_check("highest", False)
    assert _flags.held_check("highest", False) is not _flags.held_check("highest", True)
    assert _flags.legacy_held_check("high", None) is _flags.legacy_held_check("high", None)
    # The legacy check reads the legacy getters alone: the scope's own only before torch 2.9.
    assert (_flags.legacy_held_check("high", None) is _flags.held_check("high", None)) is (not _flags.HAS_NEW_API)


def test_a_scope_learns_only_once_entered_again() -> None:
    # A scope made for one `with` runs apply alone; a kept one uses the held check from its
    # second entry on, and drops it when an entry switches.
    default = Fp32Precision("high", True)
    _flags.apply("high", True)
    scope = fp32_precision_scope(default)
    assert scope._held is False
    with scope:
        assert scope._held is False
    assert scope._held is None  # exited once
    with scope:
        pass
    assert scope._held is _flags.held_check("high", True)
    outer = _flags.apply("highest", False)
    try:
        with scope:  # switches now
            assert scope._held is None
    finally:
        _flags.restore(outer)
    wrapper = wrapper_scope(default, "node")
    assert wrapper._held is None
    with wrapper:
        pass
    assert wrapper._held is _flags.held_check("high", True)


def test_a_learned_scope_restores_a_block_that_broke_its_precision() -> None:
    # The exit's held check fails: restore runs, re-applies the precision and warns.
    _flags.apply("high", True)
    scope = wrapper_scope(Fp32Precision("high", True), "node")
    with scope:
        pass
    assert scope._held
    before = _flags.save_raw_state()
    with pytest.warns(match="changed the float32 precision flags"), scope:
        _flags.apply("highest", False)
    assert _flags.save_raw_state() == before
    assert _scope.active_scope_thread() is None


def test_a_learned_scope_applies_its_precision_where_it_no_longer_holds() -> None:
    # While the precision holds, each entry keeps the learned check; once an entry finds
    # something else, it applies every field and restores what it found.
    _flags.apply("high", True)
    scope = wrapper_scope(Fp32Precision("high", True), "node")
    for _ in range(2):
        with scope:
            pass
    check = scope._held
    assert check is _flags.held_check("high", True)
    with scope:
        pass
    assert scope._held is check
    outer = _flags.apply("highest", False)
    try:
        before = _flags.save_raw_state()
        with scope:
            assert torch.get_float32_matmul_precision() == "high"
            assert torch.backends.cudnn.allow_tf32 is True
        assert _flags.save_raw_state() == before
    finally:
        _flags.restore(outer)


@pytest.mark.parametrize(
    "precision",
    [Fp32Precision("highest", None), Fp32Precision(None, cudnn_allow_tf32=False), Fp32Precision("highest", False)],
    ids=["matmul", "cudnn", "both"],
)
def test_a_kept_scope_nested_in_itself_restores_what_its_switching_entry_saved(precision: Fp32Precision) -> None:
    # The outer entry switches and saves; the inner entry of the same object finds the
    # precision held and learns its check; the outer exit must still restore what it saved.
    _flags.apply("high", True)
    before = _flags.save_raw_state()
    scope = wrapper_scope(precision, "node")
    with scope:
        inside = _flags.save_raw_state()
        with scope:
            pass
        assert scope._held is _flags.held_check(*precision)
        assert _flags.save_raw_state() == inside
    assert _flags.save_raw_state() == before
    assert _scope.active_scope_thread() is None


def test_every_held_check_is_kept_out_of_dynamos_frames() -> None:
    # A held check runs in the eager parts of a compiled caller (a scoped child's call), where
    # Dynamo's frame callback is active: like every other function of torch_flags its frames
    # are skipped, never converted (a converted check could fold the flags it reads).
    dynamo_exclude.ensure()
    skipped = set(dynamo_exclude._skipped)
    assert _flags.ALL_HELD_CHECKS
    assert [check for check in _flags.ALL_HELD_CHECKS if check.__code__ not in skipped] == []


def test_a_held_checks_traceback_shows_its_source() -> None:
    check = _flags.held_check("high", True)
    source = "".join(linecache.getlines(check.__code__.co_filename))
    assert "_GB() is True" in source
    assert "_GM() == " in source
