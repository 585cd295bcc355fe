"""The float32-precision scope: save, apply, restore, with the thread and compile guards."""

from __future__ import annotations

import threading
import warnings
from types import TracebackType
from typing import Final, Union

import torch

from fp32scope import _dynamo_exclude, _flags
from fp32scope._errors import Fp32FlagsChangedWarning, Fp32ScopeError
from fp32scope._precision import MATMUL_PRECISIONS, Fp32Precision, check_precision

__all__ = ["Token", "active_scope_thread", "enter", "exit_", "fp32_precision_scope", "split"]

# Bound once: every scoped call goes through these. Dynamo recognises
# torch.compiler.is_compiling by identity, so the alias still folds to True while tracing.
_is_compiling = torch.compiler.is_compiling
_get_ident = threading.get_ident
_SM = torch._C._set_float32_matmul_precision
_matmul_holds = _flags.matmul_holds
_save_matmul = _flags.save_matmul
_restore_matmul = _flags.restore_matmul
_cudnn_holds = _flags.cudnn_holds
_save_apply_cudnn = _flags.save_apply_cudnn
_restore_cudnn = _flags.restore_cudnn

# Which thread is inside a scope that changes flags. The flags are process-wide, so a
# second thread's scope would change them under the first one's kernels (and the first
# one's exit would change them back under the second's): only one thread may hold scopes
# at a time. dict.setdefault and del are atomic, so claiming needs no lock; the depth is
# only ever touched by the owning thread.
_owner: dict[int, int] = {}
_depth = [0]
_claim = _owner.setdefault

# Token fields: (matmul, cudnn, matmul state, cudnn state). A state is None where the field
# is None, _FAST where the flags already held the value (nothing saved or written), a
# 1-tuple (cuda/all reading,) for a cuDNN fast path, else what _flags saved.
_FAST: Final[tuple[()]] = ()
Token = tuple[Union[str, None], Union[bool, None], object, object]

_COMPILING_MSG: Final = (
    "fp32_precision_scope cannot change torch's float32 precision flags inside a region that "
    "torch.compile is tracing: Dynamo would run the change once, at trace time, and never "
    "replay it. Wrap the compiled callable instead, so that the scope runs outside the "
    "compiled region: with_fp32_precision(precision)(torch.compile(fn)) or "
    "Fp32ScopedModule(torch.compile(module), precision)."
)

_CHECKED: Final = MATMUL_PRECISIONS


def split(precision: object, argument: str = "precision") -> tuple[str | None, bool | None] | None:
    """Check ``precision`` and return its fields, or None when it changes nothing."""
    if type(precision) is Fp32Precision:
        t, b = precision
        # The common case, checked inline; anything unusual goes through the full check,
        # which raises with the field named. (Tuple membership compares, never hashes.)
        if (t is None or t in _CHECKED) and (b is None or b is True or b is False):
            if t is None and b is None:
                return None
            return t, b
    checked = check_precision(precision, argument=argument)
    if checked is None or checked.is_noop:
        return None
    return checked.matmul, checked.cudnn_allow_tf32


def _thread_name(ident: int) -> str:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return f"{thread.name!r} (ident {ident})"
    return f"ident {ident}"


def conflict_error(what: str, owner: int) -> Fp32ScopeError:
    """The error for ``what`` while thread ``owner`` is inside a scope."""
    me = _get_ident()
    msg = (
        f"{what} on thread {_thread_name(me)} while thread {_thread_name(owner)} is inside an "
        "fp32_precision_scope. The float32 precision flags are process-wide, not per thread: "
        "this would change the precision of the kernels that thread is launching. Run all "
        "scoped calls on one thread (as an engine's forward thread does), or serialize them "
        "with a lock held around each scoped call."
    )
    return Fp32ScopeError(msg)


def active_scope_thread() -> int | None:
    """The ident of the thread inside a flag-changing scope, or None."""
    return _owner.get(0)


def enter(t: str | None, b: bool | None) -> Token:
    """Enter a scope for checked fields (at least one not None); returns the exit token."""
    if _is_compiling():
        raise Fp32ScopeError(_COMPILING_MSG)
    me = _get_ident()
    owner = _claim(0, me)
    if owner != me:
        raise conflict_error("Cannot enter an fp32_precision_scope", owner)
    _depth[0] += 1
    sm: object = None
    sc: object = None
    try:
        if t is not None:
            if _matmul_holds(t):
                sm = _FAST
            else:
                sm = _save_matmul()
                _SM(t)
        if b is not None:
            if _cudnn_holds(b):
                sc = (None if b else _flags.cudnn_all_reading(),)
            else:
                sc = _save_apply_cudnn(b, sm is _FAST or sm is None)
    except BaseException:
        # Only reachable for an interrupt or a torch error between our own calls.
        _undo(t, b, sm, sc)
        _release()
        raise
    return (t, b, sm, sc)


def _undo(t: str | None, b: bool | None, sm: object, sc: object) -> None:
    if b is not None and sc is not None and len(sc) == 5:  # type: ignore[arg-type]
        _restore_cudnn(sc)  # type: ignore[arg-type]
    if t is not None and sm is not None and sm is not _FAST:
        _restore_matmul(sm)  # type: ignore[arg-type]


def _release() -> None:
    depth = _depth[0] - 1
    _depth[0] = depth
    if depth == 0:
        # Decrement before releasing: the next owner's increment must see 0.
        _owner.pop(0, None)


def exit_(token: Token, stacklevel: int = 2) -> None:
    """Leave the scope ``token`` came from: restore, release, warn if the block flipped flags."""
    t, b, sm, sc = token
    changed: list[str] | None = None
    try:
        if b is not None:
            if not _cudnn_holds(b):
                changed = [_describe_cudnn(b)]
            if len(sc) == 1:  # type: ignore[arg-type]
                if changed:
                    _flags.reapply_cudnn(b, sc[0])  # type: ignore[index]
            else:
                _restore_cudnn(sc)  # type: ignore[arg-type]
        if t is not None:
            if not _matmul_holds(t):
                changed = [*(changed or ()), _describe_matmul(t)]
                if sm is _FAST:
                    _SM(t)
            if sm is not _FAST:
                _restore_matmul(sm)  # type: ignore[arg-type]
    finally:
        _release()
    if changed:
        msg = (
            "The code inside an fp32_precision_scope changed the float32 precision flags the "
            f"scope applied; the scope restored the state it saved on entry. Changed: {'; '.join(changed)}. "
            "Declare the precision on the node instead of setting torch's flags inside its forward."
        )
        warnings.warn(msg, Fp32FlagsChangedWarning, stacklevel=stacklevel + 1)


def _describe_matmul(t: str) -> str:
    readings = _flags.read_all()
    names = [_flags.LEGACY_MATMUL, _flags.LEGACY_CUBLAS]
    if _flags.HAS_NEW_API:
        names += [_flags.SLOT_NAMES["cuda", "matmul"], _flags.SLOT_NAMES["mkldnn", "matmul"]]
    found = ", ".join(f"{n} = {readings[n]!r}" for n in names)
    return f"matmul precision applied as {t!r}, found {found}"


def _describe_cudnn(b: bool) -> str:
    readings = _flags.read_all()
    names = [_flags.LEGACY_CUDNN]
    if _flags.HAS_NEW_API:
        names += [_flags.SLOT_NAMES[k] for k in (("cuda", "conv"), ("cuda", "rnn"), ("cuda", "all"))]
    found = ", ".join(f"{n} = {readings[n]!r}" for n in names)
    return f"cudnn_allow_tf32 applied as {b!r}, found {found}"


class fp32_precision_scope:  # noqa: N801  (lower case like torch.no_grad: used as a context manager)
    """Run a block with a float32 precision, then restore exactly what was there before.

    ``precision`` is an :class:`~fp32scope.Fp32Precision` or None; it is checked here,
    before anything changes. On entry the scope saves the exact state of every flag it
    will touch and applies the fields that are not None; on exit, also when the block
    raises (``KeyboardInterrupt`` included), it restores that state, so that every reading
    torch offers (including which legacy getters raise) is as it was, and the exception
    propagates unchanged. Where the flags already hold what is asked, nothing is written.

    Inside the scope the flags are consistent: ``torch.get_float32_matmul_precision()``
    equals ``precision.matmul`` and the legacy and new readings of each applied flag agree.

    Raises :class:`~fp32scope.Fp32ScopeError` on entry inside a region that
    ``torch.compile`` is tracing, or on one thread while another thread is inside a scope
    (the flags are process-wide). Warns :class:`~fp32scope.Fp32FlagsChangedWarning` on exit
    when the block changed the flags the scope applied. None, or a precision with both
    fields None, makes a scope that touches nothing. The same object may be re-entered and
    nested; exits restore last-in, first-out.

    >>> import torch
    >>> torch.set_float32_matmul_precision("high")
    >>> with fp32_precision_scope(Fp32Precision("highest", cudnn_allow_tf32=False)):
    ...     torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    ('highest', False)
    >>> torch.get_float32_matmul_precision()
    'high'
    """

    __slots__ = ("_fields", "_tokens")

    def __init__(self, precision: Fp32Precision | None) -> None:
        self._fields = split(precision)
        self._tokens: list[Token] = []

    @property
    def precision(self) -> Fp32Precision | None:
        """The precision this scope applies, or None when it changes nothing."""
        return None if self._fields is None else Fp32Precision(*self._fields)  # type: ignore[arg-type]

    def __enter__(self) -> None:
        fields = self._fields
        if fields is not None:
            self._tokens.append(enter(*fields))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._fields is not None:
            exit_(self._tokens.pop(), stacklevel=2)

    def __repr__(self) -> str:
        return f"fp32_precision_scope({self.precision!r})"


_dynamo_exclude.exclude(enter, exit_, _release, _undo, graph_break=False)
_dynamo_exclude.exclude(
    *(fn for fn in vars(_flags).values() if callable(fn) and getattr(fn, "__module__", None) == _flags.__name__),
    graph_break=False,
)
