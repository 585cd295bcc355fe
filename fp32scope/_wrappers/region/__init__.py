"""In-graph regions: a scoped node as one opaque op of a compiled parent's graph.

A flag change cannot be traced. A compiled parent could graph-break at a scoped node
(``in_graph=False``); by default Dynamo instead traces the node's call as one call of
:func:`region_call`, kept whole in its graph (``torch._dynamo.allow_in_graph``), which
AOTAutograd and Inductor see as one call of the custom op ``fp32scope::region`` (or
``fp32scope::region_grad`` where a gradient is needed, whose backward is
``fp32scope::region_backward``). The op runs the node's whole forward at run time, eagerly,
inside the node's scope; the parent's graph runs around it at the process default, with
no graph break (``fullgraph=True`` compiles).

Where the parent's graph goes to Inductor, a call the node's compiled code can hold exactly
is traced instead as the node's own graphs, compiled by Inductor inside their ops and run
in the node's scope (:mod:`fp32scope._wrappers.inner`): no Python of the node runs, and
its backward's tensors are saved by the parent's graph. What follows describes the eager
region, which every other backend (``aot_eager``, a user's own), every ``eager=True`` node
and every call the compiled code cannot hold (see :mod:`fp32scope._wrappers.inner`) gets.

What crosses the op's boundary:

* the call's tensor arguments, the node's parameters and its buffers are the op's inputs,
  so that gradients flow to them through the graph and land in ``.grad`` as always (the
  op binds them into the node for its run, every place a shared one is used);
  non-tensor arguments (``None``, numbers, strings, dtypes, devices) are constants of the
  graph, kept in a layout the op names by number, except ints Dynamo made symbolic (they
  vary between calls), which are op inputs too;
* a Hugging Face key-value cache (``DynamicCache``, ``StaticCache``: :mod:`.carriers`), as a
  tuple of its tensors and constants; the op's kernel builds a fresh cache around them for
  the node. What the node changes on it comes back: tensors it binds anew (a dynamic
  layer's ``torch.cat``) as outputs, and its new constants (``is_initialized``, sizes) as
  constants of the layout, both set on the caller's cache after the op (Dynamo replays
  the attribute writes); tensors it updates in place (a static layer's keys, values and
  length) run on copies, which leave the op and are written back (``copy_``), as buffers
  are. Each layout is numbered by its content: the number is all of it a graph holds;
* the node's outputs: tensors, in tuples, lists or dicts, with constants; an output that
  shares memory with an input or another output (a view of an argument, an argument handed
  back) leaves as a copy, as does, in training, every output (the kept graph may hold it);
* each buffer the node updates in place (BatchNorm's running statistics) runs on a copy
  that leaves the op as an output and is written back by the graph (``copy_``), so the op
  itself mutates nothing (an op with an autograd formula cannot declare mutated inputs);
  which buffers those are is found once per training/eval layout, by the run on fake
  tensors that Dynamo makes while it traces, from the writes its ops declare (a batch
  norm's running statistics change without their version counters moving);
* the caller's autocast state when the graph was traced (a compiled graph holds no
  autocast state at run time): the op re-enters it around the node, or runs the node
  without it and with float32 arguments where the node's policy is ``autocast=False``.

Training: the op's autograd formula runs the node's forward with autograd on, over
detached aliases of the inputs that need a gradient, and keeps that graph (no recompute)
for ``fp32scope::region_backward``, which runs autograd's engine over it inside the scope
and hands the gradients back to the compiled backward. The kept graph is found through a
token, a one-element int64 tensor saved for the backward, and dropped when the token dies:
when the compiled graph's backward frees what it saved (no ``retain_graph``; with it, a
second backward runs through the kept graph again), or with a forward whose backward never
runs.

A region's number, which the graph holds, carries random bits of its process: Inductor's
and AOTAutograd's caches on disk serve a graph to any later process that makes the same
graph, and the same number there may stand for another node. So a graph holding a region
is compiled afresh by each process (never served from another's cache).

Tensors a node reaches other than as arguments, parameters or buffers (a closure, a
global) cannot cross the boundary: such a node is refused with :class:`Fp32ScopeError`
while the graph is traced, as is ``torch.export`` of a model with a region (a loading
process would not have this process's regions).

The package, one concern per module, its imports pointing down this drawing (``eager`` and
``inside`` are side by side: neither imports the other):

.. code-block:: text

   entry      Dynamo's entry: traced_region (traced), region_call (kept whole), the
     |        graph break for an argument a region cannot carry
     +-- eager    the fp32scope::region ops: kernels, fake kernels, autograd formula,
     |            the kept forward graphs
     +-- inside   a call compiled inside its op: the glue to _wrappers.inner
     |
   boundary   what crosses the op: parameters and buffers bound, autocast, outputs
     |        flattened, unaliased and rebuilt
   regions    Region, its layouts and carried plans; the registry and the numbers
     |
   refusals   what a region refuses, and its messages

Each imports: ``entry`` the five others; ``eager`` boundary, regions and refusals;
``inside`` boundary and regions; ``boundary`` regions and refusals; ``regions`` refusals.
Dynamo traces ``traced_region``, ``_carriable``, ``_carried_changes``, ``_out_recipe``
(``entry``) and ``_rebuild`` (``boundary``), and keeps ``region_call`` whole; every other
function of the package is kept out of its frames, each module excluding its own.
"""

from __future__ import annotations

from fp32scope._wrappers.region.eager import _saved as _saved
from fp32scope._wrappers.region.entry import region_call, traced_region, warn_break
from fp32scope._wrappers.region.regions import Region, check_in_graph

__all__ = ["Region", "check_in_graph", "region_call", "traced_region", "warn_break"]
