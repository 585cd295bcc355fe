"""Running a scoped call's backward in the call's precision.

A wrapped call that records autograd history (grad mode on, an output requiring grad)
is turned into one node of the caller's graph: its outputs are handed back detached, as
the outputs of a custom ``autograd.Function`` (``Fp32ScopedCall``) whose inputs are the
tensors where the call's own subgraph ends (the call's tensor arguments, the parameters
and other leaves it used). That node's backward runs autograd's engine from the call's
real outputs to those tensors inside the call's precision scope, and hands the
gradients back to the caller's graph; it frees the call's subgraph as it goes exactly
when the caller's backward frees its own (no ``retain_graph``), which the engine tells it
(on torch < 2.5, which cannot, an identity node on top, ``Fp32ScopedCallGate``, tells it
instead). In graph dumps it shows as ``Fp32ScopedCallBackward``. So:

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
``Fp32BackwardNotScopedWarning`` once per wrapper object (two wrappers of one name each
warn).

How the leaves of the subgraph get their gradients (accumulated as the nested engine
reaches them, with the engine's own buffer, each hook once) is ``_leaf_grads``'s half.

With ``create_graph=True`` the gradient computation is recorded the same way, so a
double backward runs in the precision too and reaches the call's real inputs.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from types import FunctionType
from typing import Any

import torch
from torch.utils import _pytree

from fp32scope._compat import CURRENT_GRAPH_TASK_KEEPS_GRAPH
from fp32scope._errors import Fp32BackwardNotScopedWarning, Fp32ScopeError, user_stacklevel
from fp32scope._flags import dynamo_exclude
from fp32scope._flags.scope import fp32_precision_scope, wrapper_scope
from fp32scope._training.leaf_grads import LeafAccumulation, engine_grad, mute_tensor_hooks, unmute

__all__ = ["call_recorded", "grad_enabled", "recording_scope"]

#: Bound once: checked on every wrapped call; under no_grad / inference_mode nothing else runs.
grad_enabled = torch.is_grad_enabled
_sequence_nr = torch._C._autograd._get_sequence_nr
_Tensor = torch.Tensor
# AccumulateGrad nodes (leaves) carry the largest sequence number, so that the engine runs
# them last; every other node numbers in creation order on its thread.
_LEAF_SEQ = 2**64 - 1
_empty = torch.empty
_functorch_level = torch._C._functorch.maybe_current_level
# The base of every Python autograd node (custom Functions, AOTAutograd's compiled ones);
# torch's own nodes are C++ ones.
_PythonNode = torch._C._FunctionBase
_will_execute = torch._C._will_engine_execute_node

#: Whether the running backward retains its graph (torch >= 2.5); None: the gate node tells.
_keep_graph: Callable[[], bool] | None = CURRENT_GRAPH_TASK_KEEPS_GRAPH

# torch's words when code modifies a leaf that requires grad in place (a leaf alias of an
# argument, here), and what the user is told instead.
_IN_PLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"
_IN_PLACE_MSG = (
    "Scoped node {name!r} modified one of its tensor arguments in place while recording autograd history. "
    "To run the node's backward in its precision, fp32scope hands each argument that has autograd history "
    "to the node as a leaf sharing its storage, and torch refuses in-place changes to such leaves. Make the "
    "node work on a copy (x = x.clone(), or an out-of-place op), or wrap it with backward=False to keep the "
    "scope forward-only."
)

_BACKWARD_TWICE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed) through fp32scope-scoped node {name!r}. Specify retain_graph=True if you need to "
    "backward through the graph a second time."
)


class _State:
    """What one recorded call leaves for its backward."""

    __slots__ = (
        "direct",
        "extended",
        "inner_inputs",
        "inner_outputs",
        "leaf_map",
        "leaf_nodes",
        "name",
        "owner",
        "precision",
        "sentinel",
        "shared",
        "start",
    )

    def __init__(
        self, scope: fp32_precision_scope, owner: fp32_precision_scope, start: int, leaf_map: dict[int, torch.Tensor]
    ) -> None:
        self.precision = scope.precision
        self.name = scope._name
        self.owner = owner  # the wrapper's recording scope: what its warnings are keyed on
        self.start = start  # the first sequence number of the call's own nodes
        self.leaf_map = leaf_map  # id(alias) -> the caller's tensor it stands for
        # The call's outputs with their history, and the leaves where that history ends;
        # None and empty once the engine has freed the graph (no retain_graph).
        self.inner_outputs: list[torch.Tensor] | None = None
        self.inner_inputs: list[torch.Tensor] = []
        # Parallel to inner_inputs: the AccumulateGrad node of each leaf that is the
        # caller's own tensor (a parameter, a leaf argument), None for an argument's alias.
        self.leaf_nodes: list[Any] = []
        # Whether the subgraph takes in the history of a non-leaf tensor from before the
        # call (reached other than through the arguments): that history may be the caller's
        # graph's too, so the nested engine must not free it.
        self.extended = False
        # Whether the subgraph's gradients for the caller's leaves may go back through the
        # boundary, for the caller's engine to accumulate (see _direct_backward): no node in
        # the subgraph is a Python one, which might read a leaf's .grad as it runs.
        self.direct = False
        # A weak reference to a tensor only the gate node holds (saved for backward): alive
        # while the engine keeps the gate's saved tensors. None under a saved-tensor hook,
        # which takes the tensor away.
        self.sentinel: weakref.ref[torch.Tensor] | None = None
        # Set once a create_graph backward recorded a graph over this subgraph: a double
        # backward then runs it again through another boundary, so it is never freed early.
        self.shared = False

    def scope(self) -> fp32_precision_scope:
        """A new scope for this call's backward (warnings and errors name the node)."""
        return wrapper_scope(self.precision, self.name or "backward", "backward")  # phase: issue 20, trace()


def recording_scope(scope: fp32_precision_scope) -> fp32_precision_scope:
    """A twin of a wrapper's ``scope`` (its precision and name) for :func:`call_recorded`."""
    twin = wrapper_scope(scope.precision, scope._name or "")
    twin._name = scope._name
    return twin


def _release(state: _State) -> None:
    # The graph was not retained: the engine freed every other node's saved tensors as it
    # went; drop this call's subgraph too, so that nothing keeps it alive until the
    # outputs die.
    state.inner_outputs = None
    state.inner_inputs = []
    state.leaf_nodes = []
    state.leaf_map = {}


def _scoped_backward(
    state: _State, outs: tuple[torch.Tensor, ...], gs: tuple[torch.Tensor, ...], keep: bool
) -> list[torch.Tensor | None]:
    """Run the call's subgraph from ``outs`` in its scope; the gradients for the boundary's edges.

    The one place where a scoped backward enters its scope.
    """
    inputs = state.inner_inputs
    leaves = LeafAccumulation(inputs, state.leaf_nodes)
    try:
        if not leaves.engine_inputs:
            return [None] * len(inputs)
        with state.scope():
            computed = engine_grad(outs, tuple(leaves.engine_inputs), gs, keep=keep)
    finally:
        leaves.close()
    return leaves.for_boundary(computed, len(inputs))


def _needed(node: Any) -> bool:
    # Whether the caller's backward needs this leaf's gradient: it runs the leaf's
    # AccumulateGrad node, or captures its gradient (then torch raises).
    try:
        return bool(_will_execute(node))
    except RuntimeError:
        return True


def _direct_backward(
    state: _State, outs: tuple[torch.Tensor, ...], gs: tuple[torch.Tensor, ...], keep: bool
) -> list[torch.Tensor | None] | tuple[torch.Tensor | None, ...]:
    """Run the call's subgraph from ``outs`` in its scope; the leaves' gradients go back.

    For a subgraph of torch's own nodes only: nothing in it reads a leaf's ``.grad`` while
    it runs, so the caller's engine accumulates the leaves when the boundary hands their
    gradients back, as it would have a moment earlier without the boundary (the same
    ``AccumulateGrad`` node, its hooks, its stealing of the buffer). The nested engine runs
    the tensor hooks of a leaf it captures; the caller's engine runs them again, so they
    are muted here. A leaf the caller's backward does not need (``autograd.grad`` or
    ``backward(inputs=...)`` without it) is left out, as the caller's engine leaves it out.
    """
    inputs = state.inner_inputs
    needed: list[int] = []
    muted: list[tuple[Any, list[Any]]] = []
    for i, (leaf, node) in enumerate(zip(inputs, state.leaf_nodes, strict=True)):
        if node is None:  # an argument's alias: its gradient continues in the caller's graph
            needed.append(i)
        elif _needed(node):
            needed.append(i)
            hooks = leaf._backward_hooks
            if hooks:  # the caller's engine runs them
                muted.append((hooks, list(hooks.items())))
                hooks.clear()
    if not needed:
        return [None] * len(inputs)
    engine_inputs = inputs if len(needed) == len(inputs) else [inputs[i] for i in needed]
    try:
        with state.scope():
            computed = engine_grad(outs, tuple(engine_inputs), gs, keep=keep)
    finally:
        if muted:
            unmute(muted)
    if engine_inputs is inputs:
        return computed  # type: ignore[no-any-return]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    for i, grad in zip(needed, computed, strict=True):
        result[i] = grad
    return result


class Fp32ScopedCall(torch.autograd.Function):
    """One node standing for a scoped call's whole subgraph: its backward runs it, scoped."""

    @staticmethod
    def forward(ctx: Any, state: _State, *_outer_inputs: torch.Tensor) -> tuple[Any, ...]:
        # The outer inputs are there only to become this node's edges in the caller's graph.
        ctx.state = state
        # Unused outputs get None, not zeros: their part of the subgraph must not run.
        ctx.set_materialize_grads(False)
        outputs = state.inner_outputs
        if outputs is None:  # pragma: no cover  (forward runs right after recording)
            return ()
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        state: _State = ctx.state
        outputs = state.inner_outputs
        if outputs is None:
            raise RuntimeError(_BACKWARD_TWICE.format(name=state.name))
        if len(grads) == 1:  # the usual node: one output
            if grads[0] is None:
                return (None, *([None] * len(state.inner_inputs)))
            outs: tuple[torch.Tensor, ...] = (outputs[0],)
            gs: tuple[torch.Tensor, ...] = grads  # type: ignore[assignment]
        else:
            used = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
            if not used:
                return (None, *([None] * len(state.inner_inputs)))
            outs = tuple(o for o, _ in used)
            gs = tuple(g for _, g in used)
        if grad_enabled():  # create_graph=True: record the gradient computation too
            inputs = state.inner_inputs

            def grad_create_graph(*gs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
                # Every gradient goes back to the caller's graph, whose AccumulateGrad runs
                # the leaves' tensor hooks: muted here, so that they run once.
                muted = mute_tensor_hooks(inputs, state.leaf_nodes)
                try:
                    return torch.autograd.grad(
                        outs, inputs, gs, retain_graph=True, create_graph=True, allow_unused=True
                    )
                finally:
                    unmute(muted)

            # The call's own forward nodes count as its subgraph (they carry the double
            # backward), and its aliases lead back to the caller's tensors.
            state.shared = True
            computed = call_recorded(
                state.scope(),
                grad_create_graph,
                gs,
                {},
                start=state.start,
                leaf_map=state.leaf_map,
                shared=True,
                owner=state.owner,
            )
            return (None, *computed)
        if _keep_graph is not None:
            keep = state.shared or _keep_graph()
        else:  # pragma: no cover  (torch < 2.5)
            # The gate ran just before this node; the engine has released its saved sentinel
            # already unless the graph is retained (or a saved-tensor hook took it: then keep).
            ref = state.sentinel
            keep = state.shared or ref is None or ref() is not None
        # An extended subgraph runs nodes that may be the caller's too: never free them here.
        if state.direct:
            computed = _direct_backward(state, outs, gs, keep or state.extended)
        else:
            computed = _scoped_backward(state, outs, gs, keep or state.extended)
        if not keep:
            _release(state)
        return (None, *computed)


# Function.apply without its pass over the inputs for dead functorch wrappers (no
# transform is active where a call is recorded; a wrapped input takes Function.apply).
_apply_boundary: Callable[..., tuple[torch.Tensor, ...]] = super(torch.autograd.Function, Fp32ScopedCall).apply
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


class Fp32ScopedCallGate(torch.autograd.Function):
    """The identity on the boundary's outputs; shows the boundary whether the graph is retained.

    The engine frees a node's saved tensors right after running it when the graph is not
    retained, before it runs the nodes after it. So the boundary, which runs right after
    this gate, sees the gate's saved sentinel gone exactly when ``retain_graph`` is off,
    and can free the call's subgraph as it goes, as torch frees every other node's.
    """

    @staticmethod
    def forward(ctx: Any, sentinel: torch.Tensor, *outputs: torch.Tensor) -> tuple[Any, ...]:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(sentinel)
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(_ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *grads)


# The wrappers (their recording scopes, one per wrapper object) warned already, per kind.
# Keyed on the object itself, kept alive here, so that a new wrapper never inherits a dead
# one's key: two wrappers of the same name each warn once.
_warned: set[tuple[fp32_precision_scope, str]] = set()


def _warn_once(owner: fp32_precision_scope, kind: str, msg: str) -> None:
    key = (owner, kind)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(msg, Fp32BackwardNotScopedWarning, stacklevel=user_stacklevel())


def _warn_not_scoped(owner: fp32_precision_scope) -> None:
    name = owner._name
    where = f" {name!r}" if name is not None else ""
    msg = (
        f"The backward of scoped node{where} runs under the precision current when autograd reaches it, not "
        "the node's (its gradients are exact; only their precision is not the node's): it is called inside a "
        "torch.func transform (grad, vmap, jacrev, ...), which differentiates the call itself. Call the "
        "transform inside the node, or wrap the node with backward=False to keep it forward-only and silence "
        "this warning."
    )
    _warn_once(owner, "transform", msg)


def _warn_extended(owner: fp32_precision_scope, what: str) -> None:
    name = owner._name
    where = f" {name!r}" if name is not None else ""
    msg = (
        f"Scoped node{where} reaches {what}, which is neither one of its arguments nor a leaf (a closure over "
        "an activation, an attribute holding one, FSDP1's flat-parameter views). Its gradients are exact, but "
        "the backward of that tensor's history, down to the leaves, runs inside the node's backward, in the "
        "node's precision, and where that tensor is also used outside the node, the hooks on its history run "
        "once for each use. Pass the tensor as an argument (or wrap the unit that makes it rather than its "
        "forward), or wrap the node with backward=False to keep it forward-only and silence this warning."
    )
    _warn_once(owner, "extended", msg)


def _cut(value: Any, aliases: dict[int, torch.Tensor], leaf_map: dict[int, torch.Tensor]) -> Any:
    # A non-leaf tensor that requires grad enters as a detached leaf alias (same storage,
    # same version counter); the map sends each alias back to the tensor it stands for.
    if isinstance(value, _Tensor) and value.requires_grad and value.grad_fn is not None:
        alias = aliases.get(id(value))
        if alias is None:
            alias = value.detach().requires_grad_()
            aliases[id(value)] = alias
            leaf_map[id(alias)] = value
        return alias
    return value


# Argument and result types that hold no tensors pytree would find: no flattening needed.
_ATOMS = (_Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)


def _cut_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], leaf_map: dict[int, torch.Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    aliases: dict[int, torch.Tensor] = {}
    if all(isinstance(a, _ATOMS) for a in args) and all(isinstance(v, _ATOMS) for v in kwargs.values()):
        # The usual call (tensors and plain values): no pytree round trip.
        cut_args = tuple(_cut(a, aliases, leaf_map) for a in args)
        cut_kwargs = {k: _cut(v, aliases, leaf_map) for k, v in kwargs.items()} if kwargs else kwargs
        if not aliases:
            return args, kwargs
        return cut_args, cut_kwargs
    flat, spec = _pytree.tree_flatten((args, kwargs))
    cut = [_cut(a, aliases, leaf_map) for a in flat]
    if not aliases:
        return args, kwargs
    new_args, new_kwargs = _pytree.tree_unflatten(cut, spec)
    return new_args, new_kwargs


def _call_in_transform(
    scope: fp32_precision_scope,
    owner: fp32_precision_scope,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    # Inside torch.func.grad / vmap / jacrev: a custom autograd.Function would need a
    # functorch rule of its own; the transform differentiates the call as it is.
    _warn_not_scoped(owner)
    with scope:
        return fn(*args, **kwargs)


def _is_leaf_cast(node: Any) -> bool:
    # A dtype cast of leaves made before the call: autocast's cached cast of a parameter,
    # which every call in one autocast region shares (the first call made it).
    return type(node).__name__ == "ToCopyBackward0" and all(
        nxt is None or nxt._sequence_nr() == _LEAF_SEQ for nxt, _ in node.next_functions
    )


def _hands_back(node: Any) -> bool:
    # A Python node that reads no .grad: a scoped node inside that hands its leaves'
    # gradients back itself, or its gate (torch < 2.5).
    cls = node._forward_cls
    return (cls is Fp32ScopedCall and bool(node.state.direct)) or cls is Fp32ScopedCallGate


def _subgraph_leaves(roots: list[Any], start: int) -> tuple[dict[int, tuple[torch.Tensor, Any]], _Walk]:
    """The leaves where the call's subgraph ends, each with its AccumulateGrad node.

    The subgraph is every node reachable from ``roots`` down to leaves. After the cut of
    its arguments the call's own nodes (sequence number ``start`` or later) lead to leaves
    only; where one leads to a node from before the call instead (a tensor the call reached
    other than through its arguments), the subgraph takes in that tensor's history too,
    down to its leaves. The second value says what the walk found (:class:`_Walk`).
    """
    seen: set[Any] = set()
    stack = list(roots)
    leaves: dict[int, tuple[torch.Tensor, Any]] = {}
    walk = _Walk()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if walk.direct and isinstance(node, _PythonNode) and not _hands_back(node):
            walk.direct = False
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            seq = nxt._sequence_nr()
            if seq == _LEAF_SEQ:
                variable = nxt.variable
                if id(variable) not in leaves:
                    leaves[id(variable)] = (variable, nxt)
                continue
            if seq < start:
                walk.extended = True
                if walk.outside is None and not _is_leaf_cast(nxt):
                    walk.outside = f"a non-leaf tensor made by {type(nxt).__name__}"
            stack.append(nxt)
    return leaves, walk


class _Walk:
    """What :func:`_subgraph_leaves` found besides the leaves."""

    __slots__ = ("direct", "extended", "outside")

    def __init__(self) -> None:
        # Whether every node is one of torch's own (C++) nodes, or a boundary that hands
        # its leaves' gradients back itself.
        self.direct = True
        # Whether the subgraph takes in nodes from before the call (the caller's graph may
        # run them too: the nested engine must not free them).
        self.extended = False
        # What the first of those is, unless each is a cast of leaves (autocast's cache,
        # shared by the calls of one autocast region: nothing to warn about).
        self.outside: str | None = None


def call_recorded(  # noqa: C901, PLR0912, PLR0913, PLR0915  (one flat pass: runs on every call in grad mode)
    scope: fp32_precision_scope,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    start: int | None = None,
    leaf_map: dict[int, torch.Tensor] | None = None,
    shared: bool = False,
    owner: fp32_precision_scope | None = None,
) -> Any:
    """Call ``fn(*args, **kwargs)`` in ``scope``; make its backward run in the scope too.

    Called only with grad mode on. ``start`` (for a recorded backward) widens what counts
    as the call's own subgraph to everything since that sequence number; ``leaf_map``
    (likewise) maps the leaves of that subgraph that stand for the caller's tensors, and
    ``shared`` says that subgraph is also another boundary's; ``owner`` is the wrapper's
    own recording scope where ``scope`` is not (a recorded backward's).
    """
    if owner is None:
        owner = scope
    if _functorch_level() is not None:
        return _call_in_transform(scope, owner, fn, args, kwargs)
    leaf_map = {} if leaf_map is None else dict(leaf_map)
    if kwargs or len(args) != 1 or type(args[0]) is not _Tensor:
        if args or kwargs:
            args, kwargs = _cut_arguments(args, kwargs, leaf_map)
    elif args[0].grad_fn is not None and args[0].requires_grad:  # the usual call: one tensor
        args = (_cut(args[0], {}, leaf_map),)
    if start is None:
        start = _sequence_nr()
    try:  # (not a helper function: this runs on every call in grad mode)
        with scope:
            result = fn(*args, **kwargs)
    except RuntimeError as e:
        if leaf_map and _IN_PLACE_ON_LEAF in str(e):
            raise Fp32ScopeError(_IN_PLACE_MSG.format(name=scope._name)) from e
        raise
    # The common results first: a tensor, or nothing that can hold one.
    single = isinstance(result, _Tensor)
    if single:
        if not result.requires_grad:
            return result
        flat: list[Any] = [result]
        out_spec = None
    elif result is None or isinstance(result, _ATOMS):
        return result
    else:
        flat, out_spec = _pytree.tree_flatten(result)
    positions: list[int] = []
    inner_outputs: list[torch.Tensor] = []
    roots: list[Any] = []
    returned_argument = False
    for i, value in enumerate(flat):
        if not isinstance(value, _Tensor) or not value.requires_grad:
            continue
        node = value.grad_fn
        if node is None:
            original = leaf_map.get(id(value))
            if original is not None:  # an argument returned as it was: the caller's tensor
                flat[i] = original
                returned_argument = True
        elif node._sequence_nr() >= start:  # else made before the call: not its history
            positions.append(i)
            inner_outputs.append(value)
            roots.append(node)
    if roots:
        leaves, walk = _subgraph_leaves(roots, start)
        if walk.outside is not None:
            _warn_extended(owner, walk.outside)
        # Only the aliases the subgraph reaches: inner_inputs keeps them alive, so no id in
        # the map can be reused by another tensor.
        state = _State(scope, owner, start, {})
        state.shared = shared
        state.extended = walk.extended
        state.direct = walk.direct and walk.outside is None
        state.inner_outputs = inner_outputs
        inner_inputs = state.inner_inputs
        leaf_nodes = state.leaf_nodes
        state_map = state.leaf_map
        outer_inputs: list[torch.Tensor] = []
        for key, (leaf, node) in leaves.items():
            inner_inputs.append(leaf)
            original = leaf_map.get(key)
            if original is None:
                leaf_nodes.append(node)
                outer_inputs.append(leaf)
            else:
                leaf_nodes.append(None)
                state_map[key] = original
                outer_inputs.append(original)
        if any(map(_functorch_wrapped, outer_inputs)):  # pragma: no cover  (a tensor escaped a transform)
            wrapped = Fp32ScopedCall.apply(state, *outer_inputs)  # type: ignore[no-untyped-call]
        else:
            wrapped = _apply_boundary(state, *outer_inputs)
        if _keep_graph is None:  # pragma: no cover  (torch < 2.5)
            sentinel = _empty(0)
            wrapped = Fp32ScopedCallGate.apply(sentinel, *wrapped)  # type: ignore[no-untyped-call]
            if sentinel._use_count() > 1:  # type: ignore[attr-defined]  # held by the gate, not by a hook
                state.sentinel = weakref.ref(sentinel)
        for i, w in zip(positions, wrapped, strict=True):
            flat[i] = w
    elif not returned_argument:
        return result
    if single:
        return flat[0]
    return _pytree.tree_unflatten(flat, out_spec)  # type: ignore[arg-type]


# Frames only (a compiled parent that calls a wrapper graph-breaks at the wrapper already):
# all of this runs between the parent's graphs, as plain Python.
dynamo_exclude.exclude(
    *(fn for fn in list(globals().values()) if isinstance(fn, FunctionType) and fn.__module__ == __name__),
    Fp32ScopedCall.forward,
    Fp32ScopedCall.backward,
    Fp32ScopedCallGate.forward,
    Fp32ScopedCallGate.backward,
    _State.scope,
    graph_break=False,
)
