"""fp32scope.trace() and the profiler ranges: what each scoped call ran in, per node and phase."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import fp32scope
from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    Fp32Trace,
    Fp32TraceEvent,
    fp32_precision_scope,
    set_process_default,
    trace,
    with_fp32_precision,
)
from fp32scope._flags import hooks as _hooks
from fp32scope._flags import scope as _scope
from tests._support.common import DEFAULT, FULL
from tests._support.probe import backward

HIGHEST = Fp32Precision("highest")


@pytest.fixture(autouse=True)
def default() -> Iterator[None]:
    set_process_default(DEFAULT)
    yield
    assert _hooks.open_traces == []
    assert _hooks.open_ranges == []


def linear(precision: Fp32Precision | None = FULL, name: str = "head") -> Fp32ScopedModule:
    return Fp32ScopedModule(torch.nn.Linear(3, 3), precision, name=name)


def summary(events: list[Fp32TraceEvent]) -> list[tuple[str, str, str | None]]:
    return [(e.name, e.phase, e.observed.matmul) for e in events]


def test_a_proxy_call_is_one_forward_event() -> None:
    head = linear()
    with trace() as events:
        head(torch.ones(2, 3))
    assert isinstance(events, Fp32Trace)
    thread = threading.current_thread().name
    assert events == [Fp32TraceEvent("head", "forward", FULL, FULL, thread)]
    assert events[0].matches


def test_observed_is_read_inside_the_scope_and_keeps_fields_left_alone() -> None:
    head = linear(HIGHEST)
    with trace() as events, torch.no_grad():
        head(torch.ones(2, 3))
    # The cuDNN field is not the wrapper's: observed shows the process's.
    assert events == [Fp32TraceEvent("head", "forward", HIGHEST, Fp32Precision("highest", True), "MainThread")]


def test_a_decorated_function_is_named_by_its_qualified_name() -> None:
    @with_fp32_precision(Fp32Precision("medium"))
    def double(x: torch.Tensor) -> torch.Tensor:
        return x.mul(2)

    @with_fp32_precision(FULL, name="named")
    def named(x: torch.Tensor) -> torch.Tensor:
        return x

    with trace() as events, torch.no_grad():
        double(torch.ones(1))
        named(torch.ones(1))
    assert [(e.name, e.precision, e.observed) for e in events] == [
        (double.__qualname__, Fp32Precision("medium"), Fp32Precision("medium", True)),
        ("named", FULL, FULL),
    ]


def test_backward_of_a_recorded_call_is_a_backward_event() -> None:
    head = linear()
    x = torch.ones(2, 3, requires_grad=True)
    with trace() as events:
        y = head(x)
        assert summary(events) == [("head", "forward", "highest")]
        backward(y.sum())
    assert summary(events) == [("head", "forward", "highest"), ("head", "backward", "highest")]
    assert all(e.matches and e.precision == FULL for e in events)
    # A call under no_grad records no history: no backward event (and no backward).
    with trace() as events, torch.no_grad():
        head(x)
    assert summary(events) == [("head", "forward", "highest")]


def test_backward_with_create_graph_is_a_backward_event_too() -> None:
    @with_fp32_precision(FULL, name="cube")
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x.pow(3)

    x = torch.ones(2, requires_grad=True)
    with trace() as events:
        (g,) = torch.autograd.grad(cube(x).sum(), x, create_graph=True)
        backward(g.sum())
    phases = [e.phase for e in events]
    assert phases[:2] == ["forward", "backward"]
    assert set(phases[2:]) == {"backward"}
    assert all(e.matches for e in events)
    assert x.grad is not None
    assert torch.equal(x.grad, 6 * x.detach())


def test_a_scoped_node_inside_another_comes_after_it_in_both_phases() -> None:
    inner = linear(FULL, "inner")

    @with_fp32_precision(Fp32Precision("medium"), name="outer")
    def outer(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = inner(x.mul(2)).add(1)
        return out

    with trace() as events:
        backward(outer(torch.ones(2, 3, requires_grad=True)).sum())
    assert summary(events) == [
        ("outer", "forward", "medium"),
        ("inner", "forward", "highest"),
        ("outer", "backward", "medium"),
        ("inner", "backward", "highest"),
    ]
    assert all(e.matches for e in events)


def test_calls_outside_the_trace_are_not_recorded() -> None:
    head = linear()
    head(torch.ones(1, 3))
    with trace() as events:
        pass
    head(torch.ones(1, 3))
    assert events == []
    assert _hooks.open_traces == []


def test_plain_scopes_and_wrappers_that_change_nothing_make_no_event() -> None:
    noop = linear(None, "noop")
    with trace() as events:
        with fp32_precision_scope(FULL):
            pass
        noop(torch.ones(1, 3))
    assert events == []


def test_nested_traces_each_see_their_own_block() -> None:
    first, second = linear(FULL, "first"), linear(HIGHEST, "second")
    with trace() as outer, torch.no_grad():
        first(torch.ones(1, 3))
        with trace() as inner:
            second(torch.ones(1, 3))
        first(torch.ones(1, 3))
    assert [e.name for e in outer] == ["first", "second", "first"]
    assert [e.name for e in inner] == ["second"]


def test_the_same_trace_is_not_left_open_by_an_error() -> None:
    head = linear()
    with pytest.raises(ValueError, match="boom"), trace() as events:
        head(torch.ones(1, 3))
        msg = "boom"
        raise ValueError(msg)
    assert len(events) == 1
    assert _hooks.open_traces == []


def test_a_call_on_another_thread_is_recorded_with_its_thread() -> None:
    head = linear()
    with trace() as events:
        worker = threading.Thread(target=lambda: head(torch.ones(1, 3)), name="forward-thread")
        worker.start()
        worker.join(30)
    assert [(e.name, e.phase, e.thread) for e in events] == [("head", "forward", "forward-thread")]
    assert events[0].matches


def test_the_trace_prints_as_a_table() -> None:
    head = linear()
    with trace() as events:
        backward(head(torch.ones(1, 3, requires_grad=True)).sum())
    lines = str(events).splitlines()
    assert lines[0].split() == ["node", "phase", "precision", "observed", "match", "thread"]
    assert lines[1].split() == ["head", "forward", "highest/cudnn-fp32", "highest/cudnn-fp32", "yes", "MainThread"]
    assert lines[2].split() == ["head", "backward", "highest/cudnn-fp32", "highest/cudnn-fp32", "yes", "MainThread"]
    assert events.table() == str(events)
    # A field the wrapper leaves alone shows as "-" in its precision.
    mismatch = Fp32TraceEvent("n", "forward", Fp32Precision(None, False), Fp32Precision("high", True), "t")
    assert not mismatch.matches
    assert Fp32Trace([mismatch]).table().splitlines()[1].split() == [
        "n",
        "forward",
        "-/cudnn-fp32",
        "high/cudnn-tf32",
        "NO",
        "t",
    ]


class Flips(torch.nn.Module):
    """A node that sets torch's flags itself inside its forward, as some models do."""

    def __init__(self, flip: Callable[[], None]) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)
        self.flip = flip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.flip()
        out: torch.Tensor = self.proj(x)
        return out


def set_matmul_high() -> None:
    torch.set_float32_matmul_precision("high")


def set_cudnn_tf32() -> None:
    torch.backends.cudnn.allow_tf32 = True


def row(events: Fp32Trace, i: int) -> list[str]:
    return events.table().splitlines()[i + 1].split()


def test_a_node_that_changes_the_matmul_precision_inside_is_a_mismatch() -> None:
    head = Fp32ScopedModule(Flips(set_matmul_high), FULL, name="flips")
    with trace() as events, pytest.warns(fp32scope.Fp32FlagsChangedWarning):
        head(torch.ones(1, 3))
    assert len(events) == 1
    assert events[0].observed == Fp32Precision("high", cudnn_allow_tf32=False)  # the cuDNN field still held
    assert not events[0].matches
    assert row(events, 0) == ["flips", "forward", "highest/cudnn-fp32", "high/cudnn-fp32", "NO", "MainThread"]
    assert fp32scope.current_fp32_precision() == DEFAULT  # restored all the same


def test_a_node_that_turns_cudnn_tf32_on_inside_is_a_mismatch() -> None:
    head = Fp32ScopedModule(Flips(set_cudnn_tf32), FULL, name="flips")
    with trace() as events, pytest.warns(fp32scope.Fp32FlagsChangedWarning):
        head(torch.ones(1, 3))
    assert events[0].observed == Fp32Precision("highest", cudnn_allow_tf32=True)  # the matmul field still held
    assert not events[0].matches
    assert row(events, 0)[3:5] == ["highest/cudnn-tf32", "NO"]


def test_a_mismatch_inside_a_scoped_parent_is_its_own_and_every_open_trace_shows_it() -> None:
    inner = Fp32ScopedModule(Flips(set_matmul_high), FULL, name="inner")
    outer = with_fp32_precision(HIGHEST, name="outer")(inner)
    with trace() as outside, trace() as inside, pytest.warns(fp32scope.Fp32FlagsChangedWarning):
        outer(torch.ones(1, 3))
    assert outside == inside
    assert [(e.name, e.matches) for e in inside] == [("outer", True), ("inner", False)]


def test_a_trace_opened_inside_a_call_does_not_blame_an_earlier_call() -> None:
    head = linear()
    with trace():
        head(torch.ones(1, 3))  # an event at this depth, ended cleanly

    def opens_a_trace_and_flips(x: torch.Tensor) -> torch.Tensor:
        with trace() as inner_events:
            set_matmul_high()
        assert inner_events == []
        return x

    with pytest.warns(fp32scope.Fp32FlagsChangedWarning):
        with_fp32_precision(FULL, name="f")(opens_a_trace_and_flips)(torch.ones(1))
    with trace() as events:
        head(torch.ones(1, 3))
    assert [e.matches for e in events] == [True]


def test_public_names() -> None:
    assert fp32scope.trace is trace
    assert {"trace", "Fp32Trace", "Fp32TraceEvent"} <= set(fp32scope.__all__)


# -- a failure while recording ----------------------------------------------------------


class _Refused:
    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:  # pragma: no cover  (never entered)
        pass


def test_a_failure_while_recording_leaves_the_flags_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    # The profiler range cannot be opened (an interrupt at that moment): the scope was
    # applied already, and its ``with`` never exits, so recording must restore it.
    monkeypatch.setattr(_hooks, "_record_function", _Refused)
    head = linear()
    before = fp32scope.current_fp32_precision()
    with torch.profiler.profile(), pytest.raises(KeyboardInterrupt):
        head(torch.ones(1, 3))
    assert fp32scope.current_fp32_precision() == before
    assert _scope.active_scope_thread() is None


# -- profiler ranges --------------------------------------------------------------------


def range_names(events: Any) -> list[str]:
    """The fp32scope ranges among a profiler's events, in order (not the ops of in-graph regions)."""
    return [e.name for e in events if e.name.startswith("fp32scope ")]


def test_profiler_ranges_name_node_phase_and_precision() -> None:
    inner = linear(FULL, "inner")

    @with_fp32_precision(Fp32Precision("medium"), name="outer")
    def outer(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = inner(x.mul(2)).add(1)
        return out

    x = torch.ones(2, 3, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        backward(outer(x).sum())
    assert range_names(prof.events()) == [
        "fp32scope outer forward medium",
        "fp32scope inner forward highest/cudnn-fp32",
        "fp32scope outer backward medium",
        "fp32scope inner backward highest/cudnn-fp32",
    ]
    averages = {e.key: e.count for e in prof.key_averages()}
    assert averages["fp32scope inner backward highest/cudnn-fp32"] == 1
    # The node's kernels run inside its range: the inner forward's matmul (addmm) is a child.
    forward = next(e for e in prof.events() if e.name == "fp32scope inner forward highest/cudnn-fp32")
    assert any(child.name == "aten::linear" for child in forward.cpu_children)


def test_the_autograd_profiler_sees_the_ranges_too() -> None:
    head = linear()
    with torch.autograd.profiler.profile() as prof:
        backward(head(torch.ones(1, 3, requires_grad=True)).sum())
    assert range_names(prof.function_events) == [
        "fp32scope head forward highest/cudnn-fp32",
        "fp32scope head backward highest/cudnn-fp32",
    ]


def test_no_range_without_a_profiler_and_none_left_open_across_its_start() -> None:
    head = linear(FULL, "head")
    open_inside: list[int] = []

    @with_fp32_precision(Fp32Precision("medium"), name="outer")
    def outer(x: torch.Tensor) -> torch.Tensor:
        # The profiler starts inside a scope that opened no range: only the inner call
        # gets one, and the outer exit ends nothing.
        with torch.profiler.profile() as prof:
            y: torch.Tensor = head(x)
            open_inside.append(len(_hooks.open_ranges))
        assert range_names(prof.events()) == ["fp32scope head forward highest/cudnn-fp32"]
        return y

    with torch.no_grad():
        outer(torch.ones(1, 3))
        head(torch.ones(1, 3))
        assert _hooks.open_ranges == []
    assert open_inside == [0]


def test_a_profiler_stopped_inside_a_call_leaves_no_range_open() -> None:
    prof = torch.profiler.profile()

    @with_fp32_precision(FULL, name="stops")
    def stops() -> int:
        prof.stop()
        return len(_hooks.open_ranges)

    prof.start()
    assert stops() == 1  # its range opened while the profiler recorded
    assert _hooks.open_ranges == []
    # torch 2.4's profiler drops a range still open when it stops; later releases keep it.
    assert range_names(prof.events()) in ([], ["fp32scope stops forward highest/cudnn-fp32"])  # type: ignore[no-untyped-call]


def test_a_range_ends_when_the_call_raises() -> None:
    @with_fp32_precision(FULL, name="fails")
    def fails() -> None:
        msg = "boom"
        raise RuntimeError(msg)

    with torch.profiler.profile() as prof, pytest.raises(RuntimeError, match="boom"):
        fails()
    assert _hooks.open_ranges == []
    assert range_names(prof.events()) == ["fp32scope fails forward highest/cudnn-fp32"]


# -- compiled nodes ------------------------------------------------------------------


@pytest.mark.compile
def test_a_compiled_node_is_traced_from_its_compiling_call() -> None:
    torch._dynamo.reset()
    head = Fp32ScopedModule(torch.compile(torch.nn.Linear(3, 3), backend="eager"), FULL, name="head")
    with trace() as events, torch.no_grad():
        head(torch.ones(1, 3))  # compiles, inside the scope
        head(torch.ones(1, 3))
    assert summary(events) == [("head", "forward", "highest"), ("head", "forward", "highest")]
    assert all(e.matches for e in events)


@pytest.mark.compile
def test_a_scoped_child_of_a_compiled_parent_is_traced_on_every_call() -> None:
    # The child's call runs between the parent's graphs, where Dynamo's frame callback is
    # active: the reading must happen then, not once at trace time.
    torch._dynamo.reset()
    child = linear(FULL, "child")

    def parent(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = child(x.add(1)).mul(2)
        return out

    compiled = torch.compile(parent, backend="eager")
    with torch.no_grad():
        for matmul in ("high", "medium", "high"):
            set_process_default(Fp32Precision(matmul, True))
            with trace() as events:
                compiled(torch.ones(1, 3))
            assert [(e.name, e.observed) for e in events] == [("child", FULL)]
            with torch.profiler.profile() as prof:
                compiled(torch.ones(1, 3))
            assert range_names(prof.events()) == ["fp32scope child forward highest/cudnn-fp32"]
