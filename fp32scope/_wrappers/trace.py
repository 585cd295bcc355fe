"""Seeing what each scoped call ran in: :func:`trace`, and ranges for torch's profiler.

Every wrapper scope (the scope of an :class:`~fp32scope.Fp32ScopedModule` or a
:func:`~fp32scope.with_fp32_precision` function, and the scope a recorded call's backward
runs in) calls :func:`entered` at the end of its ``__enter__`` while a :func:`trace` is open
or a profiler records, and :func:`exited` at the start of its ``__exit__`` while an entry
left a profiler range or a trace event to close. Otherwise each scoped call pays two cheap
reads on entry (this module's list of open traces, and the Python flag torch's profilers
set while they record) and one on exit.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

import torch.autograd.profiler

from fp32scope import _dynamo_exclude
from fp32scope._precision import Fp32Precision

if TYPE_CHECKING:
    from fp32scope._scope import fp32_precision_scope

__all__ = [
    "Fp32Trace",
    "Fp32TraceEvent",
    "entered",
    "exited",
    "open_ranges",
    "open_traces",
    "profiler_state",
    "trace",
]

Phase = Literal["forward", "backward"]
FORWARD: Final = "forward"
BACKWARD: Final = "backward"


class Fp32TraceEvent(NamedTuple):
    """One scoped call seen by :func:`trace`.

    ``name`` is the wrapper's name (its ``name`` argument, else the wrapped module's class
    name or the function's qualified name); ``phase`` is ``"forward"`` for a call of the
    wrapper (its first, compiling call included) and ``"backward"`` for the backward of a
    call that recorded autograd history; ``precision`` is what the wrapper applies;
    ``observed`` is :func:`~fp32scope.current_fp32_precision` read inside the scope, after
    the precision was applied, or, when the wrapped code changed the flags the scope applied
    (the scope then warns :class:`~fp32scope.Fp32FlagsChangedWarning`), read again when it
    returned; ``thread`` is the name of the thread the call ran on
    (autograd's device threads are named ``Dummy-N`` by Python).
    """

    name: str
    phase: Literal["forward", "backward"]
    precision: Fp32Precision
    observed: Fp32Precision
    thread: str

    @property
    def matches(self) -> bool:
        """True when ``observed`` holds every field that ``precision`` sets."""
        p, o = self.precision, self.observed
        return (p.matmul is None or p.matmul == o.matmul) and (
            p.cudnn_allow_tf32 is None or p.cudnn_allow_tf32 == o.cudnn_allow_tf32
        )


def _show(precision: Fp32Precision) -> str:
    # matmul precision/cuDNN TF32, as the demo's table shows them; "-" for a field left alone.
    cudnn = {None: "", True: "/cudnn-tf32", False: "/cudnn-fp32"}[precision.cudnn_allow_tf32]
    return f"{precision.matmul or '-'}{cudnn}"


class Fp32Trace(list[Fp32TraceEvent]):
    """The events of one :func:`trace`, in call order; ``str()`` gives them as a table."""

    def table(self) -> str:
        """One line per event: node, phase, precision, observed, whether they match, thread."""
        header = ("node", "phase", "precision", "observed", "match", "thread")
        rows = [header]
        rows += [
            (e.name, e.phase, _show(e.precision), _show(e.observed), "yes" if e.matches else "NO", e.thread)
            for e in list(self)
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)

    def __str__(self) -> str:
        return self.table()


# The lists of the open traces, outermost first. Changed under _lock (in place: the scope
# module holds this list); read without it, as a copy (a slice is atomic under the GIL),
# from whichever thread runs a scoped call. list.append of an event is atomic as well, so
# events from several threads (an autograd device thread running a backward, a forward
# thread) land whole, in the order they happened.
open_traces: list[Fp32Trace] = []
_lock = threading.Lock()
# What a traced or profiled entry leaves for its exit, innermost last: (scope depth,
# record_function) for each open profiler range, and (scope depth, event) for each event a
# trace recorded, which the exit checks against the flags the wrapped code left. Scoped
# calls nest strictly across threads (one thread holds scopes at a time; an autograd device
# thread only while the owner waits on its backward), so the depth at entry says which exit
# ends it. One list, so that a scope's exit pays one read for both features.
open_ranges: list[tuple[int, Any]] = []
# Read on every scoped call: torch's own Python flag, set while torch.profiler.profile or
# torch.autograd.profiler.profile (emit_nvtx, emit_itt) records; a C call would cost more.
# Read from the profiler module's dict, not the module: a module of torch among a frame's
# globals makes Dynamo's frame callback convert that frame (the scope's __enter__).
_record_function = torch.autograd.profiler.record_function
_current: list[Callable[[], Fp32Precision]] = []
_PROFILER_FLAG: Final = "_is_profiler_enabled"

# torch's own Python flag for "a profiler records" (every supported torch has it, 2.2 and
# later), read through the module's dict (see above).
profiler_state: dict[str, Any] = vars(torch.autograd.profiler)


def range_name(name: str, phase: str, precision: Fp32Precision) -> str:
    """The profiler range name of a scoped call: ``fp32scope <name> <phase> <precision>``."""
    return f"fp32scope {name} {phase} {_show(precision)}"


def entered(scope: fp32_precision_scope, depth: int) -> None:
    """Record a wrapper scope's entry (``depth``: the scope nesting depth, this one included).

    Runs after the scope applied its precision. Should recording fail, the scope is exited
    (the flags restored) before the error propagates: its ``with`` never will.
    """
    name = scope._name
    if name is None:  # a plain fp32_precision_scope, not a wrapper's
        return
    try:
        phase: Phase = getattr(scope, "_phase", FORWARD)
        precision = scope.precision
        if precision is None:  # pragma: no cover  (a scope that applies nothing has no entry)
            return
        traces = open_traces[:]
        if traces and _current:
            event = Fp32TraceEvent(name, phase, precision, _current[0](), threading.current_thread().name)
            for events in traces:
                events.append(event)
            open_ranges.append((depth, event))
        if profiler_state[_PROFILER_FLAG]:
            rf = _record_function(range_name(name, phase, precision))
            rf.__enter__()  # type: ignore[no-untyped-call]
            open_ranges.append((depth, rf))
    except BaseException:
        from fp32scope._scope import fp32_precision_scope

        fp32_precision_scope.__exit__(scope, *sys.exc_info())
        raise


def exited(depth: int, *, observe: bool = True) -> None:
    """Close what the entry at ``depth`` left open: its profiler range, its trace event.

    Runs before the scope restores the flags. With ``observe``, an event whose wrapped code
    changed the flags gets, as ``observed``, the precision they hold now, in every open trace.
    """
    while open_ranges and open_ranges[-1][0] == depth:
        left = open_ranges.pop()[1]
        if type(left) is Fp32TraceEvent:
            if observe:
                _observe_again(left)
        else:
            left.__exit__(None, None, None)


def _observe_again(event: Fp32TraceEvent) -> None:
    now = _current[0]()
    if now == event.observed:
        return
    new = event._replace(observed=now)
    for events in open_traces[:]:
        for i in range(len(events) - 1, -1, -1):
            if events[i] is event:
                events[i] = new
                break


@contextmanager
def trace() -> Iterator[Fp32Trace]:
    """Record every scoped call made while the block runs, on any thread; yields the events.

    The list gets one :class:`Fp32TraceEvent` per call of a wrapper
    (:class:`~fp32scope.Fp32ScopedModule`, :func:`~fp32scope.with_fp32_precision`; its first,
    compiling call included) and one per backward run of a call that recorded autograd
    history, in the order they started, from every thread (autograd's device threads
    included). A plain :class:`~fp32scope.fp32_precision_scope`, and a wrapper whose
    precision changes nothing, make no event. Traces nest: each sees the events of its own
    block. ``str()`` of the list is a table. Outside a trace nothing is recorded, and a scoped
    call pays one read of a module list for it.

    >>> import torch
    >>> from fp32scope import Fp32Precision, Fp32ScopedModule
    >>> head = Fp32ScopedModule(torch.nn.Linear(2, 2), Fp32Precision("highest"))
    >>> with trace() as events:
    ...     y = head(torch.ones(1, 2))
    ...     y.sum().backward()
    >>> [(e.name, e.phase, e.observed.matmul) for e in events]
    [('Linear', 'forward', 'highest'), ('Linear', 'backward', 'highest')]
    """
    if not _current:
        from fp32scope._process import current_fp32_precision

        # Called from a wrapper's frames, which a compiled caller's Dynamo must not convert
        # (it would read the flags once, at trace time).
        _dynamo_exclude.exclude(current_fp32_precision, graph_break=False)
        _current.append(current_fp32_precision)
    events = Fp32Trace()
    with _lock:
        open_traces.append(events)
    try:
        yield events
    finally:
        with _lock:
            # By identity: two traces' lists may be equal.
            del open_traces[next(i for i, t in enumerate(open_traces) if t is events)]


_dynamo_exclude.exclude(entered, exited, _observe_again, range_name, _show, graph_break=False)

# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
Fp32TraceEvent.__module__ = "fp32scope"
Fp32Trace.__module__ = "fp32scope"
