"""Compiling a wrapped callable inside its scope, wherever its caller compiles.

A compiled caller graph-breaks at a wrapper (a flag change cannot be traced) and runs the
wrapper eagerly with Dynamo's frame callback still active, so Dynamo starts a new frame
at the next Python function the wrapper calls, unless that function lives in torch's own
files (or another file Dynamo skips). A user-defined module's ``forward`` is such a
function; a ``torch.nn`` built-in's, or a torch function, is not: called directly, those
would run eagerly. So while the callback is active a wrapper calls its callable through a
trampoline, a one-line function of this file: Dynamo converts it as a frame of its own and
inlines the callable, whatever its class, into a graph compiled by the caller's backend,
inside the scope.

Each wrapper gets a trampoline whose code object is its own: Dynamo keeps its compiled
entries per code object, each guarded on the callable it was compiled for, and past its
cache size limit (8) it runs a frame eagerly, silently. Shared by all wrappers, one code
object would fill up after eight scoped nodes.

Eager calls (no compile anywhere) never meet a trampoline: reading the callback is one C
call (on torch 2.4, which has no getter, a small function around the setter).
Already-compiled callables (a ``torch.compile``'d module or function, a module
compiled in place) and other wrappers are called directly, so that nothing is compiled
twice.
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
from collections.abc import Callable
from typing import Any

from fp32scope._compat import active_callback
from fp32scope._flags import dynamo_exclude

__all__ = [
    "active_callback",
    "check_eager",
    "compiled_call",
    "eager_trampoline",
    "new_trampoline",
    "refuse_compiled_eager",
    "trampoline_for",
]


def _call(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    # The body of every trampoline (copied, never called itself): the frame Dynamo starts.
    return fn(*args, **kwargs)


_numbers = itertools.count()


def new_trampoline(name: str) -> Callable[..., Any]:
    """A function ``(fn, /, *args, **kwargs) -> fn(*args, **kwargs)`` with a code object of its own.

    ``name`` (the wrapper's) shows in Dynamo's logs as the frame's qualified name.
    """
    code = _call.__code__
    label = f"fp32scope_compiled_call_{next(_numbers)}"
    code = code.replace(co_name=label)
    if sys.version_info >= (3, 11):
        code = code.replace(co_qualname=f"{label} ({name})")
    return types.FunctionType(code, _call.__globals__, label)


def _call_eagerly(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


_eager: list[Callable[..., Any]] = []


def eager_trampoline() -> Callable[..., Any]:
    """A trampoline that runs its callable eagerly: Dynamo converts none of the frames under it.

    For a node kept eager (``eager=True``): where a compiled caller graph-breaks at it, the
    node runs as eager runs it instead of compiled as a graph of its own.
    """
    if not _eager:  # importing Dynamo takes about a second: done for the first eager node
        import torch._dynamo

        _eager.append(torch._dynamo.disable(_call_eagerly, recursive=True))  # type: ignore[no-untyped-call]
    return _eager[0]


def check_eager(value: object) -> bool:
    """Return ``value`` if it is a bool, else raise naming the ``eager`` argument."""
    if type(value) is bool:
        return value
    msg = (
        "eager must be True (the node runs as eager runs it, never compiled: one region of a compiled parent's "
        "graph, or eagerly where the parent graph-breaks at it) or False (the default); "
        f"got {value!r} of type {type(value).__name__}."
    )
    raise TypeError(msg)


def refuse_compiled_eager(fn: object, name: str) -> None:
    """Raise where a node asked to run eagerly is compiled already (``torch.compile(module)``)."""
    if hasattr(fn, "_torchdynamo_orig_callable") or getattr(fn, "_compiled_call_impl", None) is not None:
        msg = (
            f"eager=True asks {name!r} to run as eager runs it, but it is compiled already (torch.compile): "
            "wrap the module or function itself (for a torch.compile'd module, its _orig_mod), or drop eager=True."
        )
        raise ValueError(msg)


def _compiles_itself(fn: object) -> bool:
    # torch.compile's results carry the callable they compile (an OptimizedModule too); a
    # wrapper of this library, or a torch.compiler.disable'd function, is one Dynamo must
    # not inline (it would graph-break at once).
    return (
        hasattr(fn, "_torchdynamo_orig_callable")
        or getattr(fn, "_torchdynamo_disable", False) is True
        or getattr(vars(type(fn)).get("__call__"), "_torchdynamo_disable", False) is True
    )


def trampoline_for(fn: object, name: str) -> Callable[..., Any] | None:
    """A new trampoline for a wrapper of ``fn``, or None where ``fn`` compiles itself."""
    return None if _compiles_itself(fn) else new_trampoline(name)


def compiled_call(fn: Callable[..., Any], trampoline: Callable[..., Any] | None) -> Callable[..., Any]:
    """What a wrapper calls while Dynamo's callback is active: ``fn`` through its trampoline.

    ``fn`` itself where it has no trampoline, or is a module compiled in place
    (``module.compile()``), which compiles itself when called.
    """
    if trampoline is None or getattr(fn, "_compiled_call_impl", None) is not None:
        return fn
    return functools.partial(trampoline, fn)


# Frames only: these run in the wrapper's eager call, where Dynamo's callback is active.
dynamo_exclude.exclude(
    *(
        fn
        for fn in (
            compiled_call,
            trampoline_for,
            _compiles_itself,
            new_trampoline,
            active_callback,
            eager_trampoline,
            check_eager,
            refuse_compiled_eager,
        )
        if isinstance(fn, types.FunctionType)
    ),
    graph_break=False,
)
