"""The eager region: the ``fp32scope::region`` ops, which run a scoped node whole in its scope.

The ops (``region``, ``region_grad``, ``region_train``, ``region_backward``), their kernels
and fake kernels, and ``region_grad``'s autograd formula (``_RegionFunction``); one call of
an op (``_Op``); the node's run with the op's parameters and buffers bound, autograd back
on where its graph is kept (``_AboveAutograd``); the copies the node updates in place
(buffers, a carried cache's tensors) and how the run on fake tensors finds which those are
(``_WriteRecorder``); the tensors that leave the op; the check that the node reaches no
tensor needing a gradient but the op's inputs; and the kept forward graphs awaiting their
backward (``_saved``).
"""

from __future__ import annotations

import contextlib
import itertools
import types
import weakref
from collections.abc import Callable
from typing import Any, Final, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp32scope._compat import COMPILER_STATE, COMPILING_FLAG
from fp32scope._errors import Fp32ScopeError
from fp32scope._flags import dynamo_exclude
from fp32scope._wrappers import carriers
from fp32scope._wrappers.region.boundary import _bind, _call_node, _flatten_out, _unalias, _unbind
from fp32scope._wrappers.region.refusals import _outside_tensor_message
from fp32scope._wrappers.region.regions import Region, _CarriedPlan, _numbers, _regions

_lib = torch.library.Library("fp32scope", "FRAGMENT")  # type: ignore[no-untyped-call]  # torch's untyped API

_UNKNOWN: Final = -1  # "which buffers it updates is not known yet": the fake run finds out

# Kept forward graphs awaiting their backward, by token number. No lock: each use is one
# dict operation (atomic), and a token's finalizer, which pops its entry, may run inside any
# allocation, also one made while a lock held here would be held (a deadlock).
_saved: dict[int, _Saved] = {}


class _Saved:
    """A region's forward graph, kept for its backward."""

    __slots__ = ("inputs", "outputs", "positions")

    def __init__(self, outputs: list[torch.Tensor], positions: list[int], inputs: list[torch.Tensor]) -> None:
        self.outputs = outputs  # the node's outputs that have autograd history
        self.positions = positions  # their places among all its tensor outputs
        self.inputs = inputs  # the aliases of the op's inputs that need a gradient


class _Op:
    """One call of a region op.

    ``spec`` is [site, layout, n_tensors, n_params, n_autocast, n_ints, backend, autocast..., ints...,
    mutated...]; ``site`` numbers the traced call (its carried objects' plan is the region's
    plan of that number); ``backend`` numbers the parent's backend that compiles the node in
    the op (0: none).
    """

    __slots__ = (
        "autocast",
        "backend",
        "buffers",
        "carried",
        "ints",
        "layout",
        "mutated",
        "params",
        "region",
        "site",
        "tensors",
    )

    def __init__(self, key: int, spec: list[int], values: list[torch.Tensor]) -> None:
        self.region = _regions[key]
        self.site = spec[0]
        self.layout, n_tensors, n_params, n_autocast, n_ints, self.backend = spec[1:7]
        self.autocast = spec[7 : 7 + n_autocast]
        self.ints = spec[7 + n_autocast : 7 + n_autocast + n_ints]
        self.mutated = spec[7 + n_autocast + n_ints :]
        n_inputs = n_tensors + n_params
        self.tensors = values[:n_tensors]
        self.params = values[n_tensors:n_inputs]
        self.buffers = values[n_inputs:]
        self.carried: list[tuple[Any, Any]] = []  # (marker, rebuilt object), as _run built them


def _below_autograd_keys() -> tuple[Any, ...]:
    # The dispatch keys an op's kernel runs with excluded when it was reached below the
    # Autograd key (an autograd formula's forward, an eager call): autograd's own and
    # ADInplaceOrView, which gives views their base and bumps version counters (without it
    # an in-place update inside the node goes unseen: by autograd, and by the fake run that
    # finds the buffers a node updates).
    outside = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._AutoDispatchBelowADInplaceOrView():
        inside = torch._C._dispatch_tls_local_exclude_set()
    return tuple(k for k in torch._C.DispatchKey.__members__.values() if inside.has(k) and not outside.has(k))


_BELOW_AUTOGRAD: Final = _below_autograd_keys()


class _AboveAutograd:
    """Autograd back on inside an op's kernel, so that the node's forward records its graph."""

    __slots__ = ("guard",)

    def __enter__(self) -> None:
        exclude = torch._C._dispatch_tls_local_exclude_set()
        self.guard: Any = None
        if _BELOW_AUTOGRAD and exclude.has(_BELOW_AUTOGRAD[0]):
            for key in _BELOW_AUTOGRAD:
                exclude = exclude.remove(key)
            self.guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
            self.guard.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.guard is not None:
            self.guard.__exit__(None, None, None)


def _aliases(op: _Op, grad_mask: int) -> list[torch.Tensor]:
    """Swap the op's inputs for what the kept graph may hold; the ones that need a gradient.

    Every tensor argument becomes a copy: the kept graph holds what it saves until the
    backward, and the compiled graph around the op may reuse an argument's memory once the
    op has run (Inductor does; it may even recompute a saved argument in the backward
    rather than keep it), unseen by that graph. Parameters, which the compiled graph takes
    as inputs and never reuses, become detached aliases where they need a gradient.
    """
    aliases: list[torch.Tensor] = []
    n = len(op.tensors)
    op.tensors = [t.detach().clone().requires_grad_(bool(grad_mask >> i & 1)) for i, t in enumerate(op.tensors)]
    op.params = list(op.params)
    for i in range(n + len(op.params)):
        if grad_mask >> i & 1:
            if i >= n:
                op.params[i - n] = op.params[i - n].detach().requires_grad_()
            aliases.append(op.tensors[i] if i < n else op.params[i - n])
    return aliases


def _run(op: _Op, *, fake: bool, grad: bool) -> Any:
    """Run the node with the op's parameters and buffers bound; in its scope unless ``fake``."""
    region = op.region
    p_slots, b_slots = region.slots(len(op.params), len(op.buffers))
    args, kwargs = region.rebuild(op.layout, op.tensors, op.ints, op.carried)
    saved_p = _bind(p_slots, "_parameters", op.params)
    saved_b = None
    try:
        if b_slots:
            saved_b = _bind(b_slots, "_buffers", op.buffers)
        if fake:
            return _run_fake(op, args, kwargs, grad=grad)
        # The node compiled by its parent's backend (not Inductor's: see inner), in its scope.
        call = region.compiled_call(op.backend) if op.backend else None
        if grad:
            with _AboveAutograd(), torch.enable_grad(), region.scope:
                return _call_node(region, op.autocast, args, kwargs, call)
        with region.scope:  # no graph to record: the kernel runs as it was reached
            return _call_node(region, op.autocast, args, kwargs, call)
    finally:
        if saved_b is not None:
            _unbind(b_slots, "_buffers", saved_b)
        _unbind(p_slots, "_parameters", saved_p)


def _run_fake(op: _Op, args: list[Any], kwargs: dict[str, Any], *, grad: bool) -> Any:
    # The node runs on fake tensors as the op will run it for real: as an eager call, not a
    # traced one (torch.compiler's flag is up while Dynamo or AOTAutograd trace), so that
    # scoped nodes nested in it enter their scopes (on fake tensors) instead of refusing.
    compiling = COMPILER_STATE[COMPILING_FLAG]
    COMPILER_STATE[COMPILING_FLAG] = False
    try:
        if grad:
            with _AboveAutograd(), torch.enable_grad():
                return _call_node(op.region, op.autocast, args, kwargs)
        # Above ADInplaceOrView (no gradient is recorded): the buffers the node updates bump
        # their version counters, which is how _execute finds them.
        with _AboveAutograd(), torch.no_grad():
            return _call_node(op.region, op.autocast, args, kwargs)
    except AssertionError as error:
        # Fake tensor mode meeting a real tensor: one the node holds by closure or as a global.
        if "FakeTensor" in str(error):
            raise Fp32ScopeError(_outside_tensor_message(op.region.name, "")) from error
        raise
    finally:
        COMPILER_STATE[COMPILING_FLAG] = compiling


class _WriteRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's untyped base
    """Records the storages every op writes to (its schema's ``(a!)`` arguments).

    Version counters miss some writes (a batch norm's running statistics), and a fake
    run's ops are all seen here, so this is how the buffers a node updates are found.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's untyped base
        self.storages: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for argument, value in zip(func._schema.arguments, args, strict=False):
            self._note(argument, value)
        for argument in func._schema.arguments:
            if argument.name in kwargs:
                self._note(argument, kwargs[argument.name])
        return func(*args, **kwargs)

    def _note(self, argument: Any, value: Any) -> None:
        if argument.alias_info is None or not argument.alias_info.is_write:
            return
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor):
                self.storages.add(tensor.untyped_storage()._cdata)


def _execute(
    op: _Op, *, fake: bool, grad_mask: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], _Saved | None]:
    """Run the node once: its tensor outputs, its updated buffers and (training) its kept graph."""
    region = op.region
    find_mutated = op.mutated == [_UNKNOWN]
    mutated = list(range(len(op.buffers))) if find_mutated else op.mutated
    # The buffers it updates run on copies, which leave the op as outputs.
    if mutated:
        op.buffers = list(op.buffers)
        for i in mutated:
            op.buffers[i] = op.buffers[i].clone()
    versions = [op.buffers[i]._version for i in mutated]
    inputs = _aliases(op, grad_mask) if grad_mask else []
    given = op.tensors
    inplace = _copy_carried(op, fake=fake, copy=not grad_mask)
    carried_versions = [op.tensors[i]._version for i in inplace]
    # The recorder (a dispatch mode: every op of the node through Python) only finds what the
    # node writes; the fake run finds it, a real run reads the plan.
    recorder = _WriteRecorder() if find_mutated or (fake and inplace) else None
    with recorder or contextlib.nullcontext():
        result = _run(op, fake=fake, grad=bool(grad_mask))
    written = set() if recorder is None else recorder.storages
    outputs = _flatten_out(region, op.layout, result, [obj for _, obj in op.carried])
    carried = _carried_out(op, fake, inplace, carried_versions, written)
    if not fake and not grad_mask:
        # The carried tensors leave as outputs too: none may alias an input or another output.
        unaliased = _unalias([*outputs, *carried], itertools.chain(given, op.params, op.buffers))
        outputs, carried = unaliased[: len(outputs)], unaliased[len(outputs) :]
    if find_mutated:
        found = tuple(
            i
            for i, v in zip(mutated, versions, strict=True)
            if op.buffers[i]._version != v or op.buffers[i].untyped_storage()._cdata in written
        )
        region.mutated[region.training_layout()] = found
        mutated = list(found)
    updates = [op.buffers[i] for i in mutated]
    if carried:
        updates += [t.detach().clone() for t in carried] if grad_mask else carried
    if not grad_mask:
        return outputs, updates, None
    positions = [i for i, o in enumerate(outputs) if o.requires_grad]
    saved = _Saved([outputs[i] for i in positions], positions, inputs)
    if fake:
        return [o.detach() for o in outputs], updates, saved
    # The op hands out copies: the kept graph may hold an output itself (tanh's backward
    # reads its result), and the compiled graph may write into an op's output in place.
    # A copy also aliases no input, and is laid out as the fake kernel's copy is.
    return [o.detach().clone() for o in outputs], updates, saved


def _copy_carried(op: _Op, *, fake: bool, copy: bool) -> tuple[int, ...]:
    """The op's carried tensors the node may update in place; swapped for copies where ``copy``.

    All of them in a fake run (which finds the ones it updates), the layout's plan's in a
    real one. (Training's aliases are copies already.)

    Copies, not an op that declares the tensors it updates (``Tensor(a!)``, which Inductor
    hands over uncopied): with one declaring every tensor updated, Inductor on torch 2.13
    recomputed a Llama attention mask from a static cache's length after the op had updated
    it, and the logits of the next layers were wrong (AOTAutograd alone gave the right
    ones). A call compiled inside declares only the cache's keys and values, which
    transformers' models read only in their attentions (``inner.build``'s ``in_place``).
    """
    where = op.region.carried_args.get(op.layout)
    inplace = () if where is None else where.tensors if fake else op.region.plans[op.site].inplace
    if inplace and copy:
        op.tensors = list(op.tensors)
        for i in inplace:
            op.tensors[i] = op.tensors[i].clone()
    return inplace


def _carried_out(
    op: _Op, fake: bool, inplace: tuple[int, ...], versions: list[int], written: set[int]
) -> list[torch.Tensor]:
    """The carried objects' tensors leaving the op: those newly bound, then those updated in place.

    The fake run finds which they are (the traced call's plan); a real run reads them by the plan.
    """
    if not op.carried:
        return []
    region = op.region
    if fake:
        found: list[tuple[carriers.Change, ...]] = []
        rebound: list[torch.Tensor] = []
        for marker, obj in op.carried:
            changes, tensors = carriers.changes(marker, obj, len(rebound))
            found.append(changes)
            rebound += [t.clone() for t in tensors]  # laid out as the real run's unaliased outputs
        updated = tuple(
            i
            for i, v in zip(inplace, versions, strict=True)
            if op.tensors[i]._version != v or op.tensors[i].untyped_storage()._cdata in written
        )
        plan = _CarriedPlan(updated, tuple(found))
        known = region.plans.get(op.site)
        if known is not None and known.key != plan.key:
            # One traced call traced again (Dynamo's run, then AOTAutograd's) must hand back
            # the same tensors. (Its other changes may read otherwise, a step where the first
            # read a constant its guards since fixed: Dynamo's graph writes back the first's.)
            raise Fp32ScopeError(_plan_conflict_message(region.name))  # (AOTAutograd's: the backend's error wraps it)
        region.plans[op.site] = plan
        return [*rebound, *(op.tensors[i] for i in updated)]
    plan = region.plans[op.site]
    rebound = [
        t for (_, obj), changes in zip(op.carried, plan.changes, strict=True) for t in carriers.tensors_of(obj, changes)
    ]
    return [*rebound, *(op.tensors[i] for i in plan.inplace)]


def _plan_conflict_message(name: str) -> str:
    return (
        f"Scoped node {name!r} (an in-graph region) changed the objects it was given differently when one "
        "call of it was traced twice (by Dynamo, then by AOTAutograd): its forward decides what to change "
        "from Python state that changes while it is traced (a counter of its own, a global). Decide from its "
        "arguments or attributes that stay as they are, or wrap the node with in_graph=False."
    )


def _check_leaves(region: Region, saved: _Saved) -> list[bool]:
    """Refuse a node whose forward reaches tensors needing a gradient that are not its op's inputs.

    Returns, for each input that needs a gradient, whether the outputs reach it at all: one
    they do not gets no gradient (None), as in eager, not zeros.
    """
    mine = {id(t) for t in saved.inputs}
    reached = {id(o) for o in saved.outputs if o.grad_fn is None}  # an input handed back as it is
    seen: set[Any] = set()
    todo = [o.grad_fn for o in saved.outputs]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            if id(variable) not in mine:
                raise Fp32ScopeError(
                    _outside_tensor_message(region.name, f" that requires grad (shape {tuple(variable.shape)})")
                )
            reached.add(id(variable))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return [id(t) in reached for t in saved.inputs]


# -- the ops ------------------------------------------------------------------------------

# Two forward ops, picked when the graph is traced (Dynamo guards grad mode and which inputs
# require grad): "region" where no gradient is needed, with no autograd formula (so that
# its kernel is reached without a Python autograd kernel on the way), "region_grad" elsewhere.
# ``values`` are the call's tensors, then the node's parameters, then its buffers.
_lib.define("region(int key, SymInt[] spec, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]
_lib.define("region_grad(int key, SymInt[] spec, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]
_lib.define("region_train(int key, SymInt[] spec, int grad_mask, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]
_lib.define("region_backward(int key, Tensor token, Tensor[] grads, Tensor[] like) -> Tensor[]")  # type: ignore[no-untyped-call]


def _region_impl(key: int, spec: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs, updates, _ = _execute(_Op(key, spec, values), fake=False)
    return outputs + updates if updates else outputs


def _region_fake(key: int, spec: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs, updates, _ = _execute(_Op(key, spec, values), fake=True)
    return [o.clone() for o in outputs] + updates


def _forget(number: int) -> None:
    _saved.pop(number, None)


def _region_train_impl(key: int, spec: list[int], grad_mask: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs, updates, saved = _execute(_Op(key, spec, values), fake=False, grad_mask=grad_mask)
    number = next(_numbers)
    token = torch.full((1,), number, dtype=torch.int64)
    _saved[number] = cast("_Saved", saved)
    weakref.finalize(token, _forget, number)
    return [*outputs, *updates, token]


def _region_train_fake(key: int, spec: list[int], grad_mask: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
    op = _Op(key, spec, values)
    outputs, updates, saved = _execute(op, fake=True, grad_mask=grad_mask)
    op.region.reached[spec[0]] = _check_leaves(op.region, cast("_Saved", saved))
    return [*(o.clone() for o in outputs), *updates, torch.empty((1,), dtype=torch.int64)]


def _region_backward_impl(
    key: int, token: torch.Tensor, grads: list[torch.Tensor], like: list[torch.Tensor]
) -> list[torch.Tensor]:
    region = _regions[key]
    saved = _saved.get(int(token.item()))
    if saved is None:
        msg = (
            f"Trying to backward through scoped node {region.name!r} (an in-graph region) after its saved graph "
            "was freed (the compiled graph's backward already ran without retain_graph=True). Specify "
            "retain_graph=True if you need to backward through the graph a second time."
        )
        raise Fp32ScopeError(msg)
    found: tuple[torch.Tensor | None, ...] = (None,) * len(saved.inputs)
    if saved.outputs:
        # The kept graph lives as long as the token, which the compiled graph's backward
        # holds: freed with it (no retain_graph), kept for a second backward (retain_graph).
        with region.backward_scope:
            found = torch.autograd.grad(
                saved.outputs,
                saved.inputs,
                [grads[i] for i in saved.positions],
                allow_unused=True,
                retain_graph=True,
            )
    # A gradient may be a view of an incoming one (a view's backward is a view): unaliased,
    # as the forward's outputs are, or Inductor reuses the incoming gradient's memory under it.
    return _unalias(
        [g if g is not None else torch.zeros_like(x) for g, x in zip(found, like, strict=True)], [*grads, *like]
    )


def _region_backward_fake(
    _key: int, _token: torch.Tensor, _grads: list[torch.Tensor], like: list[torch.Tensor]
) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in like]


class _RegionFunction(torch.autograd.Function):
    """The autograd formula of ``fp32scope::region_grad``: forward keeps its graph, backward uses it."""

    @staticmethod
    def forward(ctx: Any, key: int, spec: list[int], *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        op = _Op(key, spec, list(values))
        region = op.region
        n_inputs = len(op.tensors) + len(op.params)
        needs = ctx.needs_input_grad[2 : 2 + n_inputs]
        grad_mask = sum(1 << i for i, need in enumerate(needs) if need)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = torch.ops.fp32scope.region_train(key, spec, grad_mask, list(values))
        n_updates = len(region.mutated[region.training_layout()]) if op.mutated == [_UNKNOWN] else len(op.mutated)
        plan = region.plans.get(op.site)
        n_updates += 0 if plan is None else plan.n_outputs
        n_out = len(out) - 1 - n_updates
        token = out[-1]
        ctx.mark_non_differentiable(token, *out[n_out:-1])
        ctx.save_for_backward(token, *(x for x, need in zip(values[:n_inputs], needs, strict=True) if need))
        ctx.key = key
        ctx.n_out = n_out
        ctx.needs = needs
        # Known once the fake kernel has run (this formula runs only while a graph is traced).
        ctx.reached = region.reached.get(spec[0])
        ctx.n_buffers = len(op.buffers)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        token, *like = ctx.saved_tensors
        outs = [g if g is not None else torch.zeros(()) for g in grads[: ctx.n_out]]
        found = iter(torch.ops.fp32scope.region_backward(ctx.key, token, outs, like))
        reached = iter(ctx.reached) if ctx.reached is not None else None
        # An input the node's outputs never reach gets None, as in eager (not zeros, which an
        # optimizer would step on).
        result: list[torch.Tensor | None] = []
        for need in ctx.needs:
            gradient = next(found) if need else None
            if need and reached is not None and not next(reached):
                gradient = None
            result.append(gradient)
        return (None, None, *result, *([None] * ctx.n_buffers))


def _region_autograd(key: int, spec: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
    n_inputs = spec[2] + spec[3]
    if torch.is_grad_enabled() and any(t.requires_grad for t in values[:n_inputs]):
        apply = cast("Callable[..., tuple[torch.Tensor, ...]]", _RegionFunction.apply)
        return list(apply(key, spec, *values)[:-1])  # without the token
    with torch._C._AutoDispatchBelowADInplaceOrView():
        below: list[torch.Tensor] = torch.ops.fp32scope.region_grad(key, spec, values)
        return below


for _name, _kernel, _key in (
    ("region", _region_impl, "CompositeExplicitAutograd"),
    ("region_grad", _region_impl, "CompositeExplicitAutograd"),
    ("region_grad", _region_autograd, "Autograd"),
    ("region_train", _region_train_impl, "CompositeExplicitAutograd"),
    ("region_backward", _region_backward_impl, "CompositeExplicitAutograd"),
):
    _lib.impl(_name, _kernel, _key)  # type: ignore[no-untyped-call]
for _name, _fake in (
    ("region", _region_fake),
    ("region_grad", _region_fake),
    ("region_train", _region_train_fake),
    ("region_backward", _region_backward_fake),
):
    torch.library.register_fake(f"fp32scope::{_name}", _fake, lib=_lib)


# Frames only: these run inside the op's kernels, at run time or while a graph is traced.
dynamo_exclude.exclude(
    *(fn for fn in list(globals().values()) if isinstance(fn, types.FunctionType) and fn.__module__ == __name__),
    *(
        fn
        for cls in (_Op, _AboveAutograd, _WriteRecorder)
        for fn in vars(cls).values()
        if isinstance(fn, types.FunctionType)
    ),
    _RegionFunction.forward,
    _RegionFunction.backward,
    graph_break=False,
)
