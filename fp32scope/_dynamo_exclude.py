"""Keeping scoped calls out of Dynamo's graphs, at no cost to eager calls.

A scoped call changes process-wide flags, which Dynamo cannot trace (a traced flag write
runs once at trace time and is never replayed). So the code of every wrapper that enters a
scope is marked the way ``torch.compiler.disable(recursive=False)`` marks it, but without
the extra wrapper function that costs a Python call on every eager call:

* ``skip_code`` tells Dynamo's frame callback to run these frames as plain Python, while
  the frames they call (the wrapped module's forward) are still compiled, as graphs of
  their own, inside the scope;
* ``_torchdynamo_disable`` on the function makes a compiled parent that calls it graph
  break cleanly at the call instead of inlining it.

Marking imports Dynamo (about a second), so it happens once, on the first wrapper built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ensure", "exclude", "mark_function"]

_REASON = (
    "fp32scope: a scoped call changes torch's process-wide float32 precision flags, so it runs "
    "outside the compiled graph (the callable it wraps is still compiled, inside the scope)"
)
_pending: list[tuple[Callable[..., Any], bool]] = []
_done = [False]


def exclude(*functions: Callable[..., Any], graph_break: bool = True) -> None:
    """Register functions whose frames Dynamo must never trace; marked on first use.

    ``graph_break=False`` skips only their frames: a compiled caller may still inline them
    (the scope's own enter does, so that entering a scope inside a compiled region raises
    Fp32ScopeError with its message rather than Dynamo's generic one).
    """
    _pending.extend((fn, graph_break) for fn in functions)
    if _done[0]:
        _flush()


def _flush() -> None:
    from torch._dynamo.eval_frame import skip_code

    while _pending:
        fn, graph_break = _pending.pop()
        skip_code(fn.__code__)
        if graph_break:
            mark_function(fn)
    _done[0] = True


def mark_function(fn: Callable[..., Any]) -> None:
    """Mark one function object so that Dynamo graph-breaks at a call to it."""
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    fn._torchdynamo_disable_msg = _REASON  # type: ignore[attr-defined]


def ensure() -> None:
    """Mark everything registered so far (called when a wrapper is built)."""
    if not _done[0] or _pending:
        _flush()
