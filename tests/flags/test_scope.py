"""fp32_precision_scope: apply, restore on every exit path, nesting, fast path, flips, compile guard."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch

from fp32scope import Fp32FlagsChangedWarning, Fp32Precision, Fp32ScopeError, _compat, fp32_precision_scope
from fp32scope._flags import hooks as _hooks
from fp32scope._flags import scope as _scope
from fp32scope._flags import torch_flags as _flags
from tests._support.common import ALL, COMPILING_MESSAGE, BoomError
from tests._support.releases import TORCH_RELEASE, make_unusual_state, needs_legacy_only, needs_new_api
from tests._support.torch_model import HAS_ONEDNN_BOOL, read_onednn_bool


def legacy() -> tuple[str, bool]:
    return torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("precision", ALL, ids=str)
@pytest.mark.parametrize("default", ALL[:4:3], ids=str)
def test_applies_inside_and_restores_exactly(precision: Fp32Precision, default: Fp32Precision) -> None:
    torch.set_float32_matmul_precision(default.matmul)  # type: ignore[arg-type]
    torch.backends.cudnn.allow_tf32 = bool(default.cudnn_allow_tf32)
    before, raw = _flags.read_all(), _flags.save_raw_state()
    with fp32_precision_scope(precision):
        assert legacy() == tuple(precision)
        assert torch.backends.cuda.matmul.allow_tf32 is (precision.matmul != "highest")
        inside = _flags.read_all()
        assert _flags.RAISES not in inside.values()
    assert _flags.read_all() == before
    assert _flags.save_raw_state() == raw


@pytest.mark.parametrize("error", [BoomError("x"), KeyboardInterrupt(), SystemExit(3), GeneratorExit()])
def test_restores_when_the_block_raises_and_the_exception_propagates_unchanged(error: BaseException) -> None:
    torch.set_float32_matmul_precision("high")
    before, raw = _flags.read_all(), _flags.save_raw_state()
    with pytest.raises(type(error)) as info, fp32_precision_scope(Fp32Precision("highest", False)):
        assert legacy() == ("highest", False)
        raise error
    assert info.value is error
    assert _flags.read_all() == before
    assert _flags.save_raw_state() == raw
    assert _scope.active_scope_thread() is None


@needs_new_api
def test_never_trips_torchs_mixed_state_error() -> None:
    # The states torch's own cudnn.flags() crashes in.
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # type: ignore[attr-defined]
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        _ = torch.backends.cudnn.allow_tf32
    with pytest.raises(RuntimeError), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        pass
    before, raw = _flags.read_all(), _flags.save_raw_state()
    for precision in ALL:
        with fp32_precision_scope(precision):
            assert legacy() == precision
        assert _flags.read_all() == before
        assert _flags.save_raw_state() == raw


def test_nested_scopes_restore_last_in_first_out() -> None:
    torch.set_float32_matmul_precision("high")
    seen = []
    with fp32_precision_scope(Fp32Precision("highest", False)):
        seen.append(legacy())
        with fp32_precision_scope(Fp32Precision("medium")):
            seen.append(legacy())
            with fp32_precision_scope(Fp32Precision(None, True)):
                seen.append(legacy())
            seen.append(legacy())
        seen.append(legacy())
    seen.append(legacy())
    assert seen == [
        ("highest", False),
        ("medium", False),
        ("medium", True),
        ("medium", False),
        ("highest", False),
        ("high", True),
    ]


def test_one_scope_object_can_be_reentered() -> None:
    torch.set_float32_matmul_precision("high")
    inner = fp32_precision_scope(Fp32Precision("highest"))
    outer = fp32_precision_scope(Fp32Precision("medium"))
    with inner:
        with outer:
            with inner:
                assert legacy()[0] == "highest"
            assert legacy()[0] == "medium"
        assert legacy()[0] == "highest"
    assert legacy()[0] == "high"


def test_a_medium_scope_object_can_be_reentered() -> None:
    # "medium" scopes are of their own class on torch < 2.9 (Dynamo's reset): re-entry
    # restores last-in, first-out there too.
    torch.set_float32_matmul_precision("high")
    medium = fp32_precision_scope(Fp32Precision("medium", False))
    with medium:
        with fp32_precision_scope(Fp32Precision("highest", True)):
            with medium:
                assert legacy() == ("medium", False)
            assert legacy() == ("highest", True)
        assert legacy() == ("medium", False)
    assert legacy()[0] == "high"


@needs_new_api
def test_writes_nothing_where_the_flags_already_hold() -> None:
    # cuda/matmul inherits tf32 from cudnn.fp32_precision (cuda/all): "high" already holds in
    # torch's view. Writing it again would make the slot explicit, and a later write to its
    # parent would no longer reach it.
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.fp32_precision = "tf32"
    torch.backends.cuda.matmul.fp32_precision = "none"
    assert torch.get_float32_matmul_precision() == "high"
    raw = _flags.save_raw_state()
    with fp32_precision_scope(Fp32Precision("high", True)):
        assert _flags.save_raw_state() == raw
    torch.backends.cudnn.fp32_precision = "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"  # still inherits


def test_noop_scopes_touch_nothing_and_take_no_thread() -> None:
    make_unusual_state()
    raw = _flags.save_raw_state()
    for precision in (None, Fp32Precision()):
        scope = fp32_precision_scope(precision)
        assert scope.precision is None
        with scope:
            assert _scope.active_scope_thread() is None
            assert _flags.save_raw_state() == raw


def test_precision_and_repr() -> None:
    scope = fp32_precision_scope(Fp32Precision("high", False))
    assert scope.precision == Fp32Precision("high", False)
    assert repr(scope) == "fp32_precision_scope(Fp32Precision(matmul='high', cudnn_allow_tf32=False))"


# -- a block that flips the flags itself --------------------------------------------------


def test_flip_inside_is_restored_and_warned_about() -> None:
    torch.set_float32_matmul_precision("high")
    before, raw = _flags.read_all(), _flags.save_raw_state()
    with pytest.warns(Fp32FlagsChangedWarning) as record, fp32_precision_scope(Fp32Precision("highest", False)):
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = True
    message = str(record[0].message)
    assert "matmul precision applied as 'highest'" in message
    assert "torch.get_float32_matmul_precision() = 'medium'" in message
    assert "cudnn_allow_tf32 applied as False" in message
    assert "torch.backends.cudnn.allow_tf32 = True" in message
    assert record[0].filename == __file__  # points at the with statement
    assert _flags.read_all() == before
    assert _flags.save_raw_state() == raw


@needs_new_api
def test_new_api_flip_inside_is_detected() -> None:
    torch.set_float32_matmul_precision("highest")
    raw = _flags.save_raw_state()
    with pytest.warns(Fp32FlagsChangedWarning, match=r"cuda\.matmul\.fp32_precision = 'ieee'"):
        with fp32_precision_scope(Fp32Precision("high")):
            # Legacy getter still says "high" (stale); the cuBLAS getter now raises.
            torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert _flags.save_raw_state() == raw
    with pytest.warns(Fp32FlagsChangedWarning, match="matmul precision applied as 'highest'"):
        with fp32_precision_scope(Fp32Precision("highest")):
            torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert _flags.save_raw_state() == raw


def test_flip_inside_a_scope_that_found_the_flags_held_is_undone() -> None:
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = False
    before = _flags.read_all()
    with pytest.warns(Fp32FlagsChangedWarning) as record, fp32_precision_scope(Fp32Precision("high", False)):
        torch.set_float32_matmul_precision("highest")
        if _flags.HAS_NEW_API:
            torch.backends.cudnn.fp32_precision = "tf32"
        else:
            torch.backends.cudnn.allow_tf32 = True
    assert "cudnn_allow_tf32 applied as False" in str(record[0].message)
    assert _flags.read_all() == before


def test_no_warning_without_a_flip() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fp32_precision_scope(Fp32Precision("medium", False)):
            torch.ones(2) @ torch.ones(2)


@needs_new_api
def test_cudnn_false_under_a_tf32_parent_leaves_matmul_alone() -> None:
    # cudnn.allow_tf32 = False alone would leave conv/rnn resolving to tf32 here, and
    # Inductor's Triton conv templates read cudnn.fp32_precision itself.
    torch.backends.cudnn.fp32_precision = "tf32"
    matmul_names = [_flags.LEGACY_MATMUL, _flags.LEGACY_CUBLAS, _flags.SLOT_NAMES["cuda", "matmul"]]
    before, raw = _flags.read_all(), _flags.save_raw_state()
    with fp32_precision_scope(Fp32Precision(None, False)):
        inside = _flags.read_all()
        assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cudnn.fp32_precision != "tf32"
        assert torch.backends.cudnn.conv.fp32_precision != "tf32"  # type: ignore[attr-defined]
        assert torch.backends.cudnn.rnn.fp32_precision != "tf32"  # type: ignore[attr-defined]
        assert [inside[n] for n in matmul_names] == [before[n] for n in matmul_names]
    assert _flags.save_raw_state() == raw


# -- "already holds" means every governed slot (issue 7, defect 5) ------------------------


def _legacy_medium() -> None:
    torch.set_float32_matmul_precision("medium")


def _legacy_cublas_on() -> None:
    # The cuBLAS legacy bool writes E ("high") and cuda/matmul only: oneDNN keeps its slot.
    torch.backends.cuda.matmul.allow_tf32 = True


@needs_new_api
@pytest.mark.parametrize(
    ("legacy_write", "precision"),
    [
        pytest.param(_legacy_medium, "medium", id="set_float32_matmul_precision('medium')"),
        pytest.param(_legacy_cublas_on, "high", id="cuda.matmul.allow_tf32=True"),
    ],
)
@pytest.mark.parametrize("onednn", ["none", "ieee"])
def test_a_field_held_only_in_the_legacy_readings_is_applied(
    legacy_write: Callable[[], None], precision: str, onednn: str
) -> None:
    # Then oneDNN's matmul slot moved: every legacy reading still says ``precision``, but
    # oneDNN matmuls run in full fp32. The scope must not take that for "already holds".
    legacy_write()
    torch.backends.mkldnn.matmul.fp32_precision = onednn  # type: ignore[attr-defined]
    assert legacy()[0] == precision
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.backends.mkldnn.matmul.fp32_precision == onednn  # type: ignore[attr-defined]
    before, raw = _flags.read_all(), _flags.save_raw_state()
    with fp32_precision_scope(Fp32Precision(precision)):  # type: ignore[arg-type]
        # What torch.set_float32_matmul_precision(precision) leaves, on both backends.
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision == ("bf16" if precision == "medium" else "tf32")  # type: ignore[attr-defined]
        assert legacy()[0] == precision
    assert _flags.read_all() == before
    assert _flags.save_raw_state() == raw


@needs_new_api
def test_moving_onednn_inside_a_held_scope_is_detected_and_undone() -> None:
    # The exit check uses the entry's definition of "holds".
    torch.set_float32_matmul_precision("medium")
    raw = _flags.save_raw_state()
    with pytest.warns(Fp32FlagsChangedWarning, match=r"mkldnn\.matmul\.fp32_precision = 'ieee'"):
        with fp32_precision_scope(Fp32Precision("medium")):
            assert _flags.save_raw_state() == raw  # held: nothing written
            torch.backends.mkldnn.matmul.fp32_precision = "ieee"  # type: ignore[attr-defined]
    assert _flags.save_raw_state() == raw


@needs_new_api
def test_a_medium_scope_runs_onednn_matmuls_in_bf16_where_the_slot_was_moved() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 512, generator=g), torch.randn(512, 512, generator=g)
    torch.set_float32_matmul_precision("highest")
    full = a @ b
    torch.set_float32_matmul_precision("medium")
    reduced = a @ b
    if torch.equal(full, reduced):
        pytest.skip("this CPU shows no bf16 effect for 'medium' (no oneDNN bf16 matmul); the slot tests cover it")
    torch.backends.mkldnn.matmul.fp32_precision = "none"  # type: ignore[attr-defined]
    assert torch.get_float32_matmul_precision() == "medium"
    assert torch.equal(a @ b, full)  # full fp32, whatever the legacy reading says
    with fp32_precision_scope(Fp32Precision("medium")):
        assert torch.equal(a @ b, reduced)
    assert torch.equal(a @ b, full)


# -- the legacy oneDNN TF32 bool (torch >= 2.7) --------------------------------------------


@pytest.mark.skipif(
    not HAS_ONEDNN_BOOL,
    reason=f"torch {TORCH_RELEASE} has no legacy oneDNN TF32 bool (torch.backends.mkldnn.allow_tf32, torch >= 2.7)",
)
def test_the_onednn_tf32_bool_is_not_a_matmul_flag_and_scopes_leave_it() -> None:
    # torch.backends.mkldnn.allow_tf32 is the Intel GPU (XPU) oneDNN TF32 switch. No matmul
    # setter writes it, so a scope has nothing of it to restore: checked here on whatever
    # build this is. Without XPU, torch stores nothing (the setter warns, the getter says None).
    start = read_onednn_bool()
    for value in ("highest", "high", "medium"):
        torch.set_float32_matmul_precision(value)
        assert read_onednn_bool() == start, f"set_float32_matmul_precision({value!r}) wrote it"
        for precision in ALL:
            with fp32_precision_scope(precision):
                assert read_onednn_bool() == start
            assert read_onednn_bool() == start
    if start is None:
        with pytest.warns(UserWarning, match="available for Intel GPUs"):
            torch._C._set_onednn_allow_tf32(True)
        assert read_onednn_bool() is None


# -- releases before torch 2.9, for real -------------------------------------------------


@needs_legacy_only
def test_a_legacy_release_runs_the_legacy_implementation() -> None:
    assert _scope._apply is _flags.legacy_apply
    assert _scope._restore is _flags.legacy_restore
    assert set(_flags.read_all()) == {_flags.LEGACY_MATMUL, _flags.LEGACY_CUBLAS, _flags.LEGACY_CUDNN}
    assert not hasattr(torch._C, "_get_fp32_precision_getter")


@needs_legacy_only
@pytest.mark.parametrize(
    "call",
    [lambda: _flags.raw_all("cuda"), lambda: _flags.raw_op("cuda", "matmul")],
    ids=["raw_all", "raw_op"],
)
def test_the_per_backend_readers_on_a_legacy_release_say_which_torch_they_need(call: Callable[[], object]) -> None:
    # The per-backend implementation stays importable there (the tests run it on new
    # releases); called on torch < 2.9 it says so instead of failing inside torch._C.
    before = _flags.read_all()
    msg = (
        f"fp32scope: torch {torch.__version__} has no per-backend fp32_precision API (torch >= 2.9); "
        "this function is for torch >= 2.9 only"
    )
    with pytest.raises(RuntimeError, match=f"^{re.escape(msg)}$"):
        call()
    assert _flags.read_all() == before


@needs_legacy_only
def test_new_api_names_on_a_legacy_release_change_nothing() -> None:
    # torch < 2.9 refuses torch.backends.cuda.matmul.fp32_precision, but takes
    # torch.backends.fp32_precision and torch.backends.cudnn.fp32_precision as plain module
    # attributes: they store a string and change no flag. Scopes see the real flags.
    with pytest.raises(AttributeError, match="fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.set_float32_matmul_precision("high")
    before = _flags.read_all()
    try:
        torch.backends.fp32_precision = "ieee"  # type: ignore[attr-defined]
        torch.backends.cudnn.fp32_precision = "ieee"
        assert _flags.read_all() == before
        with fp32_precision_scope(Fp32Precision("highest", False)):
            assert legacy() == ("highest", False)
        assert _flags.read_all() == before
    finally:
        del torch.backends.fp32_precision  # type: ignore[attr-defined]
        del torch.backends.cudnn.fp32_precision


@needs_legacy_only
@pytest.mark.parametrize("default", ["highest", "high", "medium"])
def test_legacy_held_field_writes_nothing_and_a_flip_is_undone(default: str) -> None:
    torch.set_float32_matmul_precision(default)
    with pytest.warns(Fp32FlagsChangedWarning, match=f"matmul precision applied as {default!r}"):
        with fp32_precision_scope(Fp32Precision(default)):  # type: ignore[arg-type]
            other = "highest" if default != "highest" else "medium"
            torch.set_float32_matmul_precision(other)
    assert legacy()[0] == default


# -- compiled regions --------------------------------------------------------------------


def scoped_matmul(x: torch.Tensor) -> tuple[torch.Tensor, str]:
    with fp32_precision_scope(Fp32Precision("highest")):
        y = x @ x
        seen = torch.get_float32_matmul_precision()
    return y + 1, seen


@pytest.mark.compile
def test_entering_inside_a_compiled_region_falls_back_to_eager_with_a_graph_break() -> None:
    torch._dynamo.reset()
    torch.set_float32_matmul_precision("high")
    x = torch.randn(4, 4)
    out, seen = torch.compile(scoped_matmul, backend="eager")(x)
    assert seen == "highest"  # the frame ran eagerly, where the scope works
    assert torch.equal(out, scoped_matmul(x)[0])
    assert torch.get_float32_matmul_precision() == "high"
    assert _scope.active_scope_thread() is None


@pytest.mark.compile
def test_entering_inside_a_fullgraph_region_is_an_error_with_the_message() -> None:
    torch._dynamo.reset()
    torch.set_float32_matmul_precision("high")
    raw = _flags.save_raw_state()
    with pytest.raises(RuntimeError) as info:
        torch.compile(scoped_matmul, backend="eager", fullgraph=True)(torch.randn(2, 2))
    assert COMPILING_MESSAGE in str(info.value)
    assert "Fp32ScopedModule(torch.compile(module), precision)" in str(info.value)
    assert _flags.save_raw_state() == raw
    assert _scope.active_scope_thread() is None


def test_refusal_message_is_raised_as_fp32_scope_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # What Dynamo sees while tracing: is_dynamo_compiling() folds to True there.
    monkeypatch.setattr(_scope, "_is_dynamo_compiling", lambda: True)
    raw = _flags.save_raw_state()
    with (
        pytest.raises(Fp32ScopeError, match="Wrap the compiled callable instead"),
        fp32_precision_scope(Fp32Precision("high")),
    ):
        pass
    assert _flags.save_raw_state() == raw
    assert _scope.active_scope_thread() is None


def test_torch_compilers_own_flag_refuses_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.export's (and from torch 2.13 a torch.compile session's) own flag: is_compiling()
    # is True outside Dynamo. Before torch.compiler.is_exporting (torch 2.4) only export sets
    # it, and the refusal says what export needs.
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()
    raw = _flags.save_raw_state()
    expected = "Wrap the compiled callable instead" if _compat.HAS_IS_EXPORTING else "torch.export cannot export"
    with pytest.raises(Fp32ScopeError, match=expected), fp32_precision_scope(Fp32Precision("high")):
        pass
    assert _flags.save_raw_state() == raw
    assert _scope.active_scope_thread() is None


class _RangeRefused:
    """A profiler range that cannot be opened: an interrupt at that moment."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        raise KeyboardInterrupt


def test_a_wrapper_scope_whose_range_cannot_open_exits_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # The scope has applied its precision when the profiler range fails, inside __enter__,
    # so the `with` never runs its exit: the scope restores the flags itself, releases the
    # thread, and the interrupt leaves unchanged.
    monkeypatch.setattr(_hooks, "_record_function", _RangeRefused)
    torch.set_float32_matmul_precision("high")
    before = _flags.save_raw_state()
    scope = _scope.wrapper_scope(Fp32Precision("highest", False), "head")
    with torch.profiler.profile(), pytest.raises(KeyboardInterrupt) as info:
        with scope:
            pytest.fail("the block must not run")
    assert type(info.value) is KeyboardInterrupt
    assert _flags.save_raw_state() == before
    assert _scope.active_scope_thread() is None
    with scope:  # usable again: nothing of the failed entry is left on it
        assert legacy() == ("highest", False)
    assert _flags.save_raw_state() == before


@pytest.mark.parametrize("flag", [False, True])
def test_the_scopes_compiling_check_is_torchs_is_compiling(monkeypatch: pytest.MonkeyPatch, flag: bool) -> None:
    # The scope reads is_compiling() as its two parts (_compat): on every tested release
    # torch.compiler has the flag, and the parts answer what is_compiling() answers.
    assert _compat.HAS_COMPILING_FLAG
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", flag)
    fast = _compat.is_dynamo_compiling() or _compat.COMPILER_STATE[_compat.COMPILING_FLAG]
    assert fast is torch.compiler.is_compiling() is flag
