"""What crosses a region op's boundary, both ways.

In: the node's parameters and buffers bound to the op's tensors for a run, and the
caller's autocast state as traced, re-entered around the node. Out: the node's output
flattened to its tensors (its structure and constants kept per layout), outputs that alias
an input or each other copied, and what the traced call returns for the output with the
recipe by which Dynamo rebuilds its structure around the op's tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import torch
from torch.utils import _pytree

from fp32scope._compat import treespec_children
from fp32scope._errors import Fp32ScopeError
from fp32scope._flags import dynamo_exclude
from fp32scope._wrappers.autocast import cast_to_float32
from fp32scope._wrappers.region.refusals import _output_message
from fp32scope._wrappers.region.regions import _CONSTANTS, _TENSOR, Region, Slots

# The autocast device types and dtypes a traced call can carry, by index.
_AUTOCAST_DEVICES: Final = ("cpu", "cuda", "xpu", "mps", "hpu")
_AUTOCAST_DTYPES: Final = (torch.float16, torch.bfloat16, torch.float32)


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


def _call_node(
    region: Region,
    autocast: list[int],
    args: list[Any],
    kwargs: dict[str, Any],
    call: Callable[..., Any] | None = None,
) -> Any:
    """Call the node (or ``call``, the node compiled), under the caller's autocast as traced, or without it.

    Without it where the node's policy is ``autocast=False``.
    """
    node = region.call if call is None else call
    if not autocast:
        return node(*args, **kwargs)
    devices = tuple(_AUTOCAST_DEVICES[i] for i in autocast[::2])
    with contextlib.ExitStack() as stack:
        if region.policy.mode is False:
            for device in devices:
                stack.enter_context(torch.autocast(device, enabled=False))
            return node(*cast_to_float32(args, devices), **cast_to_float32(kwargs, devices))
        for device, dtype in zip(devices, autocast[1::2], strict=True):
            stack.enter_context(torch.autocast(device, dtype=_AUTOCAST_DTYPES[dtype]))
        return node(*args, **kwargs)


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
            raise Fp32ScopeError(_output_message(region.name, value))
    region.out_specs[layout] = (spec, tuple(leaves))
    return tensors


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


# What Dynamo traces here: traced_region's rebuild of the node's output.
_TRACED: Final = frozenset({"_rebuild"})

# Frames only: these run inside the op's kernels, at run time or while a graph is traced.
dynamo_exclude.exclude(
    *(
        fn
        for fn in list(globals().values())
        if isinstance(fn, types.FunctionType) and fn.__module__ == __name__ and fn.__name__ not in _TRACED
    ),
    graph_break=False,
)
