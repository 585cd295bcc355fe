"""Compiled regions: a region's node compiled by Inductor inside its op, in the node's precision.

Where a compiled parent's graph goes to Inductor, a region's call is traced as the node's
own graphs instead of one call that runs the node eagerly: while AOTAutograd traces the
parent, the node is traced functionally on fake tensors of the call's layout (its
arguments, parameters and buffers as inputs) with Inductor's decompositions, and, where a
gradient is needed, its joint graph is split as Inductor splits one. The parent's graph
then holds ``fp32scope::inner`` (no gradient), or ``fp32scope::inner_fwd`` and
``fp32scope::inner_bwd`` joined by the tensors the backward needs, which the parent's
graph carries from one to the other as any saved tensor: no table, no token, and a
second backward (``retain_graph=True``) works as it does for the parent alone.

Each graph is compiled by Inductor the first time it runs, inside the node's scope, so that
code generation (Triton's TF32 switches, the CPU's packed bf16 linear) sees the node's
precision; its kernels run in the scope too, at every call.

What is compiled inside is what the trace can hold exactly. A call is left to the eager
region (the node run eagerly inside the op) where the node updates a buffer, carries a
cache with a gradient needed, updates or binds a carried cache's tensors otherwise than the
eager region's run on fake tensors found, returns a view of an input, takes an int that
varies between calls or a tensor of symbolic shape, has hooks (they run at every call in an
eager region), enters a scope of its own (a nested scoped node), or where the trace fails:
:func:`build` returns None. Without a gradient, a static cache's keys and values, which the
node updates in place, are the graph's inputs, and their new values its first outputs,
written back by the parent's graph as the eager region's are.

The package, one concern per module, its imports pointing down this drawing (``ops`` and
``tracing`` are side by side: neither imports the other):

.. code-block:: text

   ops        the fp32scope::inner ops: kernels, fake kernels, the autograd Function
     |        that joins forward and backward, apply (the op in a graph being traced)
   tracing    build (a node's call traced into graphs, or None), Like, is_static
     |
   entries    Entry, the live entries by number, the node's plain attributes
     |        (node_state, state_holds) and its graphs for other values (variant)
   graphs     _Graph (one graph, compiled on its first run), layouts and aliasing,
              wants_inductor

Each imports: ``ops`` and ``tracing`` entries and graphs; ``entries`` graphs. Every
function the ops run is kept out of Dynamo's frames, each module excluding its own.
"""

from __future__ import annotations

# Besides the names below, what the tests and benchmarks read: the live entries, the ops'
# kernels, the check of a graph's views, an update op.
from fp32scope._wrappers.inner.entries import Entry, node_state, state_holds, variant
from fp32scope._wrappers.inner.entries import _entries as _entries
from fp32scope._wrappers.inner.graphs import wants_inductor
from fp32scope._wrappers.inner.ops import _inner_bwd_impl as _inner_bwd_impl
from fp32scope._wrappers.inner.ops import _inner_impl as _inner_impl
from fp32scope._wrappers.inner.ops import _update_op as _update_op
from fp32scope._wrappers.inner.ops import apply
from fp32scope._wrappers.inner.tracing import Like, build, is_static
from fp32scope._wrappers.inner.tracing import _is_view as _is_view

__all__ = ["Entry", "Like", "apply", "build", "is_static", "node_state", "state_holds", "variant", "wants_inductor"]
