"""Saying so when a scope inside compiled code makes Dynamo run that code eagerly.

A scope entered in a region Dynamo traces is refused with a graph break (a flag change
cannot be traced). Under ``fullgraph=True`` that is an error with the library's message;
without it, Dynamo gives up on the function around the scope and runs it eagerly, and
only its logs say so. :func:`warn_eager_fallback` runs at trace time, from the refusal,
and warns once per code location.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from fp32scope._errors import Fp32EagerFallbackWarning

__all__ = ["warn_eager_fallback"]

# fp32scope/, this module being in fp32scope/_flags/: frames anywhere in the package are not the user's.
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_warned: set[tuple[str, int]] = set()

_MSG = (
    "fp32_precision_scope at {where}, in {func}, is inside code that torch.compile compiles. "
    "Dynamo cannot compile a change of the float32 precision flags, so it gives up compiling {func} "
    "there: {func} runs eagerly (all of it, or the part from the scope on, depending on the torch "
    "release), not compiled, and the scope applies to that eager code. To compile that code in its "
    "precision, wrap the compiled callable instead of scoping inside it: "
    "with_fp32_precision(precision)(torch.compile(fn)) or Fp32ScopedModule(torch.compile(module), "
    "precision); inside a compiled model, make the part a scoped child (a wrapped module or "
    "function), which is compiled as a graph of its own, in its precision."
)


def _translator(ctx: Any) -> Any:
    # ComptimeContext keeps its instruction translator in a private attribute (the same on
    # every supported torch); None where a future torch renames it: no warning then.
    return getattr(ctx, "_ComptimeContext__tx", None)


def warn_eager_fallback(ctx: Any) -> None:
    """Warn that the function Dynamo is tracing runs eagerly because of a scope in it.

    ``ctx`` is the ``torch._dynamo.comptime`` context of the refusal. Nothing happens under
    ``fullgraph=True`` (or torch's ``error_on_graph_break``), where the graph break is an
    error that says as much, nor a second time for the same code location.
    """
    tx = _translator(ctx)
    user = None
    root = tx
    while tx is not None:
        code = getattr(tx, "f_code", None)
        if user is None and code is not None and not code.co_filename.startswith(_PACKAGE_DIR):
            user = tx
        root = tx
        tx = getattr(tx, "parent", None)
    if user is None or getattr(root, "one_graph", False) or getattr(root, "error_on_graph_break", False):
        return
    code = user.f_code
    lineno = getattr(user, "lineno", None) or code.co_firstlineno
    key = (code.co_filename, lineno)
    if key in _warned:
        return
    _warned.add(key)
    func = getattr(code, "co_qualname", code.co_name)
    msg = _MSG.format(where=f"{code.co_filename}:{lineno}", func=f"{func}()")
    warnings.warn_explicit(msg, Fp32EagerFallbackWarning, code.co_filename, lineno)
