"""``advise``: measure which submodules need full float32, and propose the smallest policy that does.

The model runs a few times on the caller's batches: once in full float32 (the reference), once
at the fast precision (every node fast), once per candidate node with only that node's own
work fast, then under candidate policies applied through :func:`~fp32scope.scope_modules`
itself, until a policy meets the tolerance and no node of it can be dropped.

Nothing is left behind: the module tree, parameters, buffers, gradients, the training flag,
the float32 precision flags, the autocast state and the random number generators are as they
were when :func:`advise` returns or raises.
"""

from fp32scope._tools.advise.report import Fp32Advice, Fp32AdviceNode
from fp32scope._tools.advise.search import advise

__all__ = ["Fp32Advice", "Fp32AdviceNode", "advise"]
