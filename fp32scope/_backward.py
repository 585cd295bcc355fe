"""Running a scoped call's backward in the call's precision.

A wrapped call that records autograd history (grad mode on, an output requiring grad)
is turned into one node of the caller's graph: its outputs are handed back detached, as
the outputs of a custom ``autograd.Function`` (``_Boundary``) whose inputs are the
tensors the call's own subgraph reached at its edge (the call's tensor arguments, the
parameters and other leaves it used). The boundary node's backward runs
``torch.autograd.grad`` from the call's real outputs to those tensors inside the call's
precision scope, and hands the gradients back to the caller's graph. So:

* every autograd node the call created runs its backward inside the scope, and only those
  (nodes before and after keep whatever precision is current when they run);
* the scope is exactly bracketed and exception-safe by construction: an error in the
  node's backward leaves through the scope's ``with`` block, which restores the flags;
* an AOTAutograd backward graph, compiled lazily at the first backward, compiles there.

Tensor arguments that are not leaves enter the call as detached leaf aliases (same
storage, same version counter), so that the call's subgraph ends exactly at its boundary.
Without that cut, a parameter reached both inside the call and through an argument's
history (tied weights: an LM head reusing the embedding) would get its gradient twice.
A call that reaches a non-leaf tensor some other way (a closure over an activation, an
attribute holding one) cannot be cut there: it keeps a plain forward scope, with a
``Fp32BackwardNotScopedWarning`` once per wrapper.

With ``create_graph=True`` the gradient computation is recorded the same way, so a
double backward runs in the precision too and reaches the call's real inputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree

from fp32scope import _dynamo_exclude
from fp32scope._errors import Fp32BackwardNotScopedWarning
from fp32scope._scope import fp32_precision_scope, wrapper_scope

__all__ = ["call_recorded", "grad_enabled"]

#: Bound once: checked on every wrapped call; under no_grad / inference_mode nothing else runs.
grad_enabled = torch.is_grad_enabled
_sequence_nr = torch._C._autograd._get_sequence_nr
_Tensor = torch.Tensor
# AccumulateGrad nodes (leaves) carry the largest sequence number, so that the engine runs
# them last; every other node numbers in creation order on its thread.
_LEAF_SEQ = 2**64 - 1
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
# Saved by every boundary node, only to learn afterwards whether the engine freed it.
_SENTINEL = torch.empty(0)

_BACKWARD_TWICE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed) through fp32scope-scoped node {name!r}. Specify retain_graph=True if you need to "
    "backward through the graph a second time."
)


class _State:
    """What one recorded call leaves for its backward."""

    __slots__ = ("inner_inputs", "inner_outputs", "leaf_map", "name", "precision", "released", "start")

    def __init__(  # noqa: PLR0913
        self,
        inner_outputs: list[torch.Tensor],
        inner_inputs: list[torch.Tensor],
        precision: Any,
        name: str | None,
        start: int,
        leaf_map: dict[int, torch.Tensor],
    ) -> None:
        self.inner_outputs: list[torch.Tensor] | None = inner_outputs
        self.inner_inputs = inner_inputs
        self.precision = precision
        self.name = name
        self.start = start  # the first sequence number of the call's own nodes
        self.leaf_map = leaf_map  # id(alias) -> the caller's tensor it stands for
        self.released = False


def _release_if_freed(ctx: Any) -> None:
    # Runs when the outer graph task ends. Without retain_graph the engine has freed the
    # boundary node's saved sentinel by then: drop the call's subgraph (and its saved
    # activations) now, as torch would have, instead of when the outputs die.
    try:
        ctx._raw_saved_tensors  # noqa: B018  (raises once the engine released the node)
    except RuntimeError:
        state: _State = ctx.state
        state.inner_outputs = None
        state.inner_inputs = []
        state.leaf_map = {}
        state.released = True


class _Boundary(torch.autograd.Function):
    """One node standing for a scoped call's whole subgraph."""

    @staticmethod
    def forward(ctx: Any, state: _State, sentinel: torch.Tensor, *outer_inputs: torch.Tensor) -> tuple[Any, ...]:
        ctx.state = state
        ctx.queued = -2
        # Unused outputs get None, not zeros: their part of the subgraph must not run.
        ctx.set_materialize_grads(False)
        # Saved only to learn whether the engine kept the graph (retain_graph).
        ctx.save_for_backward(sentinel)
        outputs = state.inner_outputs
        if outputs is None:  # pragma: no cover  (forward runs right after recording)
            return ()
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        state: _State = ctx.state
        n_inputs = len(state.inner_inputs)
        outputs = state.inner_outputs
        if outputs is None:
            raise RuntimeError(_BACKWARD_TWICE.format(name=state.name))
        used = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
        if not used:
            return (None, None, *([None] * n_inputs))
        task = torch._C._current_graph_task_id()
        if ctx.queued != task:
            ctx.queued = task
            _queue_callback(lambda: _release_if_freed(ctx))
        outs = [o for o, _ in used]
        gs = [g for _, g in used]
        if torch.is_grad_enabled():  # create_graph=True: record the gradient computation too
            inputs = state.inner_inputs

            def grad_create_graph(*gs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
                return torch.autograd.grad(outs, inputs, gs, retain_graph=True, create_graph=True, allow_unused=True)

            # The call's own forward nodes count as its subgraph (they carry the double
            # backward), and its aliases lead back to the caller's tensors.
            computed = call_recorded(
                state.precision, state.name, grad_create_graph, tuple(gs), {}, start=state.start, leaf_map=state.leaf_map
            )
        else:
            with wrapper_scope(state.precision, state.name or "backward"):
                computed = torch.autograd.grad(outs, state.inner_inputs, gs, retain_graph=True, allow_unused=True)
        return (None, None, *computed)


_warned: set[int] = set()


def _warn_not_scoped(name: str | None, what: str) -> None:
    key = hash((name, what))
    if key in _warned:
        return
    _warned.add(key)
    where = f" {name!r}" if name is not None else ""
    msg = (
        f"The backward of scoped node{where} runs under the precision current when autograd reaches it, not "
        f"the node's: the call reaches {what}, which is neither one of its arguments nor a leaf, so its "
        "subgraph cannot be cut off from the caller's graph. Pass that tensor as an argument, or wrap the "
        "node with backward=False to keep it forward-only and silence this warning."
    )
    warnings.warn(msg, Fp32BackwardNotScopedWarning, stacklevel=4)


def _cut(value: Any, aliases: dict[int, torch.Tensor], leaf_map: dict[int, torch.Tensor]) -> Any:
    # A non-leaf tensor that requires grad enters as a detached leaf alias; the map sends
    # each alias back to the tensor it stands for.
    if type(value) is _Tensor or isinstance(value, _Tensor):
        if value.requires_grad and value.grad_fn is not None:
            alias = aliases.get(id(value))
            if alias is None:
                alias = value.detach().requires_grad_()
                aliases[id(value)] = alias
                leaf_map[id(alias)] = value
            return alias
        return value
    return value


def call_recorded(
    precision: Any,
    name: str | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    start: int | None = None,
    scope: fp32_precision_scope | None = None,
    leaf_map: dict[int, torch.Tensor] | None = None,
) -> Any:
    """Call ``fn(*args, **kwargs)`` in the scope; make its backward run in the scope too.

    Called only with grad mode on. ``start`` (for a recorded backward) widens what counts
    as the call's own subgraph to everything since that sequence number.
    """
    aliases: dict[int, torch.Tensor] = {}
    leaf_map = {} if leaf_map is None else dict(leaf_map)
    flat_args, spec = _pytree.tree_flatten((args, kwargs))
    cut = [_cut(a, aliases, leaf_map) for a in flat_args]
    if aliases:
        args, kwargs = _pytree.tree_unflatten(cut, spec)
    first = _sequence_nr()
    if start is None:
        start = first
    with scope if scope is not None else wrapper_scope(precision, name or "backward"):
        result = fn(*args, **kwargs)
    leaf_back = leaf_map  # an argument returned as it was goes back as the caller's tensor
    flat, out_spec = _pytree.tree_flatten(result)
    positions: list[int] = []
    inner_outputs: list[torch.Tensor] = []
    roots: list[Any] = []
    for i, value in enumerate(flat):
        if not isinstance(value, _Tensor) or not value.requires_grad:
            continue
        fn_node = value.grad_fn
        if fn_node is None:
            original = leaf_back.get(id(value))
            if original is not None:
                flat[i] = original
            continue
        if fn_node._sequence_nr() < start:
            continue  # made before the call: not the call's own history
        positions.append(i)
        inner_outputs.append(value)
        roots.append(fn_node)
    if not roots:
        return _pytree.tree_unflatten(flat, out_spec) if leaf_back else result
    # The call's subgraph: every node reachable from its outputs that it created. Its edge
    # must be leaves only (AccumulateGrad), after the cut above.
    seen: set[Any] = set()
    stack = roots
    leaves: dict[int, torch.Tensor] = {}
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            seq = nxt._sequence_nr()
            if seq == _LEAF_SEQ:
                variable = nxt.variable
                leaves.setdefault(id(variable), variable)
            elif seq >= start:
                stack.append(nxt)
            else:
                _warn_not_scoped(name, f"a non-leaf tensor made by {type(nxt).__name__}")
                return _pytree.tree_unflatten(flat, out_spec) if leaf_back else result
    inner_inputs = list(leaves.values())
    outer_inputs = [leaf_map.get(id(t), t) for t in inner_inputs]
    state = _State(inner_outputs, inner_inputs, precision, name, start, leaf_map)
    wrapped = _Boundary.apply(state, _SENTINEL, *outer_inputs)
    for i, w in zip(positions, wrapped, strict=True):
        flat[i] = w
    return _pytree.tree_unflatten(flat, out_spec)


_dynamo_exclude.exclude(
    call_recorded,
    _cut,
    _warn_not_scoped,
    _release_if_freed,
    graph_break=False,
)
