"""Seeing what each scoped call ran in: :func:`trace`, its events and their table.

The scope's layer calls this layer's recorder (installed with the first trace, see
``fp32scope._flags.hooks``) at each wrapper scope's entry while a trace is open: the event
holds what the flags read inside the scope, and is read again as the call returns.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, NamedTuple, cast

from fp32scope._flags.hooks import Phase, install_recorder, open_traces, show
from fp32scope._flags.precision import Fp32Precision
from fp32scope._flags.process import current_fp32_precision

__all__ = ["Fp32Trace", "Fp32TraceEvent", "trace"]


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


class Fp32Trace(list[Fp32TraceEvent]):
    """The events of one :func:`trace`, in call order; ``str()`` gives them as a table."""

    def table(self) -> str:
        """One line per event: node, phase, precision, observed, whether they match, thread."""
        header = ("node", "phase", "precision", "observed", "match", "thread")
        rows = [header]
        rows += [
            (e.name, e.phase, show(e.precision), show(e.observed), "yes" if e.matches else "NO", e.thread)
            for e in list(self)
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)

    def __str__(self) -> str:
        return self.table()


_lock = threading.Lock()


def _record(name: str, phase: Phase, precision: Fp32Precision) -> Fp32TraceEvent:
    # Called at a wrapper scope's entry, after it applied its precision, while a trace is
    # open. list.append is atomic: events from several threads (an autograd device thread
    # running a backward, a forward thread) land whole, in the order they happened.
    event = Fp32TraceEvent(name, phase, precision, current_fp32_precision(), threading.current_thread().name)
    for events in open_traces[:]:
        events.append(event)
    return event


def _returned(event: object) -> None:
    # Called as the call returns, before its scope restores the flags: an event whose
    # wrapped code changed them gets what they hold now, in every open trace.
    now = current_fp32_precision()
    made = cast("Fp32TraceEvent", event)
    if now == made.observed:
        return
    new = made._replace(observed=now)
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
    # current_fp32_precision is called from a wrapper's frames, which a compiled caller's
    # Dynamo must not convert (it would read the flags once, at trace time).
    install_recorder(_record, _returned, current_fp32_precision)
    events = Fp32Trace()
    with _lock:
        open_traces.append(events)
    try:
        yield events
    finally:
        with _lock:
            # By identity: two traces' lists may be equal.
            del open_traces[next(i for i, t in enumerate(open_traces) if t is events)]


# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
Fp32TraceEvent.__module__ = "fp32scope"
Fp32Trace.__module__ = "fp32scope"
