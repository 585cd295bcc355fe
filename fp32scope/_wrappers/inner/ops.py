"""The ``fp32scope::inner`` ops that run a compiled-inside entry's graphs, and the call that puts them in a graph.

The ops (``inner`` without a gradient, ``inner_fwd`` and ``inner_bwd`` joined by the
tensors the backward needs, ``inner_update_N`` for a graph that writes a cache's tensors
where they are), their kernels and fake kernels, the autograd Function that joins the
forward and backward ops while a graph is traced, and :func:`apply`, which picks the op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

import torch

from fp32scope._flags import dynamo_exclude
from fp32scope._wrappers.inner.entries import Entry, _backward_entry, _checked_entry, _entry
from fp32scope._wrappers.inner.graphs import _as_layout, _Graph, _output_nodes

_lib = torch.library.Library("fp32scope", "FRAGMENT")  # type: ignore[no-untyped-call]  # torch's untyped API

# ``site`` keeps two calls of one node apart (a node drawing random numbers gives two
# results), ``entry`` names the graphs.
_lib.define("inner(int site, int entry, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]
_lib.define("inner_fwd(int site, int entry, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]
_lib.define("inner_bwd(int site, int entry, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]


def _inner_impl(_site: int, number: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _checked_entry(number)
    with entry.scope:
        return entry.forward.run(values)


def _inner_update_impl(
    _site: int, number: int, values: list[torch.Tensor], updated: list[torch.Tensor]
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    entry = _checked_entry(number)
    graph = entry.forward
    inputs = list(values)
    moved = []
    for i, tensor in zip(entry.in_place, updated, strict=True):
        # The graph writes where it was compiled to: one laid out otherwise runs on a copy
        # laid out so, written back after.
        laid = _as_layout(tensor, graph.inputs[i])
        if laid is not tensor:
            moved.append((tensor, laid))
        inputs.insert(i, laid)
    with entry.scope:
        out = graph.run(inputs)
    for tensor, laid in moved:
        tensor.copy_(laid)
    return _returned(out)


def _returned(out: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    # As the dispatcher takes an op's returns: one tensor, or a tuple of several.
    return out[0] if len(out) == 1 else tuple(out)


def _inner_bwd_impl(_site: int, number: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = _backward_entry(number)
    backward = cast("_Graph", entry.backward)
    with entry.backward_scope:
        out = backward.run(values)
    return [g for g in out if g is not None]


def _fake(graph: _Graph, keep: Callable[[Any], bool]) -> list[torch.Tensor]:
    return [
        torch.empty_strided(layout[0], layout[1], dtype=node.meta["val"].dtype, device=node.meta["val"].device)
        for node, layout in zip(_output_nodes(graph.gm), graph.outputs, strict=True)
        if keep(node) and layout is not None
    ]


def _inner_fake(_site: int, number: int, _values: list[torch.Tensor]) -> list[torch.Tensor]:
    return _fake(_entry(number).forward, lambda _: True)


def _inner_update_fake(
    _site: int, number: int, _values: list[torch.Tensor], _updated: list[torch.Tensor]
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return _returned(_fake(_entry(number).forward, lambda _: True))


def _inner_bwd_fake(_site: int, number: int, _values: list[torch.Tensor]) -> list[torch.Tensor]:
    return _fake(cast("_Graph", _entry(number).backward), lambda node: node is not None)


for _name, _kernel, _fake_kernel in (
    ("inner", _inner_impl, _inner_fake),
    ("inner_fwd", _inner_impl, _inner_fake),
    ("inner_bwd", _inner_bwd_impl, _inner_bwd_fake),
):
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    torch.library.register_fake(f"fp32scope::{_name}", _fake_kernel, lib=_lib)


_update_ops: dict[int, Any] = {}
_update_ops_lock = threading.Lock()


def _update_op(n_out: int) -> Any:
    """``inner`` for a graph with ``n_out`` outputs that updates some of its inputs where they are.

    Those inputs (``updated``, taken out of ``values``) the op declares it writes, so the
    parent's graph hands them over uncopied. One op per number of outputs: torch
    functionalizes an op that writes its arguments only where it returns single tensors, not
    a list.
    """
    with _update_ops_lock:
        op = _update_ops.get(n_out)
        if op is None:
            name = f"inner_update_{n_out}"
            returns = ", ".join(["Tensor"] * n_out)
            _lib.define(  # type: ignore[no-untyped-call]
                f"{name}(int site, int entry, Tensor[] values, Tensor(a!)[] updated) -> ({returns})"
            )
            _lib.impl(name, _inner_update_impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
            torch.library.register_fake(f"fp32scope::{name}", _inner_update_fake, lib=_lib)
            op = _update_ops[n_out] = getattr(torch.ops.fp32scope, name).default
        return op


class _InnerFunction(torch.autograd.Function):
    """Joins an entry's forward and backward ops while a graph is traced (it never runs otherwise)."""

    @staticmethod
    def forward(ctx: Any, site: int, number: int, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        entry = _entry(number)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = torch.ops.fp32scope.inner_fwd(site, number, list(values))
        outputs = out[: entry.n_out]
        ctx.save_for_backward(*(out[i] if kind else values[i] for kind, i in entry.sources))
        ctx.number = number
        ctx.site = site
        wanted = set(entry.tangents)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outputs) if i not in wanted))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        entry = _entry(ctx.number)
        saved = list(ctx.saved_tensors)
        tangents = []
        for i in entry.tangents:
            g = grads[i]
            tangents.append(g if g is not None else torch.zeros(entry.forward.outputs[i][0]))  # type: ignore[index]
        found = iter(torch.ops.fp32scope.inner_bwd(ctx.site, ctx.number, [*saved, *tangents]))
        return (None, None, *(next(found) if has else None for has in entry.grads))


def apply(entry: Entry, site: int, values: list[torch.Tensor], *, grad: bool) -> list[torch.Tensor]:
    """The entry's op in a graph being traced: its tensor outputs, with their gradient (``grad``)."""
    if entry.in_place:  # (an inference graph's)
        moved = set(entry.in_place)
        rest = [v for i, v in enumerate(values) if i not in moved]
        n_out = len(entry.forward.outputs)
        updated = _update_op(n_out)(site, entry.number, rest, [values[i] for i in entry.in_place])
        return [updated] if n_out == 1 else list(updated)
    if not grad:
        out: list[torch.Tensor] = torch.ops.fp32scope.inner(site, entry.number, values)
        return out
    fn = cast("Callable[..., tuple[torch.Tensor, ...]]", _InnerFunction.apply)
    return list(fn(site, entry.number, *values))


dynamo_exclude.exclude(
    _inner_impl,
    _inner_update_impl,
    _inner_update_fake,
    _inner_bwd_impl,
    _inner_fake,
    _inner_bwd_fake,
    _fake,
    _returned,
    graph_break=False,
)
