"""The Region object: what a scoped node's op needs at run time, numbered and registered.

:class:`Region` (the node, its scopes, the layouts of its calls' arguments and outputs,
the buffers and cache tensors it updates, its compiled-inside entries), a layout of a
call's arguments (``_Layout``), where a layout's carried objects are (``_CarriedArgs``)
and what the node does to them (``_CarriedPlan``), the registry of live regions by number,
the numbers themselves, the form of an output's recipe (``Recipe``), and the check of the
``in_graph`` argument.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import secrets
import types
import weakref
from collections.abc import Callable
from typing import Any, Final, cast

import torch
import wrapt
from torch.utils import _pytree

from fp32scope._flags import dynamo_exclude
from fp32scope._flags.scope import fp32_precision_scope, wrapper_scope
from fp32scope._wrappers import carriers, inner, layouts
from fp32scope._wrappers.autocast import AutocastPolicy
from fp32scope._wrappers.region.refusals import _refuse_argument
from fp32scope._wrappers.trampoline import new_trampoline

_CONSTANTS: Final = (type(None), bool, int, float, str, torch.dtype, torch.device)
_TAG: Final = "fp32scope region "

_numbers = itertools.count(1)
# A region's number is this process's: Inductor's and AOTAutograd's caches, on disk, serve a
# graph compiled by another process to a graph that reads the same, and a number that meant
# another node there would run this process's node of that number (wrong results, or
# another node's shapes). So every region number holds this process's own random high bits.
_PROCESS: Final = secrets.randbits(24) << 32
_regions: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()

Slots = list[tuple[torch.nn.Module, str, int]]


_TENSOR: Final = layouts.TENSOR
_SYMINT: Final = layouts.SYMINT

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

# What Dynamo keeps whole in its graphs: the entry module's region_call, which it adds here
# (this module imports nothing above it); allowed in the graph when the first region is made.
_kept_whole: list[Callable[..., Any]] = []
_allowed: list[bool] = []


def _allow_in_graph() -> None:
    # Importing Dynamo takes about a second: done once the first in-graph node is made.
    if not _allowed:
        for fn in _kept_whole:
            torch._dynamo.allow_in_graph(fn)  # type: ignore[no-untyped-call]
        _allowed.append(True)


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
    """What a node does to the objects it carries, per traced call, as its fake run found.

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
    def key(self) -> tuple[Any, ...]:
        """What tells two plans apart for the op: the tensors it hands back (its ints and constants are Dynamo's)."""
        return (self.inplace, tuple(tuple(change for change in found if change[2]) for found in self.changes))

    @property
    def n_outputs(self) -> int:
        """How many of the op's outputs are the carried objects' tensors (after its buffers)."""
        return self.n_rebound + len(self.inplace)


def _holds_proxy(module: torch.nn.Module) -> bool:
    # Walked by hand: modules() reaches a proxy's wrapped module, never the proxy, whose own
    # class (not its __class__, the wrapped module's) says it is one.
    for child in module._modules.values():
        if child is not None and (issubclass(type(child), wrapt.BaseObjectProxy) or _holds_proxy(child)):
            return True
    return False


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
        # Per layout with carried objects (caches): where they are; and what the node does to
        # them, per traced call (its site number), as that call's fake run found: one layout
        # may have several plans where the node branches on an int made symbolic (a static
        # sliding layer's length), each graph's op reading its own.
        self.carried_args: dict[int, _CarriedArgs] = {}
        self.plans: dict[int, _CarriedPlan] = {}
        # How traced_region rebuilds the last traced call's structured output (see boundary._recipe).
        self.last_recipe: Recipe | None = None
        # Per structured output layout: the output's (spec, leaves) last traced, and its
        # recipe, whose builders are set as the attribute the recipe names (see boundary._recipe).
        self.out_recipes: dict[int, tuple[tuple[Any, tuple[Any, ...]], Recipe]] = {}
        # Whether a parent compiled by Inductor compiles the node inside its op (not an eager
        # node's), and the compiled graphs per layout, or None where a layout cannot be.
        self.compiled = compiled
        self.inner: dict[tuple[Any, ...], inner.Entry | None] = {}
        # The backends of the parents that compile the node in its op (not Inductor, which
        # compiles it inside: see inner), numbered from 1 as a graph holds them, and the node
        # compiled by each.
        self.backends: list[Callable[..., Any]] = []
        self._compiled_calls: dict[int, Callable[..., Any]] = {}
        self.traced_backend = 0  # the number found when the last graph holding the region was traced
        _regions[self.key] = self
        _allow_in_graph()

    # -- trace time ---------------------------------------------------------------------

    def backend_number(self, backend: Callable[..., Any] | None) -> int:
        """The number a graph holds for the backend compiling the node in its op; 0 for none (eager)."""
        if backend is None:
            return 0
        for number, known in enumerate(self.backends, 1):
            if known is backend:
                return number
        self.backends.append(backend)
        return len(self.backends)

    def holds_scoped(self) -> bool:
        """Whether the node holds scoped nodes of its own (wrapper proxies among its submodules)."""
        return isinstance(self.module, torch.nn.Module) and _holds_proxy(self.module)

    def compiled_call(self, number: int) -> Callable[..., Any]:
        """The node compiled by backend ``number`` (made on first use): what the op calls instead of the node."""
        found = self._compiled_calls.get(number)
        if found is None:
            # A trampoline of the node's own (a code object per node: Dynamo's limit on
            # compiled entries is per code object), compiled by the parent's backend.
            compiled = torch.compile(new_trampoline(self.name), backend=self.backends[number - 1])
            found = functools.partial(compiled, self.call)
            self._compiled_calls[number] = found
        return found

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
                _refuse_argument(self.name, n_args, kw_names, values, leaf)
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


# Frames only: these run inside the op's kernels, at run time or while a graph is traced.
dynamo_exclude.exclude(
    *(fn for fn in list(globals().values()) if isinstance(fn, types.FunctionType) and fn.__module__ == __name__),
    *(fn for cls in (Region,) for fn in vars(cls).values() if isinstance(fn, types.FunctionType)),
    graph_break=False,
)
