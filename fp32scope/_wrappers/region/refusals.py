"""What an in-graph region refuses, and the messages that say so.

Each is an :class:`Fp32ScopeError` that names the node and says what works instead: an
argument of a kind a region cannot carry, an output of a kind it cannot return, a tensor
the node reaches other than as an argument, parameter or buffer, ``torch.export`` of a
model with a region, and DTensors. Also the reason Dynamo shows for the graph break that a
call with an argument a region cannot carry becomes (``_BREAK_REASON``).
"""

from __future__ import annotations

import types
from typing import Any, Final, NoReturn

import torch
from torch.utils import _pytree

from fp32scope._compat import dtensor_type
from fp32scope._errors import Fp32ScopeError
from fp32scope._flags import dynamo_exclude
from fp32scope._flags.scope import EXPORTING_MSG
from fp32scope._wrappers import carriers


def _refuse_argument(
    name: str, n_args: int, kw_names: tuple[str, ...], values: tuple[Any, ...], leaf: object
) -> NoReturn:
    """Refuse an argument of a kind a region cannot carry (``leaf``, found in ``values``)."""
    position = next(i for i, value in enumerate(values) if any(x is leaf for x in _pytree.tree_flatten(value)[0]))
    where = f"argument {position}" if position < n_args else f"keyword argument {kw_names[position - n_args]!r}"
    container = values[position]
    # (Dynamo hands lists in as FX's immutable_list, dicts as immutable_dict.)
    kind = next((k.__name__ for k in (list, tuple, dict) if isinstance(container, k)), type(container).__name__)
    inside = "" if container is leaf else f" (inside a {kind})"
    msg = (
        f"Scoped node {name!r} was called with {where} of type {type(leaf).__name__}{inside} ({leaf!r}) "
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


def _output_message(name: str, value: object) -> str:
    msg = (
        f"Scoped node {name!r} returned a {type(value).__name__} inside its output in a compiled graph "
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


def _outside_tensor_message(name: str, what: str) -> str:
    return (
        f"Scoped node {name!r} (in_graph=True) uses a tensor{what} which is neither one of its arguments "
        "nor a parameter or buffer of the node: an in-graph region cannot carry it (its gradient would be lost, "
        "the compiled graph would not see it change). Pass that tensor to the node as an argument, register it "
        "on the node's module, or wrap the node with in_graph=False."
    )


def _refuse_export(name: str) -> None:
    # The same refusal as a graph-break wrapper's, naming the node: a loading process would
    # not have this process's regions either.
    msg = (
        f"{EXPORTING_MSG} The scoped node here is {name!r} (an in-graph region); to export the model "
        "with its nodes unscoped, use fp32scope.unscope_modules(model)."
    )
    raise Fp32ScopeError(msg)


def _refuse_distributed_tensors(name: str, values: tuple[Any, ...]) -> None:
    # A DTensor cannot cross the op (it has no sharding rule), and a node that is an FSDP2
    # unit itself is traced with its parameters still sharded (Dynamo skips FSDP's hooks).
    dtensor = dtensor_type()
    if dtensor is None or not any(isinstance(v, dtensor) for v in values):
        return
    msg = (
        f"Scoped node {name!r} (in_graph=True) takes DTensors (its parameters, buffers or arguments) inside "
        "a compiled graph: an FSDP2 unit (fully_shard) or a tensor-parallel module cannot be an in-graph region. "
        "Make the region a module inside the unit (scope the child, fully_shard the parent), or wrap this node with "
        "in_graph=False (a graph break around it)."
    )
    raise Fp32ScopeError(msg)


#: What a region carries, as the refusals say it.
CARRIED: Final = (
    "tensors, ints and constants (None, bool, int, float, str, torch.dtype, torch.device), also in tuples, "
    f"lists and dicts, Hugging Face DynamicCache and StaticCache objects of {carriers.LAYERS} layers "
    f"({carriers.OTHER_LAYERS}), and EncoderDecoderCache objects of two of those, and {carriers.OBJECTS}"
)


def uncarried_message(
    name: str, n_args: int, kw_names: tuple[str, ...], found: tuple[tuple[int, str, str], ...], *, fullgraph: bool
) -> str:
    """Why a call cannot be a region: ``found`` holds ``(position, type name, reason)`` per argument it cannot carry.

    A reason is :func:`carriers.refusal`'s (a cache), or "" for any other object.
    """
    position, kind, reason = found[0]
    where = f"argument {position}" if position < n_args else f"keyword argument {kw_names[position - n_args]!r}"
    why = reason or f"a region carries {CARRIED}"
    msg = (
        f"Scoped node {name!r} (an in-graph region) was called inside a compiled graph with {where} of type "
        f"{kind}, which a region cannot carry: {why}."
    )
    if len(found) > 1:
        msg += f" (So are {', '.join(sorted({k for _, k, _ in found[1:]}))}.)"
    if fullgraph:
        return msg + (
            " Under fullgraph=True the call cannot be a graph break either. Pass the object's tensors as "
            "arguments, scope a module inside the node that takes only tensors, or compile without "
            "fullgraph=True (the call is then a graph break, the node run in its scope)."
        )
    return msg + (
        " This call is a graph break instead, the node run in its scope. Pass the object's tensors as "
        "arguments, or scope a module inside the node that takes only tensors."
    )


_BREAK_REASON: Final = (
    "fp32scope: an in-graph region (in_graph=True, or an eager=True node) was called with an argument it cannot "
    "carry (a region takes tensors, ints and constants, also in tuples, lists and dicts, and Hugging Face "
    f"DynamicCache, StaticCache and EncoderDecoderCache objects of {carriers.LAYERS} layers "
    f"({carriers.OTHER_LAYERS}), and {carriers.OBJECTS}). That call is a graph break "
    "instead, the node run in its scope. Pass the object's tensors as arguments, or scope a module inside the node "
    "that takes only tensors"
)


# Frames only: these run inside the op's kernels, at run time or while a graph is traced.
dynamo_exclude.exclude(
    *(fn for fn in list(globals().values()) if isinstance(fn, types.FunctionType) and fn.__module__ == __name__),
    graph_break=False,
)
