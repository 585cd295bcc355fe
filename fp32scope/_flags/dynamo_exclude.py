"""Keeping scoped calls out of Dynamo's graphs, at no cost to eager calls.

A scoped call changes process-wide flags, which Dynamo cannot trace (a traced flag write
runs once at trace time and is never replayed). So the code of every wrapper that enters a
scope is marked the way ``torch.compiler.disable(recursive=False)`` marks it, but without
the extra wrapper function that costs a Python call on every eager call:

* ``skip_code`` tells Dynamo's frame callback to run these frames (and the comprehensions
  and other code objects nested in them) as plain Python, while the frames they call are
  still compiled: a wrapper calls what it wraps through a trampoline of its own
  (:mod:`fp32scope._wrappers.trampoline`), compiled as a graph of its own, inside the scope;
* ``_torchdynamo_disable`` on the function makes a compiled parent that calls it graph
  break cleanly at the call instead of inlining it.

Marking imports Dynamo (about a second), so it happens once, on the first wrapper built.

The module also says what Dynamo does to a "medium" precision: :func:`dynamo_resets_medium`.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

from fp32scope._compat import DYNAMO_RESETS_MEDIUM, dynamo_shows_disable_reason

__all__ = ["dynamo_resets_medium", "ensure", "exclude", "mark_function", "rename_where_no_reason"]

_REASON = (
    "fp32scope: a scoped call made with in_graph=False changes torch's process-wide float32 precision flags "
    "outside the compiled graph, a graph break (the callable it wraps is still compiled, inside the scope; on "
    "torch >= 2.8 a break inside a loop makes Dynamo run that loop's whole frame uncompiled). To keep the node "
    "inside one graph (fullgraph=True), leave in_graph at its default, in_graph=True: an in-graph region. "
    "torch.export cannot export a scoped call: one exported graph cannot carry a precision change. Export the "
    "bare node (scoped.__wrapped__), then compile or save it with its precision: "
    "fp32scope.aoti_compile_and_package(exported_program, precision) or "
    "fp32scope.save_exported_program(exported_program, f, precision)"
)
_pending: list[tuple[Callable[..., Any], bool]] = []
_done = [False]
# Every code object skipped so far: ``torch._dynamo.reset()`` clears the skip mark of a code
# object Dynamo has seen (torch 2.4's strict export converts such frames), so each new
# wrapper marks them all again.
_skipped: list[types.CodeType] = []


def exclude(*functions: Callable[..., Any], graph_break: bool = True) -> None:
    """Register functions whose frames Dynamo must never trace; marked on first use.

    ``graph_break=False`` skips only their frames: a compiled caller may still inline them
    (the scope's own enter does, so that entering a scope inside a compiled region raises
    Fp32ScopeError with its message rather than Dynamo's generic one).
    """
    _pending.extend((fn, graph_break) for fn in functions)
    if _done[0]:
        _flush()


#: Where Dynamo shows no reason (torch 2.4), a marked function it names in a
#: ``fullgraph=True`` failure says what to do in its qualified name.
_NAMED_REASON = " [fp32scope: a graph break (in_graph=False); in_graph=True keeps the node in one graph]"
_renamed: list[tuple[Callable[..., Any], str]] = []


def rename_where_no_reason(fn: Callable[..., Any], note: str = _NAMED_REASON) -> None:
    """Have ``fn``'s name end with ``note``, on a Dynamo that names a disabled function without its reason."""
    _renamed.append((fn, note))
    if _done[0]:
        _flush()


def _flush() -> None:
    from torch._dynamo.eval_frame import skip_code

    if _renamed and not dynamo_shows_disable_reason():
        for fn, note in _renamed:
            if not fn.__qualname__.endswith(note):
                fn.__qualname__ += note
    _renamed.clear()
    while _pending:
        fn, graph_break = _pending.pop()
        _skipped.extend(_code_objects(fn.__code__))
        if graph_break:
            mark_function(fn)
    for code in _skipped:
        skip_code(code)
    _done[0] = True


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    # A comprehension, generator expression, lambda or nested function is a code object of
    # its own, in its function's constants, and Dynamo starts frames in it like in any
    # other: skipping a function must skip them too (Python 3.12 inlines list, dict and set
    # comprehensions; generator expressions stay separate everywhere).
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def mark_function(fn: Callable[..., Any]) -> None:
    """Mark one function object so that Dynamo graph-breaks at a call to it."""
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    fn._torchdynamo_disable_msg = _REASON  # type: ignore[attr-defined]


def ensure() -> None:
    """Mark everything registered so far, again (called when a wrapper is built)."""
    _flush()


# -- what Dynamo does to the flags ------------------------------------------------------


def dynamo_resets_medium() -> bool | None:
    """Whether compiling a frame with Dynamo turns the precision "medium" into "high".

    torch 2.4 to 2.8 do (Dynamo writes the cuBLAS TF32 bool back after each frame it
    converts, through the legacy setter, which writes "high" for True); torch 2.10 and later
    do not. The fact is :data:`fp32scope._compat.DYNAMO_RESETS_MEDIUM` (the scopes act on
    the same one); a function for the doctor and the demo, which report it.
    """
    return DYNAMO_RESETS_MEDIUM
