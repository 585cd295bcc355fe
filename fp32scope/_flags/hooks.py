"""The scope's hook point for what observes scoped calls: :func:`~fp32scope.trace` and torch's profiler.

Every wrapper scope (the scope of an :class:`~fp32scope.Fp32ScopedModule` or a
:func:`~fp32scope.with_fp32_precision` function, and the scope a recorded call's backward
runs in) calls :func:`entered` at the end of its ``__enter__`` while a trace is open or a
profiler records, and :func:`exited` at the start of its ``__exit__`` while an entry left a
profiler range or a trace event to close. Otherwise each scoped call pays two cheap reads on
entry (the list of open traces, and the Python flag torch's profilers set while they record)
and one on exit.

The profiler ranges are made here. Trace events are made by the trace layer
(``fp32scope._wrappers.trace``), which installs its recorder with its first trace: this
layer knows neither the events nor their table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal, Protocol

import torch.autograd.profiler

from fp32scope._flags import dynamo_exclude
from fp32scope._flags.precision import Fp32Precision

__all__ = [
    "BACKWARD",
    "FORWARD",
    "Entered",
    "Phase",
    "entered",
    "exited",
    "install_recorder",
    "open_ranges",
    "open_traces",
    "profiler_state",
    "range_name",
    "show",
]

Phase = Literal["forward", "backward"]
FORWARD: Final = "forward"
BACKWARD: Final = "backward"

# The event lists of the open traces, outermost first. Changed by the trace layer under its
# lock (in place: the scope module holds this list); read without it, as a copy (a slice is
# atomic under the GIL), from whichever thread runs a scoped call.
open_traces: list[list[Any]] = []
# What a traced or profiled entry leaves for its exit, innermost last: (scope depth,
# record_function) for each open profiler range, and (scope depth, event) for each event a
# trace recorded, which the exit checks against the flags the wrapped code left. Scoped
# calls nest strictly across threads (one thread holds scopes at a time; an autograd device
# thread only while the owner waits on its backward), so the depth at entry says which exit
# ends it. One list, so that a scope's exit pays one read for both features.
open_ranges: list[tuple[int, Any]] = []
# The trace layer's (record, returned): record(name, phase, precision) makes a call's event
# and appends it to every open trace; returned(event) re-reads the flags as the call returns.
_recorder: list[tuple[Callable[[str, Phase, Fp32Precision], object], Callable[[object], None]]] = []
# Read on every scoped call: torch's own Python flag, set while torch.profiler.profile or
# torch.autograd.profiler.profile (emit_nvtx, emit_itt) records (every supported torch has
# it); a C call would cost more. Read from the profiler module's dict, not the module: a
# module of torch among a frame's globals makes Dynamo's frame callback convert that frame
# (the scope's __enter__).
profiler_state: dict[str, Any] = vars(torch.autograd.profiler)
_PROFILER_FLAG: Final = "_is_profiler_enabled"
_record_function = torch.autograd.profiler.record_function


class Entered(Protocol):
    """What :func:`entered` reads of a scope (an ``fp32_precision_scope``; its ``_phase``, if any, too)."""

    _name: str | None

    @property
    def precision(self) -> Fp32Precision | None:
        """The precision the scope applies."""


def install_recorder(
    record: Callable[[str, Phase, Fp32Precision], object],
    returned: Callable[[object], None],
    *callees: Callable[..., object],
) -> None:
    """Make trace events with ``record`` and re-read them with ``returned``; the first call counts.

    Dynamo skips the frames of both, and of ``callees``, the functions they call: they run
    inside a compiled caller's scoped calls.
    """
    if not _recorder:
        dynamo_exclude.exclude(record, returned, *callees, graph_break=False)
        _recorder.append((record, returned))


def show(precision: Fp32Precision) -> str:
    """A precision as tables and ranges show it: matmul precision/cuDNN TF32, ``-`` for a field left alone."""
    cudnn = {None: "", True: "/cudnn-tf32", False: "/cudnn-fp32"}[precision.cudnn_allow_tf32]
    return f"{precision.matmul or '-'}{cudnn}"


def range_name(name: str, phase: str, precision: Fp32Precision) -> str:
    """The profiler range name of a scoped call: ``fp32scope <name> <phase> <precision>``."""
    return f"fp32scope {name} {phase} {show(precision)}"


def entered(scope: Entered, depth: int) -> None:
    """Record a wrapper scope's entry (``depth``: the scope nesting depth, this one included).

    Runs after the scope applied its precision; should recording fail, the scope exits
    (restores the flags) before the error propagates.
    """
    name = scope._name
    if name is None:  # a plain fp32_precision_scope, not a wrapper's
        return
    phase: Phase = getattr(scope, "_phase", FORWARD)
    precision = scope.precision
    if precision is None:  # pragma: no cover  (a scope that applies nothing has no entry)
        return
    if open_traces and _recorder:
        open_ranges.append((depth, _recorder[0][0](name, phase, precision)))
    if profiler_state[_PROFILER_FLAG]:
        rf = _record_function(range_name(name, phase, precision))
        rf.__enter__()  # type: ignore[no-untyped-call]
        open_ranges.append((depth, rf))


def exited(depth: int, *, observe: bool = True) -> None:
    """Close what the entry at ``depth`` left open: its profiler range, its trace event.

    Runs before the scope restores the flags. With ``observe``, an event whose wrapped code
    changed the flags is re-read by the trace layer.
    """
    while open_ranges and open_ranges[-1][0] == depth:
        left = open_ranges.pop()[1]
        if type(left) is _record_function:
            left.__exit__(None, None, None)
        elif observe:
            _recorder[0][1](left)


dynamo_exclude.exclude(entered, exited, range_name, show, graph_break=False)
