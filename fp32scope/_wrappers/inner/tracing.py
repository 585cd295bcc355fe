"""Tracing a region call's node into compiled-inside graphs, or finding that it cannot be.

:func:`build` (the node traced functionally on fake tensors with Inductor's
decompositions, its joint graph split as Inductor splits one, a static cache's updates
written where they are), the graph rewrites it makes (``_write_in_place``,
``_save_bases``), :class:`Like` (what it reads of the values it traces for) and
:func:`is_static` (whether a tensor's layout is fixed, as a trace needs).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fp32scope._compat import export_node_graph
from fp32scope._errors import Fp32ScopeError
from fp32scope._wrappers.inner.entries import Entry
from fp32scope._wrappers.inner.graphs import _Graph, _output_nodes


class Like:
    """A tensor's shape, strides, dtype and device: all :func:`build` reads of the values it traces for."""

    __slots__ = ("device", "dtype", "shape", "strides")

    def __init__(self, value: torch.Tensor) -> None:
        self.shape = tuple(value.shape)
        self.strides = tuple(value.stride())
        self.dtype = value.dtype
        self.device = value.device

    def stride(self) -> tuple[int, ...]:
        """The strides, as a tensor's ``stride()``."""
        return self.strides


def build(  # noqa: PLR0913  (the trace's inputs, and the updates it may make)
    fn: Callable[..., list[torch.Tensor]],
    values: Sequence[torch.Tensor | Like],
    grad_mask: int,
    scopes: tuple[Any, Any],
    *,
    updates: tuple[int, ...] = (),
    in_place: tuple[int, ...] = (),
) -> Entry | None:
    """Trace ``fn`` (the node's call over the op's inputs) into compiled graphs, or None where it cannot be.

    ``grad_mask`` says which inputs need a gradient (none: an inference graph). ``scopes``:
    the node's scope for its forward, and one for its backward (the same precision, reported
    as the backward phase). The trace runs on fresh fake tensors, outside the parent's trace.
    A scope entered while tracing (a nested scoped node) refuses with
    :class:`Fp32ScopeError`, as in any traced code: such a node is not compiled.

    ``updates``: the inputs an inference graph's node updates in place (a static cache's
    keys), exactly those: the graph updates none, it returns their new values first, in
    input order, then ``fn``'s outputs (the caller writes them back). A node that updates
    any other input, or not those, is not compiled. Those of them also in ``in_place`` (a
    cache's keys and values) the graph updates where they are instead, and does not return:
    the entry's op is then ``inner_update_N``, which declares that it writes them.
    """
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._guards.tracing(None), _own_node_meta():
        mode = FakeTensorMode()
        with mode:
            fakes = [
                torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device).requires_grad_(
                    bool(grad_mask >> i & 1)
                )
                for i, v in enumerate(values)
            ]
        try:
            with torch.enable_grad() if grad_mask else torch.no_grad():
                graph, meta = export_node_graph(fn, tuple(fakes), select_decomp_table(), joint=bool(grad_mask))
        except Fp32ScopeError:
            return None
        from torch._functorch._aot_autograd.schemas import OutputType

        # Outputs AOTAutograd hands back as the graph returns them (a new tensor, or one made
        # by _unsafe_view of an intermediate); any other kind it rebuilds outside the graph.
        plain = {getattr(OutputType, n, None) for n in ("non_alias", "unsafe_view_alias", "custom_function_view")}
        updated = tuple(i for i, info in enumerate(meta.input_info) if info.mutates_data)
        if (
            updated != updates
            or (updated and grad_mask)
            or any(i.mutates_metadata or getattr(i, "mutates_storage_metadata", False) for i in meta.input_info)
            or any(o.output_type not in plain for o in meta.output_info)
        ):
            return None
        # Inductor's own passes over a joint (or inference) graph, as its compile_fx runs
        # them: random ops become its seeded ones, patterns its fused forms.
        joint_graph_passes(graph)
        n_out = len(meta.output_info)
        if not grad_mask:
            # (An op that writes its arguments returns at least one tensor here: see _update_op.)
            if in_place and len(meta.output_info) + len(updated) > len(in_place):
                _write_in_place(graph, updated, in_place)
            else:
                in_place = ()
            return Entry(scopes[0], _Graph(graph, is_inference=True), n_out=n_out, in_place=in_place)
        tangents = tuple(i for i, o in enumerate(meta.output_info) if o.requires_grad)
        primals = [n for n in graph.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
        tangent_nodes = [n for n in graph.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
        fw, bw = min_cut_rematerialization_partition(
            graph,
            [[p.meta["val"] for p in primals], [t.meta["val"] for t in tangent_nodes]],
            compiler="inductor",
            num_fwd_outputs=n_out,
        )
        grads = tuple(g is not None for g in _output_nodes(bw))
        sources = _save_bases(fw, bw, n_out)
        return Entry(
            scopes[0],
            _Graph(fw),
            _Graph(bw, is_backward=True),
            backward_scope=scopes[1],
            n_out=n_out,
            tangents=tangents,
            grads=grads,
            sources=sources,
        )


def _write_in_place(graph: torch.fx.GraphModule, updated: tuple[int, ...], in_place: tuple[int, ...]) -> None:
    """Make an inference graph write the new values of its ``in_place`` inputs into them, not return them.

    Its outputs start with the new values of the ``updated`` inputs, in input order. The
    graph ends with a ``copy_`` into each of them instead, the form AOTAutograd gives
    Inductor for a graph's input updates, which Inductor turns into the update itself: one
    position of a cache written, not the whole cache copied.
    """
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    values = list(output.args[0])
    kept = []
    with graph.graph.inserting_before(output):
        for i, new in zip(updated, values, strict=False):
            if i in in_place:
                graph.graph.call_function(torch.ops.aten.copy_.default, (placeholders[i], new))
            else:
                kept.append(new)
    output.args = ([*kept, *values[len(updated) :]],)
    graph.recompile()


@contextlib.contextmanager
def _own_node_meta() -> Iterator[None]:
    # The node's graphs take none of the meta of the parent's node being traced: inside a
    # checkpointed region that meta says "recompute", which would make every node of them
    # one the partition must recompute (it then finds no cut).
    traceback = torch.fx.traceback
    saved = (traceback.current_meta, traceback.should_preserve_node_meta)
    traceback.current_meta, traceback.should_preserve_node_meta = {}, False
    try:
        yield
    finally:
        traceback.current_meta, traceback.should_preserve_node_meta = saved


def _is_view(node: Any) -> bool:
    target = node.target
    if node.op == "call_function" and target is operator.getitem:  # one of a split's views
        return isinstance(node.args[0], torch.fx.Node) and _is_view(node.args[0])
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    if len(returns) != 1 or returns[0].alias_info is None or returns[0].alias_info.is_write:
        return False
    others = [*node.args[1:], *node.kwargs.values()]
    return not any(isinstance(leaf, torch.fx.Node) for leaf in torch.utils._pytree.tree_leaves(others))


def _save_bases(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, n_out: int) -> tuple[tuple[int, int], ...]:
    """Make the backward take what it reads as the bases of their views, replayed inside it.

    An op's output may not alias its input, and the partition saves views of the inputs (a
    Linear's weight, transposed twice) and the inputs themselves: leaving the op, each would
    be a copy (a weight's, at every step). Instead the backward graph takes each saved
    tensor's base (an input of the forward, one of its outputs, or a tensor it saves) and
    replays the views itself. Returns where each of the backward's saved inputs comes from:
    (0, i) the forward's input i, (1, j) its output j (the node's outputs, then what it saves).
    """
    fw_output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = list(fw_output.args[0])
    inputs = [n for n in fw.graph.nodes if n.op == "placeholder"]
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    holders = placeholders[: len(outs) - n_out]
    kept = outs[:n_out]
    sources: list[tuple[int, int]] = []
    bases: dict[Any, Any] = {}  # base (a forward node) -> its new placeholder in the backward
    body = next(n for n in bw.graph.nodes if n.op != "placeholder")
    # The new placeholders go where the saved ones were: before the tangents.
    anchor = placeholders[len(holders)] if len(placeholders) > len(holders) else body
    for saved, holder in zip(outs[n_out:], holders, strict=True):
        chain = []
        base = saved
        while _is_view(base):
            chain.append(base)
            base = base.args[0]
        if base not in bases:
            with bw.graph.inserting_before(anchor):
                placeholder = bw.graph.placeholder(f"{holder.name}_base")
            placeholder.meta["val"] = base.meta["val"]
            bases[base] = placeholder
            if base.op == "placeholder":
                sources.append((0, inputs.index(base)))
            else:
                if base not in kept:
                    kept.append(base)
                sources.append((1, kept.index(base)))
        value = bases[base]
        with bw.graph.inserting_before(body):
            for view in reversed(chain):
                replayed = bw.graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
                replayed.meta["val"] = view.meta["val"]
                value = replayed
        holder.replace_all_uses_with(value)
        bw.graph.erase_node(holder)
    fw_output.args = (tuple(kept),)
    fw.graph.eliminate_dead_code()
    fw.recompile()
    bw.graph.lint()
    bw.recompile()
    return tuple(sources)


def is_static(value: torch.Tensor) -> bool:
    """Whether a tensor's sizes, strides and offset are plain ints (not symbols of dynamic shapes)."""
    return all(type(s) is int for s in (*value.shape, *value.stride(), value.storage_offset()))
