"""Dynamo's entry: what Dynamo traces, or keeps whole, where an in-graph node is called.

:func:`traced_region`, which Dynamo traces, flattens the call's carried caches and calls
:func:`region_call`, which Dynamo keeps whole in its graph: it picks the op (the eager
region, with or without a gradient, or the node's compiled graphs), writes back the
buffers and cache tensors the node updated in place, and hands back the cache's new
tensors; ``traced_region`` sets them, and the cache's new constants, on the caller's cache
and rebuilds the output's structure, both read as constants of the graph. A call with an
argument a region cannot carry is a graph break instead (``_break_call``), with a warning
once per region (:func:`warn_break`).
"""

from __future__ import annotations

import itertools
import types
import warnings
from typing import Any, Final

import torch

from fp32scope._compat import compiles_in_op, dynamo_refusal, is_exporting, tracing_backend, tracing_one_graph
from fp32scope._errors import Fp32RegionBreakWarning, Fp32ScopeError, user_stacklevel
from fp32scope._flags import dynamo_exclude
from fp32scope._wrappers import carriers, inner
from fp32scope._wrappers.autocast import warn_once_under_autocast
from fp32scope._wrappers.region.boundary import _autocast_state, _node_output, _rebuild
from fp32scope._wrappers.region.eager import _UNKNOWN
from fp32scope._wrappers.region.inside import _inner_entry
from fp32scope._wrappers.region.refusals import (
    _BREAK_REASON,
    _refuse_distributed_tensors,
    _refuse_export,
    uncarried_message,
)
from fp32scope._wrappers.region.regions import _CONSTANTS, _TAG, Recipe, Region, _kept_whole, _regions

_sites = itertools.count(1)


def region_call(tag: str, site: int, n_args: int, kw_names: tuple[str, ...], *values: Any) -> Any:
    """A scoped node's call as a compiled graph holds it: arguments, then parameters and buffers.

    ``site`` numbers the traced call (a constant of the graph, from :func:`_new_site`).
    """
    key = int(tag.removeprefix(_TAG))
    region = _regions[key]
    if is_exporting():
        _refuse_export(region.name)
    _refuse_distributed_tensors(region.name, values)
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
    # (Dynamo's, before this one, of the same site) has found what the node does to the
    # cache, and only without a gradient (as generate runs).
    carries = layout in region.carried_args
    plan = region.plans.get(site) if carries else None
    if (
        region.compiled
        and known == ()
        and not ints
        and (not carries or (plan is not None and not grad))
        and inner.wants_inductor()
    ):
        values_in = [*tensors, *params, *buffers]
        entry = _inner_entry(region, layout, plan, autocast, values_in, n_tensors=len(tensors), grad=grad)
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
        # kept graph for two backwards); and the op's kernel reads the plan of that number.
        backend = _backend(region)
        numbers = [
            site,
            layout,
            len(tensors),
            n_params,
            len(autocast),
            len(ints),
            backend,
            *autocast,
            *ints,
            *mutated,
        ]
        out = op(key, numbers, [*tensors, *params, *buffers])
        found = region.mutated[region.training_layout()]
        plan = region.plans.get(site) if carries else None
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
    return result, list(carried[: plan.n_rebound])


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


def _break_call(tag: str, /, *args: Any, **kwargs: Any) -> Any:
    """A region's call that cannot be one: run as a graph break (Dynamo stops at this frame)."""
    region = _regions[int(tag.removeprefix(_TAG))]
    warn_break(region, args, kwargs)
    return region.fallback(*args, **kwargs)


def _backend(region: Region) -> int:
    """The number of the backend that compiles the node in its op (0: the node runs eagerly there)."""
    if not region.compiled or region.holds_scoped():  # an eager=True node; one holding scoped nodes
        return 0
    backend = tracing_backend()
    if backend is None:
        # Not traced: a backend that runs the parent's graph as Python (eager, a user's own)
        # calls this function at every call; the backend is the one it was traced for.
        return region.traced_backend
    region.traced_backend = region.backend_number(backend if compiles_in_op(backend) else None)
    return region.traced_backend


def _uncarried(values: list[Any]) -> tuple[tuple[int, str, str], ...]:
    # The arguments a region cannot carry: (position, type name, why). Dynamo inlines this
    # where it traces a call (its result is constants of the trace).
    return tuple(
        (i, _type_name(v), carriers.refusal(v))
        for i, v in enumerate(values)
        if not (_carriable(v) or carriers.can_carry(v))
    )


_BUILTINS: Final = (list, tuple, dict, set, frozenset, complex, bytes, slice, range)


def _type_name(value: object) -> str:
    # Dynamo inlines this: torch 2.4's cannot read a builtin type's __name__ ("not a constant").
    for kind, name in zip(
        _BUILTINS, ("list", "tuple", "dict", "set", "frozenset", "complex", "bytes", "slice", "range"), strict=True
    ):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def warn_break(region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Warn once per region if a call's arguments hold one a region cannot carry (the call is a graph break)."""
    if region.warned_break:
        return
    found = _uncarried([*args, *kwargs.values()])
    if found:
        region.warned_break = True
        warnings.warn(
            uncarried_message(region.name, len(args), tuple(kwargs), found, fullgraph=False),
            Fp32RegionBreakWarning,
            stacklevel=user_stacklevel(),
        )


def _refuse_in_one_graph(tag: str, n_args: int, kw_names: tuple[str, ...], found: tuple[Any, ...]) -> int:
    # Called by Dynamo while it traces a call that cannot be a region: under fullgraph=True,
    # fp32scope's error naming the node and the argument, where the graph break that follows
    # would fail with Dynamo's "Skip inlining a disabled function", which names neither.
    if not tracing_one_graph():
        return 0
    region = _regions[int(tag.removeprefix(_TAG))]
    raise dynamo_refusal(Fp32ScopeError, uncarried_message(region.name, n_args, kw_names, found, fullgraph=True))


_break_call._torchdynamo_disable = True  # type: ignore[attr-defined]
_break_call._torchdynamo_disable_msg = _BREAK_REASON  # type: ignore[attr-defined]
dynamo_exclude.rename_where_no_reason(
    _break_call, " [fp32scope: an in-graph region was given an object it cannot carry: pass its tensors]"
)


def _new_site() -> int:
    # The number of a call Dynamo traces: a constant of its graph, by which the op's kernel
    # finds what its fake run found the node changes on its carried objects (that call's
    # plan: another graph of the same node may have another).
    return next(_sites)


def _carried_changes(tag: str, site: int) -> tuple[tuple[carriers.Change, ...], ...]:
    # What the node changed on its carried objects, as the fake run of the call Dynamo just
    # traced found it: constants of the graph, read by traced_region after region_call.
    return _regions[int(tag.removeprefix(_TAG))].plans[site].changes


def _out_recipe(tag: str) -> Recipe | None:
    # How to rebuild the output of the call Dynamo just traced (None: region_call returned
    # the node's one tensor itself): a constant of the graph.
    return _regions[int(tag.removeprefix(_TAG))].last_recipe


# torch._dynamo.assume_constant_result's mark, set without importing Dynamo (a second):
# Dynamo calls the function while it traces and keeps its result as a constant.
_carried_changes._dynamo_marked_constant = True  # type: ignore[attr-defined]
_new_site._dynamo_marked_constant = True  # type: ignore[attr-defined]
_refuse_in_one_graph._dynamo_marked_constant = True  # type: ignore[attr-defined]
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
        _refuse_in_one_graph(region.tag, len(args), tuple(kwargs), _uncarried(values))
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
    site = _new_site()
    result = region_call(region.tag, site, len(args), tuple(kwargs), *values, *params, *buffers)
    if carried:
        out, rebound = result
        for obj, changes in zip(objects, _carried_changes(region.tag, site), strict=True):
            carriers.write_back(obj, changes, rebound)
    else:
        out = result
    recipe = _out_recipe(region.tag)
    if recipe is None:
        return out
    name, tree = recipe
    return _rebuild(tree, getattr(region, name) if name else (), out, objects)


# Allowed in Dynamo's graphs when the first region is made (regions' _allow_in_graph).
_kept_whole.append(region_call)

# What Dynamo traces (or keeps whole: region_call) where a region is called; boundary's
# _rebuild too (its own _TRACED).
_TRACED: Final = frozenset(
    {
        "region_call",
        "traced_region",
        "_carriable",
        "_uncarried",
        "_type_name",
        "_carried_changes",
        "_new_site",
        "_out_recipe",
        "_refuse_in_one_graph",
    }
)

# Frames only: these run inside the op's kernels, at run time or while a graph is traced.
dynamo_exclude.exclude(
    *(
        fn
        for fn in list(globals().values())
        if isinstance(fn, types.FunctionType) and fn.__module__ == __name__ and fn.__name__ not in _TRACED
    ),
    graph_break=False,
)
