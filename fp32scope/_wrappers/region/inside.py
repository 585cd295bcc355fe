"""Regions compiled inside: what joins a region call to :mod:`fp32scope._wrappers.inner`.

Whether a call's node is compiled inside its op (no hooks, fixed shapes, a forward that
leaves its own attributes as they were), the node's forward as the function ``inner``
traces (its parameters and buffers bound, a carried cache rebuilt, the tensors it binds
anew on the cache checked against the eager run's plan), and which of a cache's tensors
the compiled graph updates where they are (``update_caches_in_place``).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp32scope._compat import COMPILER_STATE, COMPILING_FLAG, REGION_OPS_UPDATE_CACHES_IN_PLACE
from fp32scope._errors import Fp32ScopeError
from fp32scope._flags import dynamo_exclude
from fp32scope._wrappers import carriers, inner
from fp32scope._wrappers.region.boundary import _bind, _call_node, _flatten_out, _unbind
from fp32scope._wrappers.region.regions import Region, _CarriedPlan

#: Whether a compiled-inside call updates a cache's keys and values where they are (where
#: torch allows it), read when a graph is traced. ``benchmarks/bench_decode.py`` turns it
#: off for one variant (on this module, which reads it), to measure the copies it saves.
update_caches_in_place = REGION_OPS_UPDATE_CACHES_IN_PLACE


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
    region: Region,
    layout: int,
    plan: _CarriedPlan | None,
    autocast: list[int],
    values: list[torch.Tensor],
    *,
    n_tensors: int,
    grad: bool,
) -> inner.Entry | None:
    """The node's compiled graphs for this call's layout and plan, or None where it runs eagerly in its op.

    ``values`` are the op's inputs: the call's ``n_tensors`` tensors, the node's parameters,
    its buffers; ``plan``, what the call does to its carried objects (None: it carries none).
    """
    if not all(inner.is_static(t) for t in values):  # dynamic shapes: its graphs are traced for fixed sizes
        return None
    grad_mask = sum(1 << i for i, t in enumerate(values) if grad and t.requires_grad)
    key = (
        layout,
        None if plan is None else plan.key,
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

        in_place = _in_place(region, layout, plan)
        entry = _trace(region, node, values, grad_mask, plan, in_place)
        if entry is not None:
            # What the op traces again for other values of the node's attributes, at run time:
            # the layouts only, not this trace's fake tensors (which would keep its mode alive).
            likes = [inner.Like(v) for v in values]
            entry.retrace = lambda: _trace(region, node, likes, grad_mask, plan, in_place)
    region.inner[key] = entry
    return entry


def _trace(  # noqa: PLR0913, PLR0917  (_build_inner's)
    region: Region,
    node: Callable[..., list[torch.Tensor]],
    values: Sequence[Any],
    grad_mask: int,
    plan: _CarriedPlan | None,
    in_place: tuple[int, ...],
) -> inner.Entry | None:
    """The node's graphs traced for its attributes as they are now, holding them; None where it cannot be."""
    # A scope entered while the node is traced (a nested scoped node) refuses, as it does
    # in any traced code: such a node runs eagerly in its op instead, where it enters.
    compiling = COMPILER_STATE[COMPILING_FLAG]
    COMPILER_STATE[COMPILING_FLAG] = True
    try:
        state = inner.node_state(region.module)
        entry = _build_inner(node, values, grad_mask, region, plan, in_place)
    finally:
        COMPILER_STATE[COMPILING_FLAG] = compiling
    traced = inner.node_state(region.module)
    if entry is None or [v for *_, v in traced] != [v for *_, v in state]:
        return None  # its forward changes its own attributes (a counter): its Python must run each call
    entry.hold(traced, region.name)
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
    values: Sequence[Any],
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


# Frames only: these run inside the op's kernels, at run time or while a graph is traced.
dynamo_exclude.exclude(
    *(fn for fn in list(globals().values()) if isinstance(fn, types.FunctionType) and fn.__module__ == __name__),
    graph_break=False,
)
