"""Exceptions and warnings raised by fp32scope."""

from __future__ import annotations

__all__ = ["Fp32BackwardNotScopedWarning", "Fp32EagerFallbackWarning", "Fp32FlagsChangedWarning", "Fp32ScopeError"]


class Fp32ScopeError(RuntimeError):
    """A float32-precision scope cannot be entered or a default cannot be set now.

    Raised when a scope would change the process-wide flags inside a region that
    ``torch.compile`` is tracing, while another thread is inside a scope, or when
    :func:`~fp32scope.set_process_default` is called while any scope is active.
    """


class Fp32FlagsChangedWarning(RuntimeWarning):
    """The code inside a scope changed the float32-precision flags the scope applied.

    The scope restores the state it saved on entry regardless; this warning names the
    flags that the block changed so that the code responsible can be found.
    """


class Fp32BackwardNotScopedWarning(UserWarning):
    """A scoped node's backward cannot run in the node's precision; it runs unscoped.

    Raised once per node when a wrapped call reaches a tensor with autograd history that
    is not one of its arguments (a closure over an activation, say), so that its part of
    the graph cannot be separated from the caller's. Its gradients are still exact; only
    their precision is the one current when autograd reaches the node. Pass the tensor as
    an argument, or wrap the node with ``backward=False`` to keep it forward-only.
    """


class Fp32EagerFallbackWarning(UserWarning):
    """A scope inside code that ``torch.compile`` compiles made Dynamo run that code eagerly.

    Dynamo cannot compile a change of the float32 precision flags, so where a scope is
    entered inside a compiled function (without ``fullgraph=True``, which makes it an
    error) that function runs eagerly, not compiled. Warned once per code location, at
    the scope's line, when Dynamo traces it. Wrap the compiled callable instead
    (``with_fp32_precision(precision)(torch.compile(fn))``,
    ``Fp32ScopedModule(torch.compile(module), precision)``), or make the part a scoped
    child of the compiled model.
    """


# Tracebacks, reprs and pytest's reports name the public home (``fp32scope.Fp32ScopeError``),
# where users import these from, rather than this private module. Pickling still works: the
# package resolves the name lazily.
for _name in __all__:
    globals()[_name].__module__ = "fp32scope"
del _name
