"""Behaviour that the mutation run (``nox -s mutation``) found untested.

Each test here pins down what a surviving mutant changed: the words of an error, the claim
a scope releases when applying fails. They go through the public entry points (or the
module-level functions the package itself calls), not through line details.
"""

from __future__ import annotations

import sys
import threading
import warnings

import pytest
import torch

from fp32scope import (
    Fp32FlagsChangedWarning,
    Fp32Precision,
    Fp32ScopeError,
    _compat,
    fp32_precision_scope,
    node_fp32_precision,
    set_process_default,
    with_fp32_precision,
)
from fp32scope._flags import scope as _scope
from fp32scope._flags import torch_flags as _flags
from fp32scope._flags.precision import MATMUL_PRECISIONS
from tests._support.releases import needs_no_bfx9


@pytest.mark.parametrize(
    ("word", "meant"),
    [("tf-32", "high"), ("TF_32", "high"), ("bfloat-16", "medium"), ("bf_16", "medium"), ("tensor_float-32", "high")],
)
def test_spellings_with_hyphens_and_underscores_get_the_hint(word: str, meant: str) -> None:
    with pytest.raises(ValueError, match="must be one of") as caught:
        fp32_precision_scope(Fp32Precision(word))  # type: ignore[arg-type]
    assert f"for {word!r} write {meant!r}" in str(caught.value)


def test_an_error_without_a_node_starts_with_the_argument_alone() -> None:
    with pytest.raises(ValueError, match="must be one of") as matmul:
        fp32_precision_scope(Fp32Precision("fast"))  # type: ignore[arg-type]
    words = ", ".join(map(repr, MATMUL_PRECISIONS))  # what this torch accepts ('bfx9' from torch 2.15)
    assert str(matmul.value) == f"precision.matmul must be one of {words} or None; got 'fast'."
    with pytest.raises(TypeError, match="must be a str") as not_str:
        fp32_precision_scope(Fp32Precision(1))  # type: ignore[arg-type]
    assert str(not_str.value) == f"precision.matmul must be a str, one of {words}, or None; got 1 of type int."
    with pytest.raises(TypeError, match="must be True") as cudnn:
        set_process_default(Fp32Precision(None, "yes"))  # type: ignore[arg-type]
    assert str(cudnn.value) == "precision.cudnn_allow_tf32 must be True, False or None; got 'yes' of type str."


@pytest.mark.parametrize("word", ["bf16x9", "BF16_X9"])
def test_bf16x9_gets_torchs_word_for_it(word: str) -> None:
    with pytest.raises(ValueError, match="must be one of") as caught:
        fp32_precision_scope(Fp32Precision(word))  # type: ignore[arg-type]
    assert str(caught.value).endswith(f"got {word!r} (torch's word for {word!r} is 'bfx9').")


@needs_no_bfx9
def test_bfx9_on_a_torch_without_it_says_what_to_do_in_full() -> None:
    class Head(torch.nn.Linear):
        float32_matmul_precision = "bfx9"

    with pytest.raises(ValueError, match="bfx9") as caught:
        node_fp32_precision("head", Head(2, 2))
    assert str(caught.value) == (
        "float32_matmul_precision of node 'head' is 'bfx9' (cuBLAS float32 emulated with nine bf16 products), "
        f"which torch {_compat.TORCH_RELEASE} does not have: it came in torch {_compat.BFX9_RELEASE}. "
        "Upgrade torch, or use 'highest' for full float32."
    )


def test_argument_errors_name_the_argument_and_the_value_type() -> None:
    with pytest.raises(TypeError, match="backward must be") as backward:
        with_fp32_precision(Fp32Precision("high"), backward="yes")  # type: ignore[arg-type]
    assert str(backward.value) == (
        "backward must be True (scope the node's backward too, the default) or False (forward only); "
        "got 'yes' of type str."
    )
    with pytest.raises(TypeError, match="node_name must be") as node_name:
        node_fp32_precision(1, torch.nn.Linear(1, 1))  # type: ignore[arg-type]
    assert str(node_name.value) == "node_name must be a str; got 1 of type int."


def test_the_conflict_error_says_why_and_what_to_do() -> None:
    inside, release = threading.Event(), threading.Event()

    def forward() -> None:
        with fp32_precision_scope(Fp32Precision("highest", False)):
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=forward, name="forward")
    thread.start()
    try:
        assert inside.wait(10)
        with pytest.raises(Fp32ScopeError) as caught:
            with fp32_precision_scope(Fp32Precision("medium")):
                pass
    finally:
        release.set()
        thread.join(10)
    message = str(caught.value)
    assert message.startswith("Cannot enter an fp32_precision_scope on thread ")
    assert "while thread 'forward' (ident " in message
    assert "is inside an fp32_precision_scope. The float32 precision flags are process-wide, not per thread" in message
    assert "this would change the precision of the kernels that thread is launching." in message
    assert "Run all scoped calls on one thread" in message
    assert message.endswith("or serialize them with a lock held around each scoped call.")


class Interrupted(BaseException):
    """Stands for a KeyboardInterrupt arriving while a scope applies its precision."""


def test_a_scope_whose_apply_is_interrupted_releases_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(t: str | None, b: bool | None) -> _flags.Token:
        raise Interrupted

    before = _flags.save_raw_state()
    monkeypatch.setattr(_scope, "_apply", interrupted)
    with pytest.raises(Interrupted):
        with fp32_precision_scope(Fp32Precision("medium")):
            pytest.fail("the block ran although applying the precision failed")
    monkeypatch.undo()
    assert _scope.active_scope_thread() is None  # no thread left holding the flags
    assert _flags.save_raw_state() == before
    # Another thread can now enter a scope, and afterwards no thread holds the flags.
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with fp32_precision_scope(Fp32Precision("highest")):
                pass
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=other, name="other")
    thread.start()
    thread.join(10)
    assert errors == []
    assert _scope.active_scope_thread() is None


@pytest.mark.parametrize("implementation", ["in use", "legacy"])
@pytest.mark.parametrize("start", ["highest", "medium"])
def test_an_interrupt_at_torchs_cudnn_setter_leaves_the_matmul_field_as_it_was(
    start: str, implementation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scope writes the matmul field first, then cuDNN's. An interrupt (a signal, a
    # KeyboardInterrupt) arriving just as torch's cuDNN setter is called ends the scope's
    # entry there: the matmul field written already must be undone. Python's profiler hook
    # raises it at that call (the hook runs before any builtin it is told of).
    set_process_default(Fp32Precision(start, True))  # type: ignore[arg-type]
    before = _flags.save_raw_state()
    if implementation == "legacy":  # as on torch < 2.9 (where it is the one in use anyway)
        monkeypatch.setattr(_scope, "_apply", _flags.legacy_apply)
        monkeypatch.setattr(_scope, "_restore", _flags.legacy_restore)
    setter = torch._C._set_cudnn_allow_tf32

    def interrupt_at_the_setter(_frame: object, event: str, arg: object) -> None:
        if event == "c_call" and arg is setter:
            raise Interrupted

    outer = sys.getprofile()
    sys.setprofile(interrupt_at_the_setter)
    try:
        with pytest.raises(Interrupted), fp32_precision_scope(Fp32Precision("high", False)):
            pytest.fail("the block ran although applying the precision failed")
    finally:
        sys.setprofile(outer)
    if implementation == "in use":
        assert _flags.save_raw_state() == before
    assert torch.get_float32_matmul_precision() == start
    assert torch.backends.cudnn.allow_tf32 is True
    assert _scope.active_scope_thread() is None


def _flip_warning(run: object) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()  # type: ignore[operator]
    found = [w for w in caught if issubclass(w.category, Fp32FlagsChangedWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    return str(found[0].message)


def test_the_flip_warning_names_the_wrapper_and_says_what_to_do() -> None:
    @with_fp32_precision(Fp32Precision("highest"), name="head")
    def head() -> None:
        torch.set_float32_matmul_precision("high")

    message = _flip_warning(head)
    assert message.startswith(
        "The code inside an fp32_precision_scope around 'head' changed the float32 precision flags the "
        "scope applied; the scope restored the state it saved on entry. Changed: "
    )
    assert message.endswith(
        ". Declare the precision on the node (or its wrapper) instead of setting torch's flags inside its forward."
    )


def test_the_flip_warning_of_an_unnamed_scope_names_no_node() -> None:
    def block() -> None:
        with fp32_precision_scope(Fp32Precision("highest")):
            torch.set_float32_matmul_precision("high")

    assert _flip_warning(block).startswith("The code inside an fp32_precision_scope changed the float32 precision")


legacy_swapped_in = pytest.mark.skipif(
    not _flags.HAS_NEW_API,
    reason=f"torch {torch.__version__}: the legacy implementation is the one in use, and the flip tests run it",
)


@legacy_swapped_in
@pytest.mark.parametrize("held", [False, True], ids=["applied", "already-held"])
def test_the_legacy_implementation_undoes_and_names_a_flip(monkeypatch: pytest.MonkeyPatch, held: bool) -> None:
    # What torch < 2.9 runs, swapped in on this torch as tests/flags/test_state_machine.py does.
    monkeypatch.setattr(_scope, "_apply", _flags.legacy_apply)
    monkeypatch.setattr(_scope, "_restore", _flags.legacy_restore)
    torch.set_float32_matmul_precision("highest" if held else "high")
    torch.backends.cudnn.allow_tf32 = not held
    before = _flags.read_all()

    def block() -> None:
        with fp32_precision_scope(Fp32Precision("highest", False)):
            torch.set_float32_matmul_precision("medium")
            torch.backends.cudnn.allow_tf32 = True

    message = _flip_warning(block)
    assert _flags.read_all() == before
    matmul, _, cudnn = message.partition("Changed: ")[2].partition("; ")
    assert matmul.startswith("matmul precision applied as 'highest', found ")
    assert f"{_flags.LEGACY_MATMUL} = 'medium', {_flags.LEGACY_CUBLAS} = True" in matmul
    assert cudnn.startswith(f"cudnn_allow_tf32 applied as False, found {_flags.LEGACY_CUDNN} = True")


@legacy_swapped_in
def test_the_legacy_implementation_names_a_cudnn_flip_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_scope, "_apply", _flags.legacy_apply)
    monkeypatch.setattr(_scope, "_restore", _flags.legacy_restore)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    before = _flags.read_all()

    def block() -> None:
        with fp32_precision_scope(Fp32Precision("high", False)):
            torch.backends.cudnn.allow_tf32 = True

    message = _flip_warning(block)
    assert _flags.read_all() == before
    assert "Changed: cudnn_allow_tf32 applied as False, found " in message
    assert "matmul precision" not in message


def test_the_conflict_error_names_the_scope_it_refused() -> None:
    inside, release = threading.Event(), threading.Event()

    def forward() -> None:
        with fp32_precision_scope(Fp32Precision("highest", False)):
            inside.set()
            release.wait(10)

    @with_fp32_precision(Fp32Precision("medium"), name="decode")
    def decode() -> None:
        pass

    thread = threading.Thread(target=forward, name="forward")
    thread.start()
    try:
        assert inside.wait(10)
        with pytest.raises(Fp32ScopeError) as caught:
            decode()
    finally:
        release.set()
        thread.join(10)
    assert str(caught.value).startswith("Cannot enter an fp32_precision_scope around 'decode' on thread ")


@legacy_swapped_in
def test_the_legacy_implementation_names_a_matmul_flip_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_scope, "_apply", _flags.legacy_apply)
    monkeypatch.setattr(_scope, "_restore", _flags.legacy_restore)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    before = _flags.read_all()

    def block() -> None:
        with fp32_precision_scope(Fp32Precision("highest", True)):
            torch.set_float32_matmul_precision("medium")

    changed = _flip_warning(block).partition("Changed: ")[2]
    assert _flags.read_all() == before
    assert changed.startswith("matmul precision applied as 'highest', found ")
    assert "cudnn_allow_tf32" not in changed
    assert "; " not in changed


@pytest.mark.skipif(not _flags.HAS_NEW_API, reason="cudnn.fp32_precision exists from torch 2.9")
def test_a_held_cudnn_false_is_re_established_when_the_block_sets_cudnn_fp32_precision_tf32() -> None:
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.fp32_precision = "ieee"
    # conv and rnn explicit ieee: allow_tf32 keeps reading False (no raise) whatever cuda/all
    # reads, so only cudnn.fp32_precision itself tells that the block broke the held False.
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # type: ignore[attr-defined]
    torch.backends.cudnn.rnn.fp32_precision = "ieee"  # type: ignore[attr-defined]
    scope = fp32_precision_scope(Fp32Precision(None, cudnn_allow_tf32=False))
    with pytest.warns(Fp32FlagsChangedWarning, match="cudnn_allow_tf32 applied as False"), scope:
        torch.backends.cudnn.fp32_precision = "tf32"  # Inductor's conv templates read this
    assert torch.backends.cudnn.fp32_precision == "ieee"
    assert torch.backends.cudnn.allow_tf32 is False


def test_a_flip_of_the_matmul_field_alone_names_only_it() -> None:
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    before = _flags.read_all()

    def block() -> None:
        with fp32_precision_scope(Fp32Precision("highest", cudnn_allow_tf32=True)):
            torch.set_float32_matmul_precision("medium")

    changed = _flip_warning(block).partition("Changed: ")[2]
    assert _flags.read_all() == before
    assert changed.startswith("matmul precision applied as 'highest', found ")
    assert "cudnn_allow_tf32" not in changed
    assert "; " not in changed
    assert "None" not in changed


@pytest.mark.skipif(not _flags.HAS_NEW_API, reason="cudnn.fp32_precision exists from torch 2.9")
def test_cudnn_false_is_not_held_while_cudnn_fp32_precision_reads_tf32() -> None:
    torch.backends.cudnn.allow_tf32 = False
    # conv and rnn explicit ieee: allow_tf32 reads False without raising, but cuda/all is tf32.
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # type: ignore[attr-defined]
    torch.backends.cudnn.rnn.fp32_precision = "ieee"  # type: ignore[attr-defined]
    torch.backends.cudnn.fp32_precision = "tf32"
    before = _flags.save_raw_state()
    with fp32_precision_scope(Fp32Precision(None, cudnn_allow_tf32=False)):
        assert torch.backends.cudnn.fp32_precision != "tf32"  # Inductor's conv templates read it
    assert _flags.save_raw_state() == before


@pytest.mark.skipif(not _flags.HAS_NEW_API, reason="cudnn.conv/rnn.fp32_precision exist from torch 2.9")
@pytest.mark.parametrize("op", ["conv", "rnn"])
@pytest.mark.parametrize("applied", [True, False])
def test_a_hidden_cudnn_false_is_restored_when_one_op_alone_reads_tf32(op: str, applied: bool) -> None:
    torch.backends.cudnn.allow_tf32 = False
    # One op tf32, the other "none" (ieee): allow_tf32 raises, B is seen only by probing.
    setattr(getattr(torch.backends.cudnn, op), "fp32_precision", "tf32")  # noqa: B010
    before = _flags.save_raw_state()
    assert before[1] is False
    with fp32_precision_scope(Fp32Precision(None, cudnn_allow_tf32=applied)):
        pass
    assert _flags.save_raw_state() == before
