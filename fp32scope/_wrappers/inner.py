"""Compiled regions: a region's node compiled by Inductor inside its op, in the node's precision.

Where a compiled parent's graph goes to Inductor, a region's call is traced as the node's
own graphs instead of one call that runs the node eagerly: while AOTAutograd traces the
parent, the node is traced functionally on fake tensors of the call's layout (its
arguments, parameters and buffers as inputs) with Inductor's decompositions, and, where a
gradient is needed, its joint graph is split as Inductor splits one. The parent's graph
then holds ``fp32scope::inner`` (no gradient), or ``fp32scope::inner_fwd`` and
``fp32scope::inner_bwd`` joined by the tensors the backward needs, which the parent's
graph carries from one to the other as any saved tensor: no table, no token, and a
second backward (``retain_graph=True``) works as it does for the parent alone.

Each graph is compiled by Inductor the first time it runs, inside the node's scope, so that
code generation (Triton's TF32 switches, the CPU's packed bf16 linear) sees the node's
precision; its kernels run in the scope too, at every call.

What is compiled inside is what the trace can hold exactly. A call is left to the eager
region (the node run eagerly inside the op) where the node updates a buffer, carries a
cache with a gradient needed, updates or binds a carried cache's tensors otherwise than the
eager region's run on fake tensors found, returns a view of an input, takes an int that
varies between calls or a tensor of symbolic shape, has hooks (they run at every call in an
eager region), enters a scope of its own (a nested scoped node), or where the trace fails:
:func:`build` returns None. Without a gradient, a static cache's keys and values, which the
node updates in place, are the graph's inputs, and their new values its first outputs,
written back by the parent's graph as the eager region's are.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, cast

import torch

from fp32scope._compat import export_node_graph, graph_callable, recompile_limit
from fp32scope._errors import Fp32ScopeError
from fp32scope._flags import dynamo_exclude

__all__ = ["Entry", "Like", "apply", "build", "is_static", "node_state", "state_holds", "variant", "wants_inductor"]

_lib = torch.library.Library("fp32scope", "FRAGMENT")  # type: ignore[no-untyped-call]  # torch's untyped API
_numbers = itertools.count(1)
# An entry's number holds random bits of its process, as a region's does: Inductor's and
# AOTAutograd's caches on disk serve a graph to another process, where the same number would
# name another node's graphs.
_PROCESS: Final = secrets.randbits(24) << 32
# Each live entry by number, read by the ops at every call: a plain dict of weak references
# (a WeakValueDictionary's lookup is Python code), each removing itself with its entry.
_entries: dict[int, weakref.ReferenceType[Entry]] = {}
_INDUCTOR_FILE: Final = "_inductor/compile_fx.py"


def wants_inductor() -> bool:
    """Whether the graph being traced goes to Inductor (its ``compile_fx`` is on the stack)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith(_INDUCTOR_FILE):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Graph:
    """One of an entry's graphs, compiled on its first run inside the node's scope."""

    __slots__ = (
        "compiled",
        "copies",
        "example",
        "fast",
        "gm",
        "inputs",
        "is_backward",
        "is_inference",
        "lock",
        "outputs",
        "relayout",
        "strides",
    )

    def __init__(self, gm: torch.fx.GraphModule, *, is_backward: bool = False, is_inference: bool = False) -> None:
        self.gm = gm
        self.is_backward = is_backward
        self.is_inference = is_inference
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.example = [n.meta["val"] for n in placeholders]
        # The layouts it is compiled for: inputs and outputs are made to match at run time.
        self.inputs = [_layout(v) for v in self.example]
        self.outputs = [None if v is None else _layout(v.meta["val"]) for v in _output_nodes(gm)]
        self.strides = [None if layout is None else layout[1] for layout in self.inputs]
        self.compiled: Callable[[list[Any]], Sequence[Any]] | None = None
        self.lock = threading.Lock()
        # Set by the first run: the compiled code to call from then on, and the outputs it
        # lays out otherwise than declared or hands back aliasing an input or another
        # output. Both are properties of the generated code, the same at every call.
        self.fast: Callable[[list[Any]], Sequence[Any]] | None = None
        self.relayout: tuple[int, ...] = ()
        self.copies: tuple[int, ...] = ()

    def run(self, values: list[torch.Tensor]) -> list[Any]:
        """The graph's outputs for ``values``, laid out as declared, none aliasing an input or another output."""
        fast = self.fast
        if fast is None:
            return self._first_run(values)
        if [v.stride() for v in values] == self.strides:
            out = list(fast(list(values)))  # the compiled code empties the list it is given
        else:
            out = list(fast([_as_layout(v, layout) for v, layout in zip(values, self.inputs, strict=True)]))
        outputs = self.outputs
        for i in self.relayout:
            out[i] = _as_layout(out[i], outputs[i])
        for i in self.copies:
            out[i] = _copy(out[i])
        return out

    def _first_run(self, values: list[torch.Tensor]) -> list[Any]:
        compiled = self.compiled if self.compiled is not None else self._compile()
        args = [_as_layout(v, layout) for v, layout in zip(values, self.inputs, strict=True)]
        given = [*values, *args]  # an output aliasing either would alias the input at a later call
        out = list(compiled(args))
        relayout = tuple(
            i
            for i, (o, layout) in enumerate(zip(out, self.outputs, strict=True))
            if o is not None and layout is not None and o.stride() != layout[1]
        )
        for i in relayout:
            out[i] = _as_layout(out[i], self.outputs[i])
        copies = _aliased(out, given)
        for i in copies:
            out[i] = _copy(out[i])
        with self.lock:
            self.relayout, self.copies = relayout, copies
            self.fast = graph_callable(compiled)
        return out

    def _compile(self) -> Callable[[list[Any]], Sequence[Any]]:
        import torch._inductor.config
        from torch._inductor.compile_fx import compile_fx_inner

        with self.lock:
            if self.compiled is None:
                kwargs: dict[str, Any] = {"is_backward": self.is_backward}
                if self.is_inference:
                    kwargs["is_inference"] = True
                # No size assertions on its inputs: run() lays them out as compiled for.
                with torch._guards.tracing(None), torch._inductor.config.patch(size_asserts=False):
                    self.compiled = cast(
                        "Callable[[list[Any]], Sequence[Any]]", compile_fx_inner(self.gm, self.example, **kwargs)
                    )
            return self.compiled


def _layout(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(value.shape), tuple(value.stride())


def _as_layout(value: torch.Tensor, layout: tuple[tuple[int, ...], tuple[int, ...]] | None) -> torch.Tensor:
    # The compiled graph assumes the strides it was compiled for (compiled without its size
    # assertions, see _compile): an incoming gradient may be an expanded one, an output of
    # the compiled code laid out otherwise than the op's fake kernel declared.
    if layout is None or value.stride() == layout[1]:
        return value
    out = torch.empty_strided(layout[0], layout[1], dtype=value.dtype, device=value.device)
    out.copy_(value)
    return out


def _copy(value: torch.Tensor) -> torch.Tensor:
    # Laid out as the original (strides, gaps), which the op's fake kernel declared.
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).copy_(value)


def _aliased(outputs: list[Any], inputs: Sequence[torch.Tensor]) -> tuple[int, ...]:
    # An op's output may alias neither its inputs nor another output (AOTAutograd and
    # Inductor assume it): a compiled graph hands back an input, or one buffer as two views.
    seen = {t.untyped_storage()._cdata for t in inputs}
    found = []
    for i, o in enumerate(outputs):
        if o is None:
            continue
        storage = o.untyped_storage()._cdata
        if storage in seen:
            found.append(i)
        else:
            seen.add(storage)
    return tuple(found)


def _output_nodes(gm: torch.fx.GraphModule) -> list[Any]:
    return list(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])


class Entry:
    """A region call's compiled graphs, for one layout of its inputs."""

    __slots__ = (
        "__weakref__",
        "backward",
        "backward_scope",
        "forward",
        "grads",
        "in_place",
        "last",
        "lock",
        "n_out",
        "name",
        "number",
        "retrace",
        "scope",
        "sources",
        "state",
        "tangents",
        "traced",
        "variants",
        "watched",
    )

    def __init__(  # noqa: PLR0913  (what the trace found, kept together)
        self,
        scope: Any,
        forward: _Graph,
        backward: _Graph | None = None,
        *,
        backward_scope: Any = None,
        n_out: int,
        tangents: tuple[int, ...] = (),
        grads: tuple[bool, ...] = (),
        sources: tuple[tuple[int, int], ...] = (),
        in_place: tuple[int, ...] = (),
    ) -> None:
        self.number = _PROCESS | next(_numbers)
        self.scope = scope  # the node's precision scope
        self.backward_scope = backward_scope  # the same precision, entered as the node's backward
        self.forward = forward
        self.backward = backward
        self.n_out = n_out  # the node's tensor outputs (the forward's first outputs)
        self.tangents = tangents  # the outputs a gradient flows back from, by position
        self.grads = grads  # per input: whether the backward graph returns its gradient
        self.sources = sources  # what the backward takes first: (0, input) or (1, forward output)
        self.in_place = in_place  # the inputs the forward graph updates where they are (ascending)
        # The node's plain attributes the graphs were traced with (see hold), and its name.
        self.state: tuple[tuple[dict[str, Any], str, object], ...] = ()
        self.watched: list[tuple[dict[str, Any], str]] = []
        self.traced: list[object] = []
        self.name = ""
        # The node's graphs traced again for other values of those attributes, by value
        # (see variant), and what traces them: set by the region, None where it cannot.
        self.retrace: Callable[[], Entry | None] | None = None
        self.variants: dict[tuple[object, ...], Entry] = {}
        self.last: Entry = self  # the graphs the last forward ran, which its backward must match
        self.lock = threading.Lock()
        _entries[self.number] = weakref.ref(self, _forget(self.number))

    def hold(self, state: tuple[tuple[dict[str, Any], str, object], ...], name: str) -> None:
        """Note the node's name and the plain attributes (:func:`node_state`) its graphs were traced with."""
        self.state = state
        self.watched = [(attributes, key) for attributes, key, _ in state]
        self.traced = [value for *_, value in state]
        self.name = name

    def signature(self) -> tuple[Any, ...]:
        """What the parent's graph holds of these graphs: the ops' outputs and what the backward takes."""
        outputs = _output_nodes(self.forward.gm)
        dtypes = tuple(None if o is None else o.meta["val"].dtype for o in outputs)
        return (self.n_out, self.tangents, self.grads, self.sources, self.in_place, self.forward.outputs, dtypes)


def _forget(number: int) -> Callable[[object], None]:
    def forget(_: object) -> None:
        _entries.pop(number, None)

    return forget


def _entry(number: int) -> Entry:
    # An op of a compiled graph that outlived its node (the module freed, the graph kept).
    ref = _entries.get(number)
    entry = None if ref is None else ref()
    if entry is None:
        msg = (
            f"A compiled graph called compiled-inside region entry {number}, whose scoped node was freed while "
            "the graph was kept. Compile the parent again (torch.compiler.reset(), then call it)."
        )
        raise Fp32ScopeError(msg)
    return entry


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


# -- the ops ------------------------------------------------------------------------------

# ``site`` keeps two calls of one node apart (a node drawing random numbers gives two
# results), ``entry`` names the graphs.
_lib.define("inner(int site, int entry, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]
_lib.define("inner_fwd(int site, int entry, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]
_lib.define("inner_bwd(int site, int entry, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]


def node_state(module: object) -> tuple[tuple[dict[str, Any], str, object], ...]:
    """The plain attributes (numbers, strings, None) of a module and its submodules, as they are now."""
    if not isinstance(module, torch.nn.Module):
        return ()
    return tuple(
        (attributes, name, value)
        for sub in module.modules()
        for attributes in (vars(sub),)
        for name, value in attributes.items()
        if not name.startswith("_") and type(value) in _PLAIN
    )


_PLAIN: Final = (bool, int, float, str, type(None))
_GONE: Final = object()


def state_holds(entry: Entry) -> bool:
    """Whether the node's plain attributes are still those its graphs were traced with."""
    # One list comparison (identity first, then ==), at every call of the op.
    return [attributes.get(name, _GONE) for attributes, name in entry.watched] == entry.traced


def _changed(entry: Entry) -> str:
    """The first of the node's plain attributes that differs from the value ``entry`` was traced with."""
    for attributes, name, value in entry.state:
        now = attributes.get(name, _GONE)
        if not (now is value or now == value):
            return f"its attribute {name!r} = {value!r}, now {'deleted' if now is _GONE else repr(now)}"
    return "its attributes"  # (changed back meanwhile, by another thread)


def variant(entry: Entry) -> Entry:
    """The node's graphs for its plain attributes as they are now: ``entry`` or one traced again for them.

    As plain ``torch.compile`` recompiles a frame whose module attributes changed, the node's
    graphs are traced again for the new values and kept per value, as many as Dynamo's
    recompile limit allows. The parent's compiled graph holds what the ops return, so graphs
    traced again must return the same: a change that alters the outputs' number, shapes or
    dtypes, or what the backward takes, is an error saying to compile the parent again.
    """
    key = tuple(attributes.get(name, _GONE) for attributes, name in entry.watched)
    found = entry.variants.get(key)
    if found is not None:
        return found
    with entry.lock:
        found = entry.variants.get(key)
        if found is not None:
            return found
        what = _changed(entry)
        limit = recompile_limit()
        if entry.retrace is not None and len(entry.variants) + 1 >= limit:
            msg = (
                f"Scoped node {entry.name!r} is compiled inside its region (Inductor), and {what}: its graphs "
                f"were traced for {len(entry.variants) + 1} values of its attributes already, Dynamo's recompile "
                f"limit ({limit}; torch._dynamo.config.recompile_limit). Raise the limit, compile the parent "
                "again (torch.compiler.reset(), then call it), or make the node eager=True (its Python run at "
                "every call)."
            )
            raise Fp32ScopeError(msg)
        found = None if entry.retrace is None else entry.retrace()
        if found is None or found.signature() != entry.signature():
            how = (
                "could not be traced again for the new values"
                if found is None
                else "traced again for the new values, returns other outputs than the compiled parent holds"
            )
            msg = (
                f"Scoped node {entry.name!r} is compiled inside its region (Inductor), and {what}; the node {how}. "
                "Compile the parent again (torch.compiler.reset(), then call it), or make the node eager=True "
                "(its Python run at every call)."
            )
            raise Fp32ScopeError(msg)
        entry.variants[key] = found
        return found


def _checked_entry(number: int) -> Entry:
    entry = _entry(number)
    # One list comparison at every call; a changed attribute picks (or traces) its graphs.
    chosen = entry if state_holds(entry) else variant(entry)
    entry.last = chosen
    return chosen


def _backward_entry(number: int) -> Entry:
    entry = _entry(number)
    chosen = entry if state_holds(entry) else variant(entry)
    if chosen is not entry.last:
        msg = (
            f"Scoped node {entry.name!r} is compiled inside its region (Inductor), and {_changed(entry.last)} "
            "between its forward and its backward: the backward would not be the forward's. Change a node's "
            "attributes between training steps, not between a forward and its backward."
        )
        raise Fp32ScopeError(msg)
    return chosen


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
    _aliased,
    _as_layout,
    _returned,
    _copy,
    _entry,
    _checked_entry,
    _backward_entry,
    variant,
    state_holds,
    _changed,
    _Graph.run,
    _Graph._first_run,
    _Graph._compile,
    graph_break=False,
)
