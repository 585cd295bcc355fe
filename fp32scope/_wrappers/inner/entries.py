"""Compiled-inside entries: a region call's graphs for one layout, numbered, registered, and chosen per call.

:class:`Entry` (the graphs and what the trace found), the registry of live entries by
number that the ops read at every call, the node's plain attributes the graphs were traced
with (:func:`node_state`) and the check that they still hold (:func:`state_holds`), the
graphs traced again for other values of them (:func:`variant`), and the entry the forward
and the backward ops run (``_checked_entry``, ``_backward_entry``).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch

from fp32scope._compat import recompile_limit
from fp32scope._errors import Fp32ScopeError
from fp32scope._flags import dynamo_exclude
from fp32scope._wrappers.inner.graphs import _Graph, _output_nodes

_numbers = itertools.count(1)
# An entry's number holds random bits of its process, as a region's does: Inductor's and
# AOTAutograd's caches on disk serve a graph to another process, where the same number would
# name another node's graphs.
_PROCESS: Final = secrets.randbits(24) << 32
# Each live entry by number, read by the ops at every call: a plain dict of weak references
# (a WeakValueDictionary's lookup is Python code), each removing itself with its entry.
_entries: dict[int, weakref.ReferenceType[Entry]] = {}


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


dynamo_exclude.exclude(
    _entry,
    _checked_entry,
    _backward_entry,
    variant,
    state_holds,
    _changed,
    graph_break=False,
)
