"""In-graph regions: a scoped node as one opaque op of a compiled parent's graph.

A flag change cannot be traced, so by default a compiled parent graph-breaks at a scoped
node. With ``in_graph=True`` Dynamo instead traces the node's call as one call of
:func:`region_call`, kept whole in the graph (``torch._dynamo.allow_in_graph``), which
AOTAutograd and Inductor see as one call of the custom op ``fp32scope::region`` (its
backward as ``fp32scope::region_backward``). The op runs the node's whole forward at run
time, inside the node's scope; the parent's graph runs around it at the process default,
with no graph break (``fullgraph=True`` compiles).

What crosses the op's boundary:

* the call's tensor arguments, the node's parameters and its buffers are the op's inputs,
  so that gradients flow to them through the graph and land in ``.grad`` as always;
  non-tensor arguments (``None``, numbers, strings) are constants of the graph, kept in a
  layout the op names by number;
* the node's outputs (a tensor, or a tuple or list of tensors, ``None`` and constants);
* each buffer the node updates in place (BatchNorm's running statistics) leaves the op as
  an output and is written back by the graph (``copy_``), so the op itself mutates nothing
  (an op with an autograd formula cannot declare mutated inputs); which buffers those are
  is found once per training/eval layout by running the node on fake tensors;
* the caller's autocast state when the graph was traced (compiled graphs hold no autocast
  state at run time): the op re-enters it around the node, or runs the node without it
  and with float32 arguments where the node's policy is ``autocast=False``.

Training: the op's autograd formula runs the node's forward with autograd on, over
detached aliases of the inputs that need a gradient, and keeps that graph (not a
recompute) for ``fp32scope::region_backward``, which runs autograd's engine over it
inside the scope and hands the gradients back to the compiled backward. The kept graph is
found through a token, a one-element int64 tensor saved for the backward; it is dropped
when the backward has run, or when the token dies (a forward whose backward never runs).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch
from torch.utils import _pytree

from fp32scope._compat import is_exporting
from fp32scope._errors import Fp32ScopeError
from fp32scope._flags import dynamo_exclude
from fp32scope._flags.precision import Fp32Precision
from fp32scope._flags.scope import fp32_precision_scope, wrapper_scope

__all__ = ["Region", "check_in_graph", "region_call", "traced_region"]

_LIB_NAME: Final = "fp32scope"
_lib = torch.library.Library(_LIB_NAME, "FRAGMENT")  # noqa: TID251  (the op's home)

# The autocast device types and dtypes a traced call can carry, by index.
_AUTOCAST_DEVICES: Final = ("cpu", "cuda", "xpu", "mps", "hpu")
_AUTOCAST_DTYPES: Final = (torch.float16, torch.bfloat16, torch.float32)

_numbers = itertools.count(1)
_regions: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()
# Kept forward graphs awaiting their backward, by token number.
_saved: dict[int, _Saved] = {}
_saved_lock = threading.Lock()

_UNKNOWN: Final = -1  # "mutated buffers not found yet": the fake run finds them


class _Saved:
    __slots__ = ("inputs", "positions", "outputs")

    def __init__(self, outputs: list[torch.Tensor], positions: list[int], inputs: list[torch.Tensor]) -> None:
        self.outputs = outputs  # the node's outputs that have autograd history
        self.positions = positions  # their places among all its tensor outputs
        self.inputs = inputs  # the aliases of the op's inputs that need a gradient


class _Layout:
    """How a call's arguments are rebuilt from the op's tensors: the graph's constants."""

    __slots__ = ("kw_names", "n_args", "slots")

    def __init__(self, n_args: int, kw_names: tuple[str, ...], slots: tuple[Any, ...]) -> None:
        self.n_args = n_args
        self.kw_names = kw_names
        # One entry per argument: _TENSOR (the next op tensor) or the constant itself.
        self.slots = slots


class _TensorSlot:
    __repr__ = lambda self: "<tensor>"  # noqa: E731


_TENSOR: Final = _TensorSlot()
_SINGLE: Final = (None, ())  # the output spec of a node that returns one plain tensor
_CONSTANTS: Final = (type(None), bool, int, float, str, torch.dtype, torch.device)


def check_in_graph(value: object) -> bool:
    """Return ``value`` if it is a bool, else raise naming the ``in_graph`` argument."""
    if type(value) is bool:
        return value
    msg = (
        "in_graph must be True (under torch.compile, the node is one region of its compiled parent's graph: no "
        "graph break, fullgraph=True works) or False (a graph break around the node, the default); "
        f"got {value!r} of type {type(value).__name__}."
    )
    raise TypeError(msg)


class Region:
    """What a scoped node's op needs at run time: the node, its scope, its layouts."""

    def __init__(self, module: Callable[..., Any], precision: Fp32Precision | None, name: str, autocast: bool | None):
        self.key = next(_numbers)
        self.module = module
        self.name = name
        self.autocast = autocast
        self.scope = wrapper_scope(precision, name)
        self.layouts: list[_Layout] = []
        self._layout_ids: dict[tuple[Any, ...], int] = {}
        # Output structure per layout (set by every run, fake or real).
        self.out_specs: dict[int, tuple[Any, tuple[Any, ...]]] = {}
        # Indices of the buffers the node updates, per training layout of its modules.
        self.mutated: dict[tuple[bool, ...], tuple[int, ...]] = {}
        self._slots: tuple[list[tuple[Any, str, int]], list[tuple[Any, str, int]]] | None = None
        self._counts: tuple[int, int] | None = None
        _regions[self.key] = self
        _allow_in_graph()

    # -- trace time ---------------------------------------------------------------------

    def layout_id(self, args: tuple[Any, ...], kw_names: tuple[str, ...], values: tuple[Any, ...]) -> int:
        slots = []
        for position, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                slots.append(_TENSOR)
            elif isinstance(value, _CONSTANTS):
                slots.append(value)
            else:
                where = f"argument {position}" if position < len(args) else f"keyword argument {kw_names[position - len(args)]!r}"
                msg = (
                    f"Scoped node {self.name!r} was called with {where} of type {type(value).__name__} ({value!r}) "
                    "inside a compiled graph with in_graph=True. An in-graph region takes tensors and constants "
                    "(None, bool, int, float, str, torch.dtype, torch.device) as arguments; pass the others as "
                    "tensors, or wrap the node with in_graph=False (a graph break around the node)."
                )
                raise Fp32ScopeError(msg)
        key = (len(args), kw_names, tuple((type(s), s) for s in slots))
        found = self._layout_ids.get(key)
        if found is None:
            found = self._layout_ids[key] = len(self.layouts)
            self.layouts.append(_Layout(len(args), kw_names, tuple(slots)))
        return found

    def counts(self) -> tuple[int, int]:
        module = self.module
        if not isinstance(module, torch.nn.Module):
            return (0, 0)
        return (len(list(module.parameters())), len(list(module.buffers())))

    def training_layout(self) -> tuple[bool, ...]:
        module = self.module
        if not isinstance(module, torch.nn.Module):
            return ()
        return tuple(m.training for m in module.modules())

    # -- run time -----------------------------------------------------------------------

    def slots(self, n_params: int, n_buffers: int) -> tuple[list[tuple[Any, str, int]], list[tuple[Any, str, int]]]:
        """Where each parameter and buffer lives, shared ones at every place, by index."""
        if self._slots is not None and self._counts == (n_params, n_buffers):
            return self._slots
        module = self.module
        assert isinstance(module, torch.nn.Module)
        params = {id(p): i for i, p in enumerate(module.parameters())}
        buffers = {id(b): i for i, b in enumerate(module.buffers())}
        p_slots: list[tuple[Any, str, int]] = []
        b_slots: list[tuple[Any, str, int]] = []
        for sub in module.modules():
            for attr, p in sub._parameters.items():
                if p is not None:
                    p_slots.append((sub, attr, params[id(p)]))
            for attr, b in sub._buffers.items():
                if b is not None:
                    b_slots.append((sub, attr, buffers[id(b)]))
        self._slots = (p_slots, b_slots)
        self._counts = (len(params), len(buffers))
        return self._slots

    def rebuild(self, layout: int, tensors: list[torch.Tensor]) -> tuple[list[Any], dict[str, Any]]:
        spec = self.layouts[layout]
        it = iter(tensors)
        values = [next(it) if s is _TENSOR else s for s in spec.slots]
        n = spec.n_args
        return values[:n], dict(zip(spec.kw_names, values[n:], strict=True))


def _autocast_state() -> list[int]:
    """The caller's autocast, as the op's constant: (device index, dtype index) pairs."""
    out: list[int] = []
    if not torch._C._is_any_autocast_enabled():
        return out
    for i, device in enumerate(_AUTOCAST_DEVICES):
        try:
            if torch.is_autocast_enabled(device):
                out += [i, _AUTOCAST_DTYPES.index(torch.get_autocast_dtype(device))]
        except (RuntimeError, ValueError):  # a device type this torch does not know
            continue
    return out


class _Run:
    """Runs a region's node: the caller's autocast back (or off), parameters and buffers bound."""

    def __init__(self, region: Region, autocast: list[int]) -> None:
        self.region = region
        self.autocast = autocast

    def __call__(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        region = self.region
        if not self.autocast:
            return region.module(*args, **kwargs)
        devices = [_AUTOCAST_DEVICES[i] for i in self.autocast[::2]]
        if region.autocast is False:
            # As the eager wrapper: floating tensors of those device types to float32, autocast off.
            def cast(v: Any) -> Any:
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.device.type in devices and v.dtype != torch.float64:
                    return v.float()
                return v

            args = [cast(a) for a in args]
            kwargs = {k: cast(v) for k, v in kwargs.items()}
            with _autocasts([(d, None, False) for d in devices]):
                return region.module(*args, **kwargs)
        dtypes = [_AUTOCAST_DTYPES[i] for i in self.autocast[1::2]]
        with _autocasts([(d, t, True) for d, t in zip(devices, dtypes, strict=True)]):
            return region.module(*args, **kwargs)


class _autocasts:  # noqa: N801
    def __init__(self, what: list[tuple[str, torch.dtype | None, bool]]) -> None:
        self.managers = [torch.autocast(d, dtype=t, enabled=e) for d, t, e in what]

    def __enter__(self) -> None:
        for m in self.managers:
            m.__enter__()

    def __exit__(self, *exc: object) -> None:
        for m in reversed(self.managers):
            m.__exit__(None, None, None)


def _below_autograd_keys() -> tuple[Any, ...]:
    # The dispatch keys a custom op's kernel runs with excluded when it was reached below the
    # Autograd key (an autograd formula's forward, an eager call): autograd's.
    outside = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._AutoDispatchBelowAutograd():
        inside = torch._C._dispatch_tls_local_exclude_set()
    return tuple(k for k in torch._C.DispatchKey.__members__.values() if inside.has(k) and not outside.has(k))


_BELOW_AUTOGRAD: Final = _below_autograd_keys()
_FIRST_BELOW: Final = _BELOW_AUTOGRAD[0]


class _AboveAutograd:
    """Autograd back on inside an op's kernel, as it is outside any op."""

    __slots__ = ("guard",)

    def __enter__(self) -> None:
        exclude = torch._C._dispatch_tls_local_exclude_set()
        if exclude.has(_FIRST_BELOW):
            for key in _BELOW_AUTOGRAD:
                exclude = exclude.remove(key)
            self.guard: Any = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
            self.guard.__enter__()
        else:
            self.guard = None

    def __exit__(self, *exc: object) -> None:
        if self.guard is not None:
            self.guard.__exit__(None, None, None)


def _bind(slots: list[tuple[Any, str, int]], kind: str, values: list[torch.Tensor]) -> list[Any]:
    saved = []
    for owner, attr, index in slots:
        store = getattr(owner, kind)
        saved.append(store[attr])
        store[attr] = values[index]
    return saved


def _unbind(slots: list[tuple[Any, str, int]], kind: str, saved: list[Any]) -> None:
    for (owner, attr, _), value in zip(slots, saved, strict=True):
        getattr(owner, kind)[attr] = value


def _flatten_out(region: Region, layout: int, out: Any) -> list[torch.Tensor]:
    if type(out) is torch.Tensor:  # the usual output: no structure to keep
        region.out_specs[layout] = _SINGLE
        return [out]
    flat, spec = _pytree.tree_flatten(out)
    tensors = []
    consts: list[Any] = []
    for value in flat:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            consts.append(_TENSOR)
        elif isinstance(value, _CONSTANTS):
            consts.append(value)
        else:
            msg = (
                f"Scoped node {region.name!r} returned a {type(value).__name__} inside its output in a compiled graph "
                "with in_graph=True. An in-graph region returns tensors, or tuples, lists and dicts of tensors and "
                "constants; wrap the node with in_graph=False (a graph break around the node)."
            )
            raise Fp32ScopeError(msg)
    region.out_specs[layout] = (spec, tuple(consts))
    return tensors


def _unalias(outputs: list[torch.Tensor], *inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    # An op's output must not alias its inputs (AOTAutograd and Inductor assume it): an
    # argument returned as it is, or a view of one, leaves as a copy.
    storages = None
    for i, o in enumerate(outputs):
        if o._is_view() or any(o is t for t in inputs[0]):
            if storages is None:
                storages = {t.untyped_storage().data_ptr() for group in inputs for t in group}
            if o.untyped_storage().data_ptr() in storages:
                outputs[i] = o.clone()
    return outputs


def _run_fake(region: Region, run: _Run, args: list[Any], kwargs: dict[str, Any], *, grad: bool) -> Any:
    try:
        if grad:
            with _AboveAutograd(), torch.enable_grad():
                return run(args, kwargs)
        with torch.no_grad():
            return run(args, kwargs)
    except AssertionError as error:
        # Fake tensor mode meeting a real tensor: one the node holds by closure or as a global.
        if "FakeTensor" in str(error):
            raise Fp32ScopeError(_outside_tensor_message(region, "")) from error
        raise


def _execute(
    region: Region,
    layout: int,
    autocast: list[int],
    mutated: list[int],
    tensors: list[torch.Tensor],
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    *,
    fake: bool,
    grad_mask: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor], _Saved | None]:
    """Run the node once; its tensor outputs, the updated buffers and (training) its kept graph."""
    if isinstance(region.module, torch.nn.Module):
        p_slots, b_slots = region.slots(len(params), len(buffers))
    else:
        p_slots, b_slots = [], []
    find_mutated = mutated == [_UNKNOWN]
    if find_mutated:
        mutated = list(range(len(buffers)))
    # Buffers the node updates run on copies, which leave the op as outputs.
    buffers = list(buffers)
    for i in mutated:
        buffers[i] = buffers[i].clone()
    versions = [buffers[i]._version for i in mutated] if find_mutated else None
    inputs: list[torch.Tensor] = []
    if grad_mask:
        tensors = list(tensors)
        params = list(params)
        n = len(tensors)
        for i in range(n + len(params)):
            if grad_mask >> i & 1:
                source = tensors if i < n else params
                j = i if i < n else i - n
                alias = source[j].detach().requires_grad_()
                source[j] = alias
                inputs.append(alias)
    args, kwargs = region.rebuild(layout, tensors)
    run = _Run(region, autocast)
    saved_p = _bind(p_slots, "_parameters", params)
    try:
        saved_b = _bind(b_slots, "_buffers", buffers)
        try:
            if fake:
                out = _run_fake(region, run, args, kwargs, grad=bool(grad_mask))
            elif grad_mask:
                with _AboveAutograd(), torch.enable_grad(), region.scope:
                    out = run(args, kwargs)
            else:  # no autograd to record: the op's kernel runs as it was reached
                with region.scope:
                    out = run(args, kwargs)
        finally:
            _unbind(b_slots, "_buffers", saved_b)
    finally:
        _unbind(p_slots, "_parameters", saved_p)
    outputs = _flatten_out(region, layout, out)
    if not fake:
        outputs = _unalias(outputs, tensors, params, buffers)
    if find_mutated:
        assert versions is not None
        found = tuple(i for i, v in zip(mutated, versions, strict=True) if buffers[i]._version != v)
        region.mutated[region.training_layout()] = found
        mutated = list(found)
    updates = [buffers[i] for i in mutated]
    saved = None
    if grad_mask:
        positions = [i for i, o in enumerate(outputs) if o.requires_grad]
        saved = _Saved([outputs[i] for i in positions], positions, inputs)
        outputs = [o.detach() if o.requires_grad else o for o in outputs]
    return outputs, updates, saved


# -- the ops ------------------------------------------------------------------------------

_lib.define(
    "region(int key, int layout, int[] autocast, int[] mutated, Tensor[] tensors, Tensor[] params, "
    "Tensor[] buffers) -> Tensor[]"
)
_lib.define(
    "region_grad(int key, int layout, int[] autocast, int[] mutated, Tensor[] tensors, Tensor[] params, "
    "Tensor[] buffers) -> Tensor[]"
)
_lib.define(
    "region_train(int key, int layout, int[] autocast, int[] mutated, int grad_mask, Tensor[] tensors, "
    "Tensor[] params, Tensor[] buffers) -> Tensor[]"
)
_lib.define("region_backward(int key, Tensor token, Tensor[] grads, Tensor[] like) -> Tensor[]")


def _region_impl(key: int, layout: int, autocast: list[int], mutated: list[int], tensors: list[torch.Tensor], params: list[torch.Tensor], buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs, updates, _ = _execute(_regions[key], layout, autocast, mutated, tensors, params, buffers, fake=False)
    return outputs + updates


def _region_fake(key: int, layout: int, autocast: list[int], mutated: list[int], tensors: list[torch.Tensor], params: list[torch.Tensor], buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs, updates, _ = _execute(_regions[key], layout, autocast, mutated, tensors, params, buffers, fake=True)
    return [o.clone() for o in outputs] + updates


def _forget(number: int) -> None:
    with _saved_lock:
        _saved.pop(number, None)


def _region_train_impl(key: int, layout: int, autocast: list[int], mutated: list[int], grad_mask: int, tensors: list[torch.Tensor], params: list[torch.Tensor], buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs, updates, saved = _execute(
        _regions[key], layout, autocast, mutated, tensors, params, buffers, fake=False, grad_mask=grad_mask
    )
    assert saved is not None
    number = next(_numbers)
    token = torch.full((1,), number, dtype=torch.int64)
    with _saved_lock:
        _saved[number] = saved
    weakref.finalize(token, _forget, number)
    return [*outputs, *updates, token]


def _region_train_fake(key: int, layout: int, autocast: list[int], mutated: list[int], grad_mask: int, tensors: list[torch.Tensor], params: list[torch.Tensor], buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    region = _regions[key]
    outputs, updates, saved = _execute(
        region, layout, autocast, mutated, tensors, params, buffers, fake=True, grad_mask=grad_mask
    )
    assert saved is not None
    _check_leaves(region, saved)
    return [*(o.clone() for o in outputs), *updates, torch.empty((1,), dtype=torch.int64)]


def _outside_tensor_message(region: Region, what: str) -> str:
    return (
        f"Scoped node {region.name!r} (in_graph=True) uses a tensor{what} which is neither one of its arguments "
        "nor a parameter or buffer of the node: an in-graph region cannot carry it (its gradient would be lost, "
        "the compiled graph would not see it change). Pass that tensor to the node as an argument, register it "
        "on the node's module, or wrap the node with in_graph=False."
    )


def _check_leaves(region: Region, saved: _Saved) -> None:
    """Refuse a node whose forward reaches tensors needing a gradient that are not its op's inputs."""
    mine = {id(t) for t in saved.inputs}
    seen: set[Any] = set()
    todo = [o.grad_fn for o in saved.outputs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in mine:
            raise Fp32ScopeError(_outside_tensor_message(region, f" that requires grad (shape {tuple(variable.shape)})"))
        todo.extend(next_node for next_node, _ in node.next_functions)


def _region_backward_impl(key: int, token: torch.Tensor, grads: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    region = _regions[key]
    number = int(token.item())
    with _saved_lock:
        saved = _saved.pop(number, None)
    if saved is None:
        msg = (
            f"Trying to backward through scoped node {region.name!r} (an in-graph region) a second time, or after "
            "its saved graph was freed. An in-graph region keeps its forward graph for one backward; call the "
            "model again before the next backward, or wrap the node with in_graph=False to use retain_graph=True."
        )
        raise Fp32ScopeError(msg)
    if saved.outputs:
        with region.scope:
            found = torch.autograd.grad(
                saved.outputs, saved.inputs, [grads[i] for i in saved.positions], allow_unused=True
            )
    else:
        found = (None,) * len(saved.inputs)
    return [g if g is not None else torch.zeros_like(x) for g, x in zip(found, like, strict=True)]


def _region_backward_fake(key: int, token: torch.Tensor, grads: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in like]


class _RegionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: tuple[Any, ...], n_tensors: int, n_params: int, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        key, layout, autocast, mutated = spec
        tensors = list(flat[:n_tensors])
        params = list(flat[n_tensors : n_tensors + n_params])
        buffers = list(flat[n_tensors + n_params :])
        needs = ctx.needs_input_grad[3 : 3 + n_tensors + n_params]
        grad_mask = sum(1 << i for i, need in enumerate(needs) if need)
        with torch._C._AutoDispatchBelowAutograd():
            out = torch.ops.fp32scope.region_train(key, layout, autocast, mutated, grad_mask, tensors, params, buffers)
        token = out[-1]
        n_updates = len(mutated) if mutated != [_UNKNOWN] else len(_regions[key].mutated[_regions[key].training_layout()])
        n_out = len(out) - 1 - n_updates
        ctx.mark_non_differentiable(token, *out[n_out:-1])
        like = [x for x, need in zip(flat[: n_tensors + n_params], needs, strict=True) if need]
        ctx.save_for_backward(token, *like)
        ctx.key = key
        ctx.n_out = n_out
        ctx.needs = needs
        ctx.n_buffers = len(buffers)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        token, *like = ctx.saved_tensors
        outs = [g if g is not None else torch.zeros(()) for g in grads[: ctx.n_out]]
        found = iter(torch.ops.fp32scope.region_backward(ctx.key, token, outs, like))
        result = [next(found) if need else None for need in ctx.needs]
        return (None, None, None, *result, *([None] * ctx.n_buffers))


def _region_autograd(key: int, layout: int, autocast: list[int], mutated: list[int], tensors: list[torch.Tensor], params: list[torch.Tensor], buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    if torch.is_grad_enabled() and any(t.requires_grad for t in itertools.chain(tensors, params)):
        out = _RegionFunction.apply((key, layout, autocast, mutated), len(tensors), len(params), *tensors, *params, *buffers)
        return list(out[:-1])  # without the token
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fp32scope.region_grad(key, layout, autocast, mutated, tensors, params, buffers)


# Two forward ops, picked when the graph is traced (Dynamo guards grad mode and which inputs
# require grad): "region" where no gradient is needed, with no autograd formula (so the
# kernel is reached without a Python autograd kernel on the way), "region_grad" elsewhere.
_lib.impl("region", _region_impl, "CompositeExplicitAutograd")
_lib.impl("region_grad", _region_impl, "CompositeExplicitAutograd")
_lib.impl("region_grad", _region_autograd, "Autograd")
_lib.impl("region_train", _region_train_impl, "CompositeExplicitAutograd")
_lib.impl("region_backward", _region_backward_impl, "CompositeExplicitAutograd")
torch.library.register_fake("fp32scope::region", _region_fake, lib=_lib)
torch.library.register_fake("fp32scope::region_grad", _region_fake, lib=_lib)
torch.library.register_fake("fp32scope::region_train", _region_train_fake, lib=_lib)
torch.library.register_fake("fp32scope::region_backward", _region_backward_fake, lib=_lib)


# -- the call Dynamo keeps whole ---------------------------------------------------------


def region_call(key: int, n_args: int, kw_names: tuple[str, ...], *values: Any) -> Any:
    """A scoped node's call, as traced: ``values`` are its arguments, parameters and buffers."""
    region = _regions[key]
    if is_exporting():
        msg = (
            f"torch.export cannot export scoped node {region.name!r} (in_graph=True): its region runs the node "
            "through this process's fp32scope, which a loading process does not have. Export the bare node "
            "(scoped.__wrapped__) and save or compile it with its precision: "
            "fp32scope.save_exported_program(exported_program, f, precision) or "
            "fp32scope.aoti_compile_and_package(exported_program, precision); or export the model with the node "
            "unscoped (fp32scope.unscope_modules(model))."
        )
        raise Fp32ScopeError(msg)
    n_params, n_buffers = region.counts()
    end = len(values) - n_params - n_buffers
    call_values = values[:end]
    params = list(values[end : end + n_params])
    buffers = list(values[end + n_params :])
    layout = region.layout_id(call_values[:n_args], kw_names, call_values)
    tensors = [v for v in call_values if isinstance(v, torch.Tensor)]
    autocast = _autocast_state()
    known = region.mutated.get(region.training_layout())
    mutated = [_UNKNOWN] if known is None else list(known)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in itertools.chain(tensors, params))
    op = torch.ops.fp32scope.region_grad if grad else torch.ops.fp32scope.region
    out = op(key, layout, autocast, mutated, tensors, params, buffers)
    found = region.mutated[region.training_layout()]
    n_out = len(out) - len(found)
    for i, update in zip(found, out[n_out:], strict=True):
        buffers[i].copy_(update)
    spec, consts = region.out_specs[layout]
    if spec is None:
        return out[0]
    it = iter(out[:n_out])
    flat = [next(it) if c is _TENSOR else c for c in consts]
    return _pytree.tree_unflatten(flat, spec)


def traced_region(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What Dynamo traces for an in-graph node's call: one :func:`region_call` in the graph."""
    module = region.module
    if isinstance(module, torch.nn.Module):
        params = tuple(module.parameters())
        buffers = tuple(module.buffers())
    else:
        params = buffers = ()
    return region_call(region.key, len(args), tuple(kwargs), *args, *kwargs.values(), *params, *buffers)


_allowed = [False]


def _allow_in_graph() -> None:
    # Importing Dynamo takes about a second: only once an in-graph node is made.
    if not _allowed[0]:
        torch._dynamo.allow_in_graph(region_call)
        _allowed[0] = True


dynamo_exclude.exclude(
    _execute,
    _unalias,
    _bind,
    _unbind,
    _flatten_out,
    _autocast_state,
    _region_impl,
    _region_fake,
    _region_train_impl,
    _region_train_fake,
    _region_backward_impl,
    _region_backward_fake,
    _region_autograd,
    _check_leaves,
    _run_fake,
    _forget,
    _RegionFunction.forward,
    _RegionFunction.backward,
    Region.slots,
    Region.rebuild,
    _Run.__call__,
    _AboveAutograd.__enter__,
    _AboveAutograd.__exit__,
    graph_break=False,
)
