"""fp32scope: scoped, exact, thread-safe float32 matmul/cuDNN precision for PyTorch nodes.

An engine sets a process default once (:func:`set_process_default`); a node that needs
another precision declares it (:func:`node_fp32_precision`), and the engine runs every call
of that node inside :func:`fp32_precision_scope`, usually through
:func:`with_fp32_precision` or :class:`Fp32ScopedModule` around the ``torch.compile``'d
callable.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fp32scope._advise import Fp32Advice, Fp32AdviceNode, advise
    from fp32scope._cuda_graphs import CapturedCudaGraph, capture_cuda_graph
    from fp32scope._decorator import with_fp32_precision
    from fp32scope._errors import (
        Fp32AutocastWarning,
        Fp32BackwardNotScopedWarning,
        Fp32EagerFallbackWarning,
        Fp32FlagsChangedWarning,
        Fp32ParameterDtypeWarning,
        Fp32ScopeError,
    )
    from fp32scope._export import (
        ScopedAOTIModel,
        aoti_compile_and_package,
        aoti_load_package,
        load_exported_program,
        save_exported_program,
    )
    from fp32scope._node import node_fp32_precision
    from fp32scope._policy import scope_modules, scoped_modules, unscope_modules
    from fp32scope._precision import Fp32Precision
    from fp32scope._process import current_fp32_precision, set_process_default
    from fp32scope._proxy import Fp32ScopedModule, precision_of
    from fp32scope._scope import fp32_precision_scope
    from fp32scope._trace import Fp32Trace, Fp32TraceEvent, trace
    from fp32scope._unchanged import assert_fp32_flags_unchanged

# Public names load on first use (PEP 562): the pytest plugin lives in this package and is
# loaded by every pytest run of an environment that has fp32scope, and it must not import
# torch (about a second) unless a test uses it.
_HOMES = {
    "Fp32Advice": "_advise",
    "Fp32AdviceNode": "_advise",
    "advise": "_advise",
    "CapturedCudaGraph": "_cuda_graphs",
    "capture_cuda_graph": "_cuda_graphs",
    "with_fp32_precision": "_decorator",
    "Fp32AutocastWarning": "_errors",
    "Fp32BackwardNotScopedWarning": "_errors",
    "Fp32EagerFallbackWarning": "_errors",
    "Fp32FlagsChangedWarning": "_errors",
    "Fp32ParameterDtypeWarning": "_errors",
    "Fp32ScopeError": "_errors",
    "ScopedAOTIModel": "_export",
    "aoti_compile_and_package": "_export",
    "aoti_load_package": "_export",
    "load_exported_program": "_export",
    "save_exported_program": "_export",
    "node_fp32_precision": "_node",
    "scope_modules": "_policy",
    "scoped_modules": "_policy",
    "unscope_modules": "_policy",
    "Fp32Precision": "_precision",
    "current_fp32_precision": "_process",
    "set_process_default": "_process",
    "Fp32ScopedModule": "_proxy",
    "precision_of": "_proxy",
    "fp32_precision_scope": "_scope",
    "Fp32Trace": "_trace",
    "Fp32TraceEvent": "_trace",
    "trace": "_trace",
    "assert_fp32_flags_unchanged": "_unchanged",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        msg = f"module 'fp32scope' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(f"fp32scope.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

__all__ = [
    "CapturedCudaGraph",
    "Fp32Advice",
    "Fp32AdviceNode",
    "Fp32AutocastWarning",
    "Fp32BackwardNotScopedWarning",
    "Fp32EagerFallbackWarning",
    "Fp32FlagsChangedWarning",
    "Fp32ParameterDtypeWarning",
    "Fp32Precision",
    "Fp32ScopeError",
    "Fp32ScopedModule",
    "Fp32Trace",
    "Fp32TraceEvent",
    "ScopedAOTIModel",
    "advise",
    "aoti_compile_and_package",
    "aoti_load_package",
    "assert_fp32_flags_unchanged",
    "capture_cuda_graph",
    "current_fp32_precision",
    "fp32_precision_scope",
    "load_exported_program",
    "node_fp32_precision",
    "precision_of",
    "save_exported_program",
    "scope_modules",
    "scoped_modules",
    "set_process_default",
    "trace",
    "unscope_modules",
    "with_fp32_precision",
]
