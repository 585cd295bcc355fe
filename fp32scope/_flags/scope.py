"""The float32-precision scope: save, apply, restore, with the thread and compile guards."""

from __future__ import annotations

import sys
import threading
import warnings
from types import TracebackType
from typing import Any, Final, Literal, NoReturn

import torch

from fp32scope._compat import (
    COMPILER_STATE,
    COMPILING_FLAG,
    DYNAMO_RESETS_MEDIUM,
    DYNAMO_TRACES_SCOPES_MADE_INSIDE,
    is_dynamo_compiling,
    is_exporting,
)
from fp32scope._errors import Fp32FlagsChangedWarning, Fp32ScopeError, user_stacklevel
from fp32scope._flags import dynamo_exclude, torch_flags
from fp32scope._flags.autograd_threads import runs_backward_for
from fp32scope._flags.eager_fallback import warn_eager_fallback
from fp32scope._flags.hooks import entered as _trace_enter
from fp32scope._flags.hooks import exited as _trace_exit
from fp32scope._flags.hooks import open_ranges as _ranges
from fp32scope._flags.hooks import open_traces as _traces
from fp32scope._flags.hooks import profiler_state as _profiler_state
from fp32scope._flags.precision import MATMUL_PRECISIONS, Fp32Precision, check_precision

__all__ = [
    "EXPORTING_MSG",
    "Token",
    "active_scope_thread",
    "conflict_error",
    "fp32_precision_scope",
    "split",
    "wrapper_scope",
]

# Bound once: every scoped call goes through these. Whether torch.compile or torch.export
# traces is torch.compiler.is_compiling(), read as its two parts (_compat): Dynamo folds
# is_dynamo_compiling() to True while it traces, and outside Dynamo is_compiling() returns
# torch.compiler's module flag, read here from the module's dict.
_is_dynamo_compiling = is_dynamo_compiling
_compiler_state = COMPILER_STATE
_COMPILING_FLAG: Final = COMPILING_FLAG
_get_ident = threading.get_ident

# Which thread is inside a scope that changes flags. The flags are process-wide, so a
# second thread's scope would change them under the first one's kernels (and the first
# one's exit would change them back under the second's): only one thread may hold scopes
# at a time. dict.setdefault and pop are atomic, so claiming needs no lock; the depth is
# only ever touched by the owning thread.
_owner: dict[int, int] = {}
_depth = 0
_claim = _owner.setdefault
_apply = torch_flags.apply
_restore = torch_flags.restore
_held_check = torch_flags.held_check

Token = torch_flags.Token

_COMPILING_MSG: Final = (
    "fp32_precision_scope cannot change torch's float32 precision flags inside a region that "
    "torch.compile is tracing: Dynamo would run the change once, at trace time, and never "
    "replay it. Wrap the compiled callable instead, so that the scope runs outside the "
    "compiled region: with_fp32_precision(precision)(torch.compile(fn)) or "
    "Fp32ScopedModule(torch.compile(module), precision)."
)

# torch.export traces with is_compiling() True too (non-strict export; strict export meets
# the wrappers' Dynamo mark first, whose reason is dynamo_exclude._REASON): its own message.
EXPORTING_MSG: Final = (
    "torch.export cannot export a scoped call (an Fp32ScopedModule, a with_fp32_precision "
    "function or an fp32_precision_scope): one exported graph cannot carry a float32 precision "
    "change, because torch reads the process-wide precision flags when it compiles the graph "
    "and when its kernels run, not from the graph. Export the bare node instead "
    "(scoped.__wrapped__), then compile or save it with its precision: "
    "fp32scope.aoti_compile_and_package(exported_program, precision) or "
    "fp32scope.save_exported_program(exported_program, f, precision). A model whose parts need "
    "different precisions is exported node by node."
)


_is_exporting = is_exporting


# Dynamo before torch 2.8 cannot enter a context manager that user code made inside the
# traced region (torch 2.4: "BEFORE_WITH UserDefinedObjectVariable(...)"), so it never
# reaches __enter__ and its refusal; there the scope refuses where it is made. Newer Dynamo
# traces __enter__. Only there is the check skipped at construction: it would cost every
# ``with fp32_precision_scope(...)`` another is_compiling() call (about 50 ns).
_REFUSE_WHEN_MADE: Final = not DYNAMO_TRACES_SCOPES_MADE_INSIDE

# Where every frame Dynamo converts leaves "high" behind a "medium" (_compat), also inside a
# scope, scopes that can meet this (a matmul field of "medium", or none) get
# _LegacyDynamoScope, which tells torch's reset from the block's own writes.
_LEGACY_DYNAMO: Final = DYNAMO_RESETS_MEDIUM
_KEPT_BY_LEGACY_SCOPE: Final = (None, "medium")
_GM = torch._C._get_float32_matmul_precision
_SM = torch._C._set_float32_matmul_precision
_GB = torch._C._get_cudnn_allow_tf32


def _graph_break_with_reason(ctx: Any) -> None:
    # Runs inside Dynamo, at trace time (torch._dynamo.comptime): a graph break whose reason
    # is the library's message. Every supported Dynamo reports that reason, and under
    # fullgraph=True raises it (torch 2.4 prints it as is; later releases as the context of a
    # "ComptimeContext graph break"). Without fullgraph Dynamo then runs the function
    # around the scope eagerly, which only its logs would say: warn (once per location).
    if _is_exporting():  # strict torch.export traces with Dynamo: say what export needs
        ctx.graph_break(EXPORTING_MSG)
        return
    warn_eager_fallback(ctx)
    ctx.graph_break(_COMPILING_MSG)


def _refuse_traced() -> NoReturn:
    """Refuse a scope in a region Dynamo traces, so that Dynamo reports the library's message.

    Only ever reached from code that Dynamo inlines (the scope's frames are excluded from
    its frame callback), where ``is_compiling()`` folds to True. An exception raised in
    traced code reaches the user without its message on torch 2.4 and 2.8 ("BEFORE_WITH
    ...", "Observed exception ..."), so the refusal is a comptime graph break carrying the
    message instead. Outside Dynamo (another tracer for which ``is_compiling()`` is True)
    ``comptime`` does nothing and the Fp32ScopeError below is raised.
    """
    from torch._dynamo.comptime import comptime

    comptime(_graph_break_with_reason)
    raise Fp32ScopeError(EXPORTING_MSG if _is_exporting() else _COMPILING_MSG)


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


def _release() -> None:
    global _depth  # noqa: PLW0603  (a module int is the cheapest counter to bump per call)
    _depth -= 1
    if _depth == 0:
        # Decrement before releasing: the next owner's increment must see 0.
        _owner.pop(0, None)


def _warn_changed(changed: str, name: str | None) -> None:
    where = f" around {name!r}" if name is not None else ""
    msg = (
        f"The code inside an fp32_precision_scope{where} changed the float32 precision flags the scope "
        f"applied; the scope restored the state it saved on entry. Changed: {changed}. Declare the "
        "precision on the node (or its wrapper) instead of setting torch's flags inside its forward."
    )
    warnings.warn(msg, Fp32FlagsChangedWarning, stacklevel=user_stacklevel())


class fp32_precision_scope:  # noqa: N801  (lower case like torch.no_grad: used as a context manager)
    """Run a block with a float32 precision, then restore exactly what was there before.

    ``precision`` is an :class:`~fp32scope.Fp32Precision` or None; it is checked here,
    before anything changes. On entry the scope saves the exact state of every flag it
    will touch and applies the fields that are not None; on exit, also when the block
    raises (``KeyboardInterrupt`` included), it restores that state, so that every reading
    torch offers (including which legacy getters raise) is as it was, and the exception
    propagates unchanged. Where the flags already hold what is asked, nothing is written.

    Inside the scope the flags are consistent: ``torch.get_float32_matmul_precision()``
    equals ``precision.matmul`` (``"highest"`` for ``"bfx9"``, which torch's legacy getter
    cannot show; cuBLAS's ``fp32_precision`` reads it) and the legacy and new readings of
    each applied flag agree.

    Refused inside a region that ``torch.compile`` is tracing, where it is made or entered:
    Dynamo gets a graph break carrying the library's message (the frame runs eagerly, or
    under ``fullgraph=True`` compilation fails with that message: wrap the compiled
    callable instead); other tracers get :class:`~fp32scope.Fp32ScopeError`. Raises
    :class:`~fp32scope.Fp32ScopeError` on one thread while another thread is inside a scope
    (the flags are process-wide). Warns :class:`~fp32scope.Fp32FlagsChangedWarning` on exit
    when the block changed the flags the scope applied. Where the flags already hold the
    precision (the legacy getters show it without raising, and every backend slot the field
    governs resolves to what torch's legacy setter writes for it: cuBLAS and oneDNN for the
    matmul precision, cuDNN conv and rnn for ``cudnn_allow_tf32``), nothing is saved or
    written, and on exit only a block that broke the precision is undone (by applying it
    again). None, or a precision with both fields None, makes a scope that touches nothing.
    The same object may be re-entered and nested; exits restore last-in, first-out.

    >>> import torch
    >>> torch.set_float32_matmul_precision("high")
    >>> with fp32_precision_scope(Fp32Precision("highest", cudnn_allow_tf32=False)):
    ...     torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    ('highest', False)
    >>> torch.get_float32_matmul_precision()
    'high'
    """

    # _marks is used by _LegacyDynamoScope only; declared here so that an instance can
    # switch to that subclass (same layout) when it is made.
    __slots__ = ("_fields", "_held", "_marks", "_name", "_outer", "_phase", "_token")
    _phase: str  # set by wrapper_scope only: "forward" or "backward", for fp32scope.trace()

    def __init__(self, precision: Fp32Precision | None) -> None:
        if _REFUSE_WHEN_MADE and (_is_dynamo_compiling() or _compiler_state[_COMPILING_FLAG]):
            _refuse_traced()
        # The common case inline (this runs on every scoped call); split() checks the rest
        # and raises with the field named. An Fp32Precision is itself the (matmul, cudnn) pair.
        t = b = None
        if type(precision) is Fp32Precision:
            t, b = precision
        if (t is None or t in _CHECKED) and (b is True or b is False or (b is None and t is not None)):
            self._fields: tuple[str | None, bool | None] | None = precision
        else:
            self._fields = split(precision)
        # What the entries have found. False: not entered yet; its entry runs apply, which
        # finds out whether the flags hold the precision (a scope made for one `with` pays
        # nothing more). Once entered again (a scope object kept and re-entered, a
        # wrapper's scope), the scope learns: None while its entries switch, its held
        # check (torch_flags) while they find the precision held, which entry and exit then
        # run in place of apply and restore.
        self._held: torch_flags.HeldCheck | Literal[False] | None = False
        self._token: Token | None = None
        self._outer: list[Token] | None = None  # tokens of outer entries of this same object
        self._name: str | None = None
        if _LEGACY_DYNAMO and self._fields is not None and self._fields[0] in _KEPT_BY_LEGACY_SCOPE:
            self.__class__ = _LegacyDynamoScope
            self._marks: list[tuple[int, bool]] = []

    @property
    def precision(self) -> Fp32Precision | None:
        """The precision this scope applies, or None when it changes nothing."""
        return None if self._fields is None else Fp32Precision(*self._fields)  # type: ignore[arg-type]

    def __enter__(self) -> None:  # noqa: C901  (hot path: one flat method on purpose)
        fields = self._fields
        if fields is None:
            return
        # Dynamo folds this call to True while it traces, so a scope entered in traced code
        # refuses there (a graph break, or under fullgraph=True an error with the message).
        if _is_dynamo_compiling() or _compiler_state[_COMPILING_FLAG]:
            _refuse_traced()
        me = _get_ident()
        owner = _claim(0, me)
        if owner != me and not runs_backward_for(owner):
            where = f" around {self._name!r}" if self._name is not None else ""
            raise conflict_error(f"Cannot enter an fp32_precision_scope{where}", owner)
        global _depth  # noqa: PLW0603
        _depth += 1
        try:
            held = self._held
            if held:  # the last entry found the precision held: most likely still so
                token = held()
                if token is None:
                    token = _apply(fields[0], fields[1])
                    self._held = None
            else:
                token = _apply(fields[0], fields[1])
                if held is None and token[2] is None and type(token[3]) is not tuple:  # wrote nothing
                    self._held = _held_check(fields[0], fields[1])
        except BaseException:  # only an interrupt or a torch error between our own calls
            _release()
            raise
        if self._token is not None:  # this object re-entered while already inside
            if self._outer is None:
                self._outer = []
            self._outer.append(self._token)
        self._token = token
        if _traces or _profiler_state["_is_profiler_enabled"]:  # trace() or a profiler records: hooks
            try:
                _trace_enter(self, _depth)
            except BaseException:  # this scope's own exit, before the error leaves a `with` that never ran
                fp32_precision_scope.__exit__(self, *sys.exc_info())
                raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token = self._token
        if token is None:
            return
        global _depth  # noqa: PLW0603
        if _ranges:  # a profiler range or a trace event this entry may have left (hooks)
            _trace_exit(_depth)
        self._token = self._outer.pop() if self._outer else None
        try:
            # An entry that wrote nothing, whose precision still holds: restore would write
            # nothing and find nothing changed.
            held = self._held
            sc = token[3]
            if held and token[2] is None and (sc is None or type(sc) is str) and held() is not None:
                changed = None
            else:
                if held is False:  # exited once: from the next entry on, it learns
                    self._held = None
                changed = _restore(token)
        finally:
            # _release(), inline: this runs on every scoped call.
            _depth -= 1
            if _depth == 0:
                _owner.pop(0, None)
        if changed is not None:
            _warn_changed(changed, self._name)

    def __repr__(self) -> str:
        return f"fp32_precision_scope({self.precision!r})"


def _dynamo_frames() -> int:
    """How many frames Dynamo has been asked to convert so far (-1 before Dynamo is imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return -1
    frames: int = utils.counters["frames"]["total"]
    return frames


class _LegacyDynamoScope(fp32_precision_scope):
    """A scope on torch < 2.9 whose matmul field is "medium" or None (see _LEGACY_DYNAMO).

    A Dynamo frame conversion inside the block turns "medium" into "high". That is torch's
    doing, not the block's: for a "medium" scope the exit puts "medium" back (as for any
    change) without warning that the wrapped code changed the flags; a scope that leaves the
    matmul precision alone puts back a "medium" it found on entry, so that the wrapped call
    leaves the process as it found it. "Torch's doing" means: Dynamo converted a frame
    during the block and the precision reads exactly "high" ("medium" with the cuBLAS TF32
    bool written back); the block's own writes are told apart only where no frame was
    compiled. The common scopes never take this path.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        fp32_precision_scope.__enter__(self)  # refuses in traced code, claims the thread, applies
        fields = self._fields
        # After apply: a None matmul field was not written, so the reading is the entry's.
        mark = (_dynamo_frames(), fields is not None and fields[0] is None and _GM() == "medium")
        self._marks.append(mark)  # one per entry that applied, like the tokens

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token = self._token
        if token is None:
            return
        global _depth  # noqa: PLW0603
        frames, keep_medium = self._marks.pop()
        t, b = token[0], token[1]
        reset = _dynamo_frames() != frames and _GM() == "high"
        # torch's reset alone: the matmul field went "medium" -> "high" while Dynamo compiled,
        # and the cuDNN field (if any) still holds.
        torch_only = reset and t == "medium" and (b is None or _GB() is b)
        if _ranges:  # a profiler range or a trace event this entry may have left (hooks)
            # Dynamo's own reset is not the node's change: its event keeps the entry's reading.
            _trace_exit(_depth, observe=not torch_only)
        self._token = self._outer.pop() if self._outer else None
        try:
            changed = _restore(token)
            if keep_medium and reset:
                _SM("medium")
        finally:
            _depth -= 1
            if _depth == 0:
                _owner.pop(0, None)
        if changed is not None and not torch_only:
            _warn_changed(changed, self._name)


def wrapper_scope(precision: Fp32Precision | None, name: str, phase: str = "forward") -> fp32_precision_scope:
    """A scope for a wrapper to enter around each call; warnings point at the wrapper's caller.

    ``phase`` (``"forward"``, or ``"backward"`` for a recorded call's backward) is what
    :func:`fp32scope.trace` and the profiler ranges report for its entries. It learns
    from its first entry on whether its entries find the precision held (see
    ``fp32_precision_scope.__init__``).
    """
    scope = fp32_precision_scope(precision)
    scope._name = name
    scope._phase = phase
    scope._held = None
    return scope


# Frames only (no graph-break mark): Dynamo still inlines __init__ and __enter__ into traced
# user code, where is_compiling() folds to True and the scope refuses with its own message.
# As frames of their own (called from a compiled region's eager parts) they must never be
# converted: there is_compiling() would fold to True too, and the code after the comptime
# graph break would run for real and raise.
dynamo_exclude.exclude(
    _release,
    _warn_changed,
    _refuse_traced,
    _dynamo_frames,
    fp32_precision_scope.__init__,
    fp32_precision_scope.__enter__,
    fp32_precision_scope.__exit__,
    _LegacyDynamoScope.__enter__,
    _LegacyDynamoScope.__exit__,
    graph_break=False,
)
dynamo_exclude.exclude(
    *(
        fn
        for fn in vars(torch_flags).values()
        if callable(fn) and getattr(fn, "__module__", None) == torch_flags.__name__
    ),
    *torch_flags.ALL_HELD_CHECKS,
    graph_break=False,
)

# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
fp32_precision_scope.__module__ = "fp32scope"
