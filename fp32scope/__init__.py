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
    from fp32scope._errors import (
        Fp32AutocastWarning,
        Fp32BackwardNotScopedWarning,
        Fp32EagerFallbackWarning,
        Fp32FlagsChangedWarning,
        Fp32ParameterDtypeWarning,
        Fp32RegionBreakWarning,
        Fp32ScopeError,
    )
    from fp32scope._export.cuda_graphs import CapturedCudaGraph, capture_cuda_graph
    from fp32scope._export.export import (
        ScopedAOTIModel,
        aoti_compile_and_package,
        aoti_load_package,
        load_exported_program,
        save_exported_program,
    )
    from fp32scope._flags.precision import Fp32Precision
    from fp32scope._flags.process import current_fp32_precision, set_process_default
    from fp32scope._flags.scope import fp32_precision_scope
    from fp32scope._flags.unchanged import assert_fp32_flags_unchanged
    from fp32scope._tools.advise import Fp32Advice, Fp32AdviceNode, advise
    from fp32scope._wrappers.decorator import with_fp32_precision
    from fp32scope._wrappers.node import node_fp32_precision
    from fp32scope._wrappers.policy import scope_modules, scoped_modules, unscope_modules
    from fp32scope._wrappers.proxy import Fp32ScopedModule, precision_of
    from fp32scope._wrappers.trace import Fp32Trace, Fp32TraceEvent, trace

# Public names load on first use (PEP 562): the pytest plugin lives in this package and is
# loaded by every pytest run of an environment that has fp32scope, and it must not import
# torch (about a second) unless a test uses it.
_HOMES = {
    "Fp32Advice": "_tools.advise",
    "Fp32AdviceNode": "_tools.advise",
    "advise": "_tools.advise",
    "CapturedCudaGraph": "_export.cuda_graphs",
    "capture_cuda_graph": "_export.cuda_graphs",
    "with_fp32_precision": "_wrappers.decorator",
    "Fp32AutocastWarning": "_errors",
    "Fp32BackwardNotScopedWarning": "_errors",
    "Fp32EagerFallbackWarning": "_errors",
    "Fp32FlagsChangedWarning": "_errors",
    "Fp32ParameterDtypeWarning": "_errors",
    "Fp32RegionBreakWarning": "_errors",
    "Fp32ScopeError": "_errors",
    "ScopedAOTIModel": "_export.export",
    "aoti_compile_and_package": "_export.export",
    "aoti_load_package": "_export.export",
    "load_exported_program": "_export.export",
    "save_exported_program": "_export.export",
    "node_fp32_precision": "_wrappers.node",
    "scope_modules": "_wrappers.policy",
    "scoped_modules": "_wrappers.policy",
    "unscope_modules": "_wrappers.policy",
    "Fp32Precision": "_flags.precision",
    "current_fp32_precision": "_flags.process",
    "set_process_default": "_flags.process",
    "Fp32ScopedModule": "_wrappers.proxy",
    "precision_of": "_wrappers.proxy",
    "fp32_precision_scope": "_flags.scope",
    "Fp32Trace": "_wrappers.trace",
    "Fp32TraceEvent": "_wrappers.trace",
    "trace": "_wrappers.trace",
    "assert_fp32_flags_unchanged": "_flags.unchanged",
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
    "Fp32RegionBreakWarning",
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
