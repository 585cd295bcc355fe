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
in the node's scope (:mod:`.inner`): no Python of the node runs, and its backward's tensors
are saved by the parent's graph. What follows describes the eager region, which every
other backend (``aot_eager``, a user's own), every ``eager=True`` node and every call the
compiled code cannot hold (see :mod:`.inner`) gets.

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
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import secrets
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final, cast

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fp32scope._compat import (
    COMPILER_STATE,
    COMPILING_FLAG,
    REGION_OPS_UPDATE_CACHES_IN_PLACE,
    dtensor_type,
    is_exporting,
    treespec_children,
)
from fp32scope._errors import Fp32RegionBreakWarning, Fp32ScopeError, user_stacklevel
from fp32scope._flags import dynamo_exclude
from fp32scope._flags.scope import EXPORTING_MSG, fp32_precision_scope, wrapper_scope
from fp32scope._wrappers import carriers, inner, layouts
from fp32scope._wrappers.autocast import AutocastPolicy, cast_to_float32, warn_once_under_autocast

__all__ = ["Region", "check_in_graph", "region_call", "traced_region", "warn_break"]

_lib = torch.library.Library("fp32scope", "FRAGMENT")  # type: ignore[no-untyped-call]  # torch's untyped API

# The autocast device types and dtypes a traced call can carry, by index.
_AUTOCAST_DEVICES: Final = ("cpu", "cuda", "xpu", "mps", "hpu")
_AUTOCAST_DTYPES: Final = (torch.float16, torch.bfloat16, torch.float32)
_CONSTANTS: Final = (type(None), bool, int, float, str, torch.dtype, torch.device)
_UNKNOWN: Final = -1  # "which buffers it updates is not known yet": the fake run finds out
_TAG: Final = "fp32scope region "

#: Whether a compiled-inside call updates a cache's keys and values where they are (where
#: torch allows it), read when a graph is traced. ``benchmarks/bench_decode.py`` turns it
#: off for one variant, to measure the copies it saves.
update_caches_in_place = REGION_OPS_UPDATE_CACHES_IN_PLACE

_numbers = itertools.count(1)
# A region's number is this process's: Inductor's and AOTAutograd's caches, on disk, serve a
# graph compiled by another process to a graph that reads the same, and a number that meant
# another node there would run this process's node of that number (wrong results, or
# another node's shapes). So every region number holds this process's own random high bits.
_PROCESS: Final = secrets.randbits(24) << 32
_sites = itertools.count(1)
_regions: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()
# Kept forward graphs awaiting their backward, by token number.
_saved: dict[int, _Saved] = {}
_saved_lock = threading.Lock()

Slots = list[tuple[torch.nn.Module, str, int]]


_TENSOR: Final = layouts.TENSOR
_SYMINT: Final = layouts.SYMINT


def check_in_graph(value: object) -> bool:
    """Return ``value`` if it is a bool, else raise naming the ``in_graph`` argument (callers resolve None)."""
    if type(value) is bool:
        return value
    msg = (
        "in_graph must be True (under torch.compile, the node is one region of its compiled parent's graph: no "
        "graph break, fullgraph=True works), False (a graph break around the node) or None (the default: "
        "True); "
        f"got {value!r} of type {type(value).__name__}."
    )
    raise TypeError(msg)


class _Saved:
    """A region's forward graph, kept for its backward."""

    __slots__ = ("inputs", "outputs", "positions")

    def __init__(self, outputs: list[torch.Tensor], positions: list[int], inputs: list[torch.Tensor]) -> None:
        self.outputs = outputs  # the node's outputs that have autograd history
        self.positions = positions  # their places among all its tensor outputs
        self.inputs = inputs  # the aliases of the op's inputs that need a gradient


class _Layout:
    """How a call's arguments are rebuilt from the op's tensors: the graph's constants."""

    __slots__ = ("build", "kw_names", "n_args", "plain")

    def __init__(self, n_args: int, kw_names: tuple[str, ...], slots: tuple[Any, ...], spec: Any) -> None:
        self.n_args = n_args
        self.kw_names = kw_names
        # ``slots``: per leaf of the arguments (flattened as torch's pytree does: tuples,
        # lists, dicts, named tuples, dataclasses registered with it), _TENSOR (the op's next
        # tensor), _SYMINT (its next int) or the constant; ``spec``: the arguments'
        # structure, None where each argument is one leaf.
        self.plain = not kw_names and spec is None and all(s is _TENSOR for s in slots)
        self.build = layouts.builder(slots, spec)


class _CarriedArgs:
    """Where a layout's carried objects are: their argument positions, their tensors' indices.

    ``storage``: the indices of the tensors that are a cache's keys and values
    (:func:`carriers.storage`).
    """

    __slots__ = ("positions", "storage", "tensors")

    def __init__(self, positions: tuple[int, ...], tensors: tuple[int, ...], storage: tuple[int, ...]) -> None:
        self.positions = positions
        self.tensors = tensors
        self.storage = storage


def _carried_args(values: tuple[Any, ...]) -> _CarriedArgs:
    positions: list[int] = []
    indices: list[int] = []
    storage: list[int] = []
    n = 0
    for position, value in enumerate(values):
        count = sum(isinstance(leaf, torch.Tensor) for leaf in _pytree.tree_flatten(value)[0])
        if carriers.is_marker(value):
            positions.append(position)
            indices.extend(range(n, n + count))
            storage.extend(n + i for i, is_storage in enumerate(carriers.storage(value)) if is_storage)
        n += count
    return _CarriedArgs(tuple(positions), tuple(indices), tuple(storage))


class _CarriedPlan:
    """What a node does to the objects it carries, per layout, as its fake run found.

    ``inplace``: the op's tensors it updates in place (run on copies, which leave the op and
    are written back with ``copy_``); ``changes``: per carried object, its changed attributes
    (:func:`carriers.changes`), whose new tensors leave the op first (``n_rebound`` of them).
    """

    __slots__ = ("changes", "inplace", "n_rebound")

    def __init__(self, inplace: tuple[int, ...], changes: tuple[tuple[carriers.Change, ...], ...]) -> None:
        self.inplace = inplace
        self.changes = changes
        self.n_rebound = sum(1 for found in changes for change in found if change[2])

    @property
    def n_outputs(self) -> int:
        """How many of the op's outputs are the carried objects' tensors (after its buffers)."""
        return self.n_rebound + len(self.inplace)


def _forward_of(module: Any) -> Callable[..., Any]:
    def call_forward(*args: Any, **kwargs: Any) -> Any:
        return module.forward(*args, **kwargs)

    return call_forward


class Region:
    """What a scoped node's op needs at run time: the node, its scope, its layouts."""

    def __init__(
        self,
        module: Callable[..., Any],
        policy: AutocastPolicy,
        precision_scope_name: str,
        *,
        forward: bool = False,
        compiled: bool = True,
    ) -> None:
        self.key = _PROCESS | next(_numbers)
        # What a compiled graph holds: a string, since Dynamo may turn an int that differs
        # between two compiles of one frame (two models of one class) into a symbol.
        self.tag = f"{_TAG}{self.key}"
        self.module = module
        # What the op calls: the module (its hooks too), or, for a parent's ``child.forward(x)``,
        # its ``forward`` as found at each call (an assigned one included), without hooks.
        self.call: Callable[..., Any] = _forward_of(module) if forward else module
        self.policy = policy
        self.name = precision_scope_name
        self.scope: fp32_precision_scope = wrapper_scope(policy.precision, precision_scope_name)
        # The node's backward runs in the same precision; trace() and profiler ranges call it backward.
        self.backward_scope = wrapper_scope(policy.precision, precision_scope_name, "backward")
        self.layouts: dict[int, _Layout] = {}
        self._layout_ids: dict[tuple[Any, ...], int] = {}
        # Output structure per layout: (pytree spec or None for one plain tensor, leaves).
        self.out_specs: dict[int, tuple[Any, tuple[Any, ...]]] = {}
        # The buffers the node updates in place, by index, per training layout of its modules.
        self.mutated: dict[tuple[bool, ...], tuple[int, ...]] = {}
        self._slots: tuple[Slots, Slots] | None = None
        self._counts: tuple[int, int] | None = None
        # The wrapper's own call, for a call the region cannot carry (a graph break instead).
        self.fallback: Callable[..., Any] = module
        self.warned_break = False
        # Per traced call (its number): which inputs needing a gradient the outputs reach.
        self.reached: dict[int, list[bool]] = {}
        # Per layout with carried objects (caches): where they are, and what the node does to them.
        self.carried_args: dict[int, _CarriedArgs] = {}
        self.carried: dict[int, _CarriedPlan] = {}
        self.last_changes: tuple[tuple[carriers.Change, ...], ...] = ()
        # How traced_region rebuilds the last traced call's structured output (see _recipe).
        self.last_recipe: Recipe | None = None
        # Per structured output layout: the output's (spec, leaves) last traced, and its
        # recipe, whose builders are set as the attribute the recipe names (see _recipe).
        self.out_recipes: dict[int, tuple[tuple[Any, tuple[Any, ...]], Recipe]] = {}
        # Whether a parent compiled by Inductor compiles the node inside its op (not an eager
        # node's), and the compiled graphs per layout, or None where a layout cannot be.
        self.compiled = compiled
        self.inner: dict[tuple[Any, ...], inner.Entry | None] = {}
        _regions[self.key] = self
        _allow_in_graph()

    # -- trace time ---------------------------------------------------------------------

    def layout_id(self, n_args: int, kw_names: tuple[str, ...], values: tuple[Any, ...]) -> tuple[int, list[Any]]:
        """The number of the layout of a call's arguments (tensors, and constants by value), and their leaves."""
        if all(isinstance(v, torch.Tensor) for v in values):  # the usual call: no structure to keep
            leaves: list[Any] = list(values)
            spec = None
        else:
            leaves, tree = _pytree.tree_flatten(list(values))
            flat = len(leaves) == len(values) and all(v is leaf for v, leaf in zip(values, leaves, strict=True))
            spec = None if flat else tree
        slots: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                slots.append(_TENSOR)
            elif isinstance(leaf, _CONSTANTS):
                slots.append(leaf)
            elif isinstance(leaf, torch.SymInt):  # an int that varies between calls: an op input
                slots.append(_SYMINT)
            else:
                self._refuse_argument(n_args, kw_names, values, leaf)
        key = (n_args, kw_names, None if spec is None else str(spec), tuple((type(s), s) for s in slots))
        found = self._layout_ids.get(key)
        if found is None:
            # Numbered by its content, not by its order: the number is all a compiled graph
            # holds of it, and a graph that reads the same is served from Inductor's caches
            # (a cache's length, which sets the shape of the tensors the op returns, is one
            # of these constants).
            found = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=7).digest(), "big")
            while found in self.layouts:  # (a collision, in 2**56)
                found = (found + 1) % 2**56
            self._layout_ids[key] = found
            self.layouts[found] = _Layout(n_args, kw_names, tuple(slots), spec)
            if any(carriers.is_marker(v) for v in values):
                self.carried_args[found] = _carried_args(values)
        return found, leaves

    def _refuse_argument(self, n_args: int, kw_names: tuple[str, ...], values: tuple[Any, ...], leaf: object) -> None:
        position = next(i for i, value in enumerate(values) if any(x is leaf for x in _pytree.tree_flatten(value)[0]))
        where = f"argument {position}" if position < n_args else f"keyword argument {kw_names[position - n_args]!r}"
        container = values[position]
        # (Dynamo hands lists in as FX's immutable_list, dicts as immutable_dict.)
        kind = next((k.__name__ for k in (list, tuple, dict) if isinstance(container, k)), type(container).__name__)
        inside = "" if container is leaf else f" (inside a {kind})"
        msg = (
            f"Scoped node {self.name!r} was called with {where} of type {type(leaf).__name__}{inside} ({leaf!r}) "
            "inside a compiled graph with in_graph=True. An in-graph region takes tensors, ints and constants "
            "(None, bool, int, float, str, torch.dtype, torch.device), also in tuples, lists and dicts, as "
            "arguments; pass the others as tensors, or wrap the node with in_graph=False (a graph break around "
            "the node)."
        )
        if isinstance(leaf, torch.SymFloat):
            msg += (
                " A float that varies between calls is symbolic under torch.compile: pass it as a tensor, "
                "or set torch._dynamo.config.specialize_float = True (a graph per value)."
            )
        raise Fp32ScopeError(msg)

    def counts(self) -> tuple[int, int]:
        """How many parameters and buffers the node has (shared ones once)."""
        module = self.module
        if not isinstance(module, torch.nn.Module):
            return (0, 0)
        return (len(list(module.parameters())), len(list(module.buffers())))

    def training_layout(self) -> tuple[bool, ...]:
        """The training flag of each of the node's modules: what decides which buffers change."""
        module = self.module
        if not isinstance(module, torch.nn.Module):
            return ()
        return tuple(m.training for m in module.modules())

    # -- run time -----------------------------------------------------------------------

    def slots(self, n_params: int, n_buffers: int) -> tuple[Slots, Slots]:
        """Where each parameter and buffer lives (shared ones at every place), with its index."""
        if self._slots is not None and self._counts == (n_params, n_buffers):
            return self._slots
        module = self.module
        if not isinstance(module, torch.nn.Module):
            return [], []
        params = {id(p): i for i, p in enumerate(module.parameters())}
        buffers = {id(b): i for i, b in enumerate(module.buffers())}
        p_slots: Slots = []
        b_slots: Slots = []
        for sub in module.modules():
            p_slots += [(sub, attr, params[id(p)]) for attr, p in sub._parameters.items() if p is not None]
            b_slots += [(sub, attr, buffers[id(b)]) for attr, b in sub._buffers.items() if b is not None]
        self._slots = (p_slots, b_slots)
        self._counts = (len(params), len(buffers))
        return self._slots

    def rebuild(
        self, layout: int, tensors: list[torch.Tensor], ints: list[int], carried: list[tuple[Any, Any]] | None = None
    ) -> tuple[list[Any], dict[str, Any]]:
        """A call's positional and keyword arguments from its layout and the op's tensors and ints.

        A carried object (a cache) is built afresh around the op's tensors; each is appended
        to ``carried`` with the marker it was built from.
        """
        spec = self.layouts[layout]
        if spec.plain:  # only positional tensors: the usual call
            return tensors, {}
        values = spec.build(tensors, ints)
        where = self.carried_args.get(layout)
        if where is not None:
            for position in where.positions:
                marker = cast("tuple[Any, ...]", values[position])
                values[position] = carriers.rebuild(marker)
                if carried is not None:
                    carried.append((marker, values[position]))
        n = spec.n_args
        return values[:n], dict(zip(spec.kw_names, values[n:], strict=True))


class _Op:
    """One call of a region op.

    ``spec`` is [site, layout, n_tensors, n_params, n_autocast, n_ints, autocast..., ints..., mutated...].
    """

    __slots__ = ("autocast", "buffers", "carried", "ints", "layout", "mutated", "params", "region", "tensors")

    def __init__(self, key: int, spec: list[int], values: list[torch.Tensor]) -> None:
        self.region = _regions[key]
        self.layout, n_tensors, n_params, n_autocast, n_ints = spec[1:6]
        self.autocast = spec[6 : 6 + n_autocast]
        self.ints = spec[6 + n_autocast : 6 + n_autocast + n_ints]
        self.mutated = spec[6 + n_autocast + n_ints :]
        n_inputs = n_tensors + n_params
        self.tensors = values[:n_tensors]
        self.params = values[n_tensors:n_inputs]
        self.buffers = values[n_inputs:]
        self.carried: list[tuple[Any, Any]] = []  # (marker, rebuilt object), as _run built them


def _autocast_state() -> list[int]:
    """The caller's autocast, as the op's constant: (device index, dtype index) pairs."""
    out: list[int] = []
    if not torch._C._is_any_autocast_enabled():
        return out
    for i, device in enumerate(_AUTOCAST_DEVICES):
        try:
            enabled = torch.is_autocast_enabled(device)
        except RuntimeError:  # a device type this torch's autocast does not know
            continue
        if enabled:
            out += [i, _AUTOCAST_DTYPES.index(torch.get_autocast_dtype(device))]
    return out


def _call_node(region: Region, autocast: list[int], args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Call the node, under the caller's autocast as traced, or without it (``autocast=False``)."""
    if not autocast:
        return region.call(*args, **kwargs)
    devices = tuple(_AUTOCAST_DEVICES[i] for i in autocast[::2])
    with contextlib.ExitStack() as stack:
        if region.policy.mode is False:
            for device in devices:
                stack.enter_context(torch.autocast(device, enabled=False))
            return region.call(*cast_to_float32(args, devices), **cast_to_float32(kwargs, devices))
        for device, dtype in zip(devices, autocast[1::2], strict=True):
            stack.enter_context(torch.autocast(device, dtype=_AUTOCAST_DTYPES[dtype]))
        return region.call(*args, **kwargs)


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


def _bind(slots: Slots, kind: str, values: list[torch.Tensor]) -> list[Any]:
    saved = []
    for owner, attr, index in slots:
        store = getattr(owner, kind)
        saved.append(store[attr])
        store[attr] = values[index]
    return saved


def _unbind(slots: Slots, kind: str, saved: list[Any]) -> None:
    for (owner, attr, _), value in zip(slots, saved, strict=True):
        getattr(owner, kind)[attr] = value


class _Given:
    """An output leaf that is the ``index``-th object the region carried in (a cache a node returns)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Given) and other.index == self.index

    def __hash__(self) -> int:
        return hash((_Given, self.index))


def _flatten_out(region: Region, layout: int, out: Any, given: Sequence[Any] = ()) -> list[torch.Tensor]:
    """The node's output tensors; its structure and constants kept as the layout's ``out_specs``.

    ``given``: the objects the node was called with that the region carried (rebuilt around
    the op's tensors). One returned (``past_key_values`` in a model's output) leaves as a
    mark: the parent's graph returns the caller's own object there, which traced_region has
    updated as the node updated the rebuilt one.
    """
    if type(out) is torch.Tensor:  # the usual output: no structure to keep
        region.out_specs[layout] = (None, ())
        return [out]
    flat, spec = _pytree.tree_flatten(out)
    tensors = []
    leaves: list[Any] = []
    for value in flat:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            leaves.append(_TENSOR)
        elif isinstance(value, _CONSTANTS):
            leaves.append(value)
        elif any(value is obj for obj in given):
            leaves.append(_Given(next(i for i, obj in enumerate(given) if value is obj)))
        else:
            raise Fp32ScopeError(_output_message(region, value))
    region.out_specs[layout] = (spec, tuple(leaves))
    return tensors


def _output_message(region: Region, value: object) -> str:
    msg = (
        f"Scoped node {region.name!r} returned a {type(value).__name__} inside its output in a compiled graph "
        "with in_graph=True. An in-graph region returns tensors and constants, in any container torch's pytree "
        "knows (tuples, lists, dicts, named tuples, registered dataclasses), and the Hugging Face caches it "
        "was given. "
    )
    if carriers.is_cache_class(type(value)):
        msg += (
            "This cache was made by the node itself (it was called without one): pass it one "
            f"(a {type(value).__name__} as its cache argument), or call it with use_cache=False; or "
        )
    return msg + "wrap the node with in_graph=False (a graph break around the node)."


# A structured output's recipe: ``(name, tree)``. ``tree`` holds constants only, so that a
# function Dynamo keeps as a constant can hand it to traced_region on every release:
# ("t", i) the op's i-th tensor output, ("c", value) a constant, ("tuple", kids),
# ("list", kids), ("dict", keys, kids), ("given", k) the k-th object the region carried in
# (the caller's own), and ("node", j, kids) for any other container torch's
# pytree knows (named tuples, dataclasses, a ModelOutput), built by the j-th (unflatten,
# context) pair of the region's attribute ``name``. Classes and functions cannot be such
# constants (torch 2.13 guards them on a source its guards cannot read), so they are read
# from the region, as any attribute of a module is, with guards; an attribute per layout
# keeps those guards true when another layout is added.
Recipe = tuple[str, Any]


def _recipe(spec: Any, leaves: Iterator[Any], tensors: Iterator[int], builders: list[tuple[Any, Any]]) -> Any:
    if spec.is_leaf():
        leaf = next(leaves)
        if leaf is _TENSOR:
            return ("t", next(tensors))
        return ("given", leaf.index) if isinstance(leaf, _Given) else ("c", leaf)
    kids = tuple(_recipe(child, leaves, tensors, builders) for child in treespec_children(spec))
    if spec.type is tuple:
        return ("tuple", kids)
    if spec.type is list:
        return ("list", kids)
    if spec.type is dict:
        return ("dict", tuple(spec.context), kids)
    builders.append((_pytree.SUPPORTED_NODES[spec.type].unflatten_fn, spec.context))
    return ("node", len(builders) - 1, kids)


def _rebuild(  # noqa: PLR0911  (a return per kind of recipe node)
    tree: Any, builders: tuple[tuple[Any, Any], ...], tensors: Any, given: list[Any]
) -> Any:
    """The node's output from ``tree`` (see :data:`Recipe`), traced by Dynamo in traced_region.

    ``given``: the caller's objects the region carried, in the order of its arguments.
    """
    kind = tree[0]
    if kind == "t":
        return tensors[tree[1]]
    if kind == "c":
        return tree[1]
    if kind == "given":
        return given[tree[1]]
    kids = [_rebuild(kid, builders, tensors, given) for kid in tree[-1]]
    if kind == "tuple":
        return tuple(kids)
    if kind == "list":
        return kids
    if kind == "dict":
        return dict(zip(tree[1], kids, strict=True))
    unflatten, context = builders[tree[1]]
    return unflatten(kids, context)


def _unalias(outputs: list[torch.Tensor], inputs: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    # An op's output must not alias its inputs nor another of its outputs (AOTAutograd and
    # Inductor assume it, and Inductor reuses an input's memory once the op has run): an
    # argument returned as it is, a view of one (below ADInplaceOrView a view does not know
    # its base, so storages are compared), or a second view of one output, leaves as a copy.
    # So does an output laid out other than its copy would be (an offset, or not filling its
    # storage): the fake kernel returns copies, and the graph is compiled for their layout.
    seen = {t.untyped_storage()._cdata for t in inputs}
    for i, o in enumerate(outputs):
        storage = o.untyped_storage()
        if storage._cdata in seen or o.storage_offset() != 0 or storage.nbytes() != o.numel() * o.element_size():
            outputs[i] = o.clone()
        else:
            seen.add(storage._cdata)
    return outputs


def _outside_tensor_message(region: Region, what: str) -> str:
    return (
        f"Scoped node {region.name!r} (in_graph=True) uses a tensor{what} which is neither one of its arguments "
        "nor a parameter or buffer of the node: an in-graph region cannot carry it (its gradient would be lost, "
        "the compiled graph would not see it change). Pass that tensor to the node as an argument, register it "
        "on the node's module, or wrap the node with in_graph=False."
    )


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
        if grad:
            with _AboveAutograd(), torch.enable_grad(), region.scope:
                return _call_node(region, op.autocast, args, kwargs)
        with region.scope:  # no graph to record: the kernel runs as it was reached
            return _call_node(region, op.autocast, args, kwargs)
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
            raise Fp32ScopeError(_outside_tensor_message(op.region, "")) from error
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
    inplace = () if where is None else where.tensors if fake else op.region.carried[op.layout].inplace
    if inplace and copy:
        op.tensors = list(op.tensors)
        for i in inplace:
            op.tensors[i] = op.tensors[i].clone()
    return inplace


def _carried_out(
    op: _Op, fake: bool, inplace: tuple[int, ...], versions: list[int], written: set[int]
) -> list[torch.Tensor]:
    """The carried objects' tensors leaving the op: those newly bound, then those updated in place.

    The fake run finds which they are (a layout's plan); a real run reads them by the plan.
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
        region.carried[op.layout] = _CarriedPlan(updated, tuple(found))
        return [*rebound, *(op.tensors[i] for i in updated)]
    plan = region.carried[op.layout]
    rebound = [
        t for (_, obj), changes in zip(op.carried, plan.changes, strict=True) for t in carriers.tensors_of(obj, changes)
    ]
    return [*rebound, *(op.tensors[i] for i in plan.inplace)]


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
                    _outside_tensor_message(region, f" that requires grad (shape {tuple(variable.shape)})")
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
    with _saved_lock:
        _saved.pop(number, None)


def _region_train_impl(key: int, spec: list[int], grad_mask: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs, updates, saved = _execute(_Op(key, spec, values), fake=False, grad_mask=grad_mask)
    number = next(_numbers)
    token = torch.full((1,), number, dtype=torch.int64)
    with _saved_lock:
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
    with _saved_lock:
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
        plan = region.carried.get(op.layout)
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


# -- the call Dynamo keeps whole ---------------------------------------------------------


def _refuse_export(region: Region) -> None:
    # The same refusal as a graph-break wrapper's, naming the node: a loading process would
    # not have this process's regions either.
    msg = (
        f"{EXPORTING_MSG} The scoped node here is {region.name!r} (an in-graph region); to export the model "
        "with its nodes unscoped, use fp32scope.unscope_modules(model)."
    )
    raise Fp32ScopeError(msg)


def _refuse_distributed_tensors(region: Region, values: tuple[Any, ...]) -> None:
    # A DTensor cannot cross the op (it has no sharding rule), and a node that is an FSDP2
    # unit itself is traced with its parameters still sharded (Dynamo skips FSDP's hooks).
    dtensor = dtensor_type()
    if dtensor is None or not any(isinstance(v, dtensor) for v in values):
        return
    msg = (
        f"Scoped node {region.name!r} (in_graph=True) takes DTensors (its parameters, buffers or arguments) inside "
        "a compiled graph: an FSDP2 unit (fully_shard) or a tensor-parallel module cannot be an in-graph region. "
        "Make the region a module inside the unit (scope the child, fully_shard the parent), or wrap this node with "
        "in_graph=False (a graph break around it)."
    )
    raise Fp32ScopeError(msg)


def region_call(tag: str, n_args: int, kw_names: tuple[str, ...], *values: Any) -> Any:
    """A scoped node's call as a compiled graph holds it: arguments, then parameters and buffers."""
    key = int(tag.removeprefix(_TAG))
    region = _regions[key]
    if is_exporting():
        _refuse_export(region)
    _refuse_distributed_tensors(region, values)
    n_params, n_buffers = region.counts()
    end = len(values) - n_params - n_buffers
    params = list(values[end : end + n_params])
    buffers = list(values[end + n_params :])
    layout, leaves = region.layout_id(n_args, kw_names, values[:end])
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    ints = [v for v in leaves if isinstance(v, torch.SymInt)]
    autocast = _autocast_state()
    if autocast:
        warn_once_under_autocast(region.policy)
    known = region.mutated.get(region.training_layout())
    mutated = [_UNKNOWN] if known is None else list(known)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in itertools.chain(tensors, params))
    entry = None
    # A call carrying a cache is compiled inside once the eager region's run on fake tensors
    # (Dynamo's, before this one) has found what the node does to the cache, and only
    # without a gradient (as generate runs).
    plan = region.carried.get(layout) if layout in region.carried_args else None
    carries = layout in region.carried_args
    if (
        region.compiled
        and known == ()
        and not ints
        and (not carries or (plan is not None and not grad))
        and inner.wants_inductor()
    ):
        entry = _inner_entry(region, layout, autocast, [*tensors, *params, *buffers], len(tensors), grad=grad)
    written = () if plan is None else plan.inplace  # the carried tensors to write back
    if entry is not None:
        out = inner.apply(entry, next(_sites), [*tensors, *params, *buffers], grad=grad)
        found: tuple[int, ...] = ()
        if plan is not None:  # the graph returns the tensors updated in place first: moved last, as the op's
            written = tuple(i for i in plan.inplace if i not in entry.in_place)  # (the rest it updated itself)
            out = [*out[len(written) :], *out[: len(written)]]
    else:
        op = torch.ops.fp32scope.region_grad.default if grad else torch.ops.fp32scope.region.default
        # Every integer of the call in one SymInt[] (each list argument costs the dispatcher
        # about as much as a small kernel, on every call), laid out as _Op reads it. The first
        # is this call's own number: two calls of one region on the same inputs are two ops,
        # which AOTAutograd's common-subexpression pass would otherwise merge into one (one
        # kept graph for two backwards).
        numbers = [next(_sites), layout, len(tensors), n_params, len(autocast), len(ints), *autocast, *ints, *mutated]
        out = op(key, numbers, [*tensors, *params, *buffers])
        found = region.mutated[region.training_layout()]
        plan = region.carried.get(layout) if layout in region.carried_args else None
    n_carried = 0 if plan is None else plan.n_rebound + len(written)
    n_out = len(out) - len(found) - n_carried
    for i, update in zip(found, out[n_out : n_out + len(found)], strict=True):
        buffers[i].copy_(update)
    result = _node_output(region, layout, out[:n_out])
    if plan is None:
        return result
    # The carried tensors the node updated in place, written back as the buffers are; the
    # new ones go back to traced_region, which binds them on the caller's objects.
    carried = out[len(out) - n_carried :]
    for i, update in zip(written, carried[plan.n_rebound :], strict=True):
        tensors[i].copy_(update)
    region.last_changes = plan.changes
    return result, list(carried[: plan.n_rebound])


def _node_output(region: Region, layout: int, tensors: list[torch.Tensor]) -> Any:
    """What region_call returns for the node's output: its one tensor, or its tensors, for traced_region to rebuild.

    Dynamo takes only tensors and sequences of them from a call it keeps whole (torch 2.8
    and 2.13 refuse a dict, a dataclass or a ModelOutput, 2.4 a float or a str inside a
    tuple), so a structured output leaves as a tuple of its tensors, and traced_region
    builds the structure, its constants included, from the layout's recipe.
    """
    spec, leaves = region.out_specs[layout]
    # One tensor: no spec where it is a plain tensor, a leaf's spec where it is a subclass (a
    # fake tensor while Dynamo traces): the same output either way.
    if spec is None or (leaves == (_TENSOR,) and spec.is_leaf()):
        region.last_recipe = None
        return tensors[0]
    # Made afresh where this trace's output differs from the last one of its layout (other
    # constants, another structure): a graph traced again rebuilds what the node returns now.
    made = region.out_recipes.get(layout)
    if made is None or made[0] != (spec, leaves):
        builders: list[tuple[Callable[..., Any], Any]] = []
        tree = _recipe(spec, iter(leaves), itertools.count(), builders)
        name = f"out_builders_{layout}" if builders else ""
        if builders:
            setattr(region, name, tuple(builders))
        made = ((spec, leaves), (name, tree))
        region.out_recipes[layout] = made
    region.last_recipe = made[1]
    return tuple(tensors)


def _has_hooks(module: object) -> bool:
    """Whether a module's call runs hooks (its own, its submodules', or global ones)."""
    if not isinstance(module, torch.nn.Module):
        return False
    from torch.nn.modules import module as module_module

    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    if any(getattr(module_module, f"_global{kind}", None) for kind in kinds):
        return True
    return any(getattr(sub, kind, None) for sub in module.modules() for kind in kinds)


def _inner_entry(  # noqa: PLR0913  (a traced call's state, kept together)
    region: Region, layout: int, autocast: list[int], values: list[torch.Tensor], n_tensors: int, *, grad: bool
) -> inner.Entry | None:
    """The node's compiled graphs for this call's layout, or None where it runs eagerly in its op.

    ``values`` are the op's inputs: the call's ``n_tensors`` tensors, the node's parameters, its buffers.
    """
    if not all(inner.is_static(t) for t in values):  # dynamic shapes: its graphs are traced for fixed sizes
        return None
    grad_mask = sum(1 << i for i, t in enumerate(values) if grad and t.requires_grad)
    key = (
        layout,
        grad_mask,
        tuple(autocast),
        region.training_layout(),
        tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in values),
    )
    if key in region.inner:
        found = region.inner[key]
        if found is None or inner.state_holds(found):
            return found
        # Traced again after the node's attributes changed (torch.compiler.reset()): anew.
    entry = None
    if not _has_hooks(region.module):
        n_params, n_buffers = region.counts()
        p_slots, b_slots = region.slots(n_params, n_buffers)
        plan = region.carried.get(layout) if layout in region.carried_args else None

        def node(*flat: torch.Tensor) -> list[torch.Tensor]:
            objects: list[tuple[Any, Any]] = []
            args, kwargs = region.rebuild(layout, list(flat[:n_tensors]), [], objects)
            saved_p = _bind(p_slots, "_parameters", list(flat[n_tensors : n_tensors + n_params]))
            saved_b = _bind(b_slots, "_buffers", list(flat[n_tensors + n_params :])) if b_slots else None
            try:
                result = _call_node(region, autocast, args, kwargs)
                out = _flatten_out(region, layout, result, [obj for _, obj in objects])
            finally:
                if saved_b is not None:
                    _unbind(b_slots, "_buffers", saved_b)
                _unbind(p_slots, "_parameters", saved_p)
            return out if plan is None else out + _rebound_as_planned(region, plan, objects)

        # A scope entered while the node is traced (a nested scoped node) refuses, as it does
        # in any traced code: such a node runs eagerly in its op instead, where it enters.
        compiling = COMPILER_STATE[COMPILING_FLAG]
        COMPILER_STATE[COMPILING_FLAG] = True
        try:
            state = inner.node_state(region.module)
            entry = _build_inner(node, values, grad_mask, region, plan, _in_place(region, layout, plan))
        finally:
            COMPILER_STATE[COMPILING_FLAG] = compiling
        traced = inner.node_state(region.module)
        if entry is not None and [v for *_, v in traced] != [v for *_, v in state]:
            entry = None  # its forward changes its own attributes (a counter): its Python must run each call
        if entry is not None:
            entry.hold(traced, region.name)
    region.inner[key] = entry
    return entry


def _in_place(region: Region, layout: int, plan: _CarriedPlan | None) -> tuple[int, ...]:
    """The carried tensors a compiled-inside call updates where they are: a cache's keys and values."""
    if plan is None or not update_caches_in_place:
        return ()
    storage = region.carried_args[layout].storage
    return tuple(i for i in plan.inplace if i in storage)


def _rebound_as_planned(region: Region, plan: _CarriedPlan, objects: list[tuple[Any, Any]]) -> list[torch.Tensor]:
    """The tensors the traced node bound anew on its carried objects; refused unless as the plan says."""
    tensors: list[torch.Tensor] = []
    for (marker, obj), planned in zip(objects, plan.changes, strict=True):
        changes, new = carriers.changes(marker, obj, len(tensors))
        if changes != planned:
            msg = f"Scoped node {region.name!r} changed its cache otherwise when traced than when run"
            raise Fp32ScopeError(msg)  # (inner.build's refusal: the eager region runs it)
        tensors += new
    return tensors


def _build_inner(  # noqa: PLR0913, PLR0917  (inner.build's, and the call's plan)
    node: Callable[..., list[torch.Tensor]],
    values: list[torch.Tensor],
    grad_mask: int,
    region: Region,
    plan: _CarriedPlan | None,
    in_place: tuple[int, ...],
) -> inner.Entry | None:
    scopes = (region.scope, region.backward_scope)
    if plan is None:
        return inner.build(node, values, grad_mask, scopes)
    # A carried cache runs its own code (transformers', any release) in the node: where that
    # cannot be traced into a graph, the eager region runs it, as it ran before.
    try:
        return inner.build(node, values, grad_mask, scopes, updates=plan.inplace, in_place=in_place)
    except Exception:  # noqa: BLE001  (any failure of the trace: the eager region is always right)
        return None


def _carriable(value: object) -> bool:
    # Whether a region's op can take this argument: tensors, ints and constants, also in
    # tuples, lists and dicts. Dynamo inlines this (it reads the types it traced with).
    if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, *_CONSTANTS)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_carriable(v) for v in value)
    if isinstance(value, dict):
        return all(_carriable(v) for v in value.values())
    return False


_BREAK_REASON: Final = (
    "fp32scope: an in-graph region (in_graph=True, or an eager=True node) was called with an argument it cannot "
    "carry (a region takes tensors, ints and constants, also in tuples, lists and dicts, and Hugging Face "
    "DynamicCache and StaticCache objects of plain layers). That call is a graph break instead, the node run in "
    "its scope. Pass the object's tensors as arguments, or scope a module inside the node that takes only tensors"
)


def _break_call(tag: str, /, *args: Any, **kwargs: Any) -> Any:
    """A region's call that cannot be one: run as a graph break (Dynamo stops at this frame)."""
    region = _regions[int(tag.removeprefix(_TAG))]
    warn_break(region, args, kwargs)
    return region.fallback(*args, **kwargs)


def warn_break(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Warn once per region if a call's arguments hold one a region cannot carry (the call is a graph break)."""
    if region.warned_break:
        return
    kinds = sorted({type(v).__name__ for v in (*args, *kwargs.values()) if not _carriable(v)})
    if kinds:
        region.warned_break = True
        warnings.warn(
            f"Scoped node {region.name!r} (an in-graph region) was called inside a compiled graph with an "
            f"argument of type {', '.join(kinds)}, which a region cannot carry: this call is a graph break "
            "instead, the node run in its scope. Pass the object's tensors as arguments, or scope a module inside "
            "the node that takes only tensors.",
            Fp32RegionBreakWarning,
            stacklevel=user_stacklevel(),
        )


_break_call._torchdynamo_disable = True  # type: ignore[attr-defined]
_break_call._torchdynamo_disable_msg = _BREAK_REASON  # type: ignore[attr-defined]
dynamo_exclude.rename_where_no_reason(
    _break_call, " [fp32scope: an in-graph region was given an object it cannot carry: pass its tensors]"
)


def _carried_changes(tag: str) -> tuple[tuple[carriers.Change, ...], ...]:
    # What the node changed on its carried objects, as the fake run of the call Dynamo just
    # traced found it: constants of the graph, read by traced_region after region_call.
    return _regions[int(tag.removeprefix(_TAG))].last_changes


def _out_recipe(tag: str) -> Recipe | None:
    # How to rebuild the output of the call Dynamo just traced (None: region_call returned
    # the node's one tensor itself): a constant of the graph.
    return _regions[int(tag.removeprefix(_TAG))].last_recipe


# torch._dynamo.assume_constant_result's mark, set without importing Dynamo (a second):
# Dynamo calls the function while it traces and keeps its result as a constant.
_carried_changes._dynamo_marked_constant = True  # type: ignore[attr-defined]
_out_recipe._dynamo_marked_constant = True  # type: ignore[attr-defined]


def traced_region(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What Dynamo traces for an in-graph node's call: one :func:`region_call` in the graph.

    A Hugging Face cache argument crosses the op as a marker tuple of its tensors and
    constants (:mod:`fp32scope._wrappers.carriers`); what the node changed on it is set on
    the caller's cache after the op (Dynamo replays those attribute writes).
    """
    values = [*args, *kwargs.values()]
    carried = [i for i, v in enumerate(values) if carriers.can_carry(v)]
    if not all(i in carried or _carriable(v) for i, v in enumerate(values)):
        return _break_call(region.tag, *args, **kwargs)
    objects = [values[i] for i in carried]
    for i in carried:
        values[i] = carriers.flatten(values[i])
    module = region.module
    if isinstance(module, torch.nn.Module):
        params = tuple(module.parameters())
        buffers = tuple(module.buffers())
    else:
        params = buffers = ()
    result = region_call(region.tag, len(args), tuple(kwargs), *values, *params, *buffers)
    if carried:
        out, rebound = result
        for obj, changes in zip(objects, _carried_changes(region.tag), strict=True):
            carriers.write_back(obj, changes, rebound)
    else:
        out = result
    recipe = _out_recipe(region.tag)
    if recipe is None:
        return out
    name, tree = recipe
    return _rebuild(tree, getattr(region, name) if name else (), out, objects)


_allowed: list[bool] = []


def _allow_in_graph() -> None:
    # Importing Dynamo takes about a second: done once the first in-graph node is made.
    if not _allowed:
        torch._dynamo.allow_in_graph(region_call)  # type: ignore[no-untyped-call]
        _allowed.append(True)


# What Dynamo traces (or keeps whole: region_call) where a region is called.
_TRACED: Final = frozenset(
    {"region_call", "traced_region", "_carriable", "_carried_changes", "_out_recipe", "_rebuild"}
)

# Frames only: these run inside the op's kernels, at run time or while a graph is traced.
dynamo_exclude.exclude(
    *(
        fn
        for fn in list(globals().values())
        if isinstance(fn, types.FunctionType) and fn.__module__ == __name__ and fn.__name__ not in _TRACED
    ),
    *(
        fn
        for cls in (Region, _Op, _AboveAutograd, _WriteRecorder)
        for fn in vars(cls).values()
        if isinstance(fn, types.FunctionType)
    ),
    _RegionFunction.forward,
    _RegionFunction.backward,
    graph_break=False,
)
