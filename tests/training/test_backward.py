"""Training: a scoped node's backward runs in the node's precision, exactly bracketed.

A probe (tests/_support/probe.py) reads torch's flags where autograd runs it, forward and backward,
also inside compiled graphs. The process default is "high" with cuDNN TF32 (an engine's
usual one); the node declares full fp32. Without the feature, the node's backward reads
the default: every test here that looks at "bwd" fails then.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import hypothesis.strategies as st
import pytest
import torch
import torch._dynamo
from hypothesis import given, settings

from fp32scope import (
    Fp32BackwardNotScopedWarning,
    Fp32FlagsChangedWarning,
    Fp32Precision,
    Fp32ScopedModule,
    Fp32ScopeError,
    current_fp32_precision,
    fp32_precision_scope,
    set_process_default,
    trace,
    with_fp32_precision,
)
from fp32scope._flags import torch_flags as _flags
from tests._support import probe as probes
from tests._support.common import DEFAULT, FULL
from tests._support.probe import backward, probe


@pytest.fixture(autouse=True)
def _default_and_clean_probe() -> Iterator[None]:
    set_process_default(DEFAULT)
    probes.SEEN.clear()
    probes.FAIL_IN_BACKWARD.clear()
    yield
    probes.SEEN.clear()
    probes.FAIL_IN_BACKWARD.clear()


class Node(torch.nn.Module):
    """A node with a probe at its entry and at its exit."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return probe(torch.tanh(self.linear(probe(x, "node-in"))), "node-out")


def twins(width: int = 8) -> tuple[Node, Node]:
    torch.manual_seed(0)
    a, b = Node(width), Node(width)
    b.load_state_dict(a.state_dict())
    return a, b


def as_module(proxy: Fp32ScopedModule) -> torch.nn.Module:
    return cast("torch.nn.Module", proxy)


def step(node: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """pre -> node -> post -> loss, with probes before and after the node."""
    return probe(node(probe(x * 2, "pre")), "post").pow(2).sum()


def assert_node_backward_in(precision: Fp32Precision, around: Fp32Precision = DEFAULT) -> None:
    bwd = probes.phases("bwd")
    assert bwd["node-out"] == [precision]
    assert bwd["node-in"] == [precision]
    assert bwd["post"] == [around]
    assert bwd["pre"] == [around]


# -- the precision in backward, for each kind of wrapper -------------------------------------


def test_eager_module_backward_runs_in_the_node_precision() -> None:
    node = Fp32ScopedModule(Node(), FULL)
    x = torch.randn(4, 8, requires_grad=True)
    before = _flags.read_all()
    backward(step(node, x))
    assert probes.phases("fwd")["node-in"] == [FULL]
    assert_node_backward_in(FULL)
    assert _flags.read_all() == before


def test_backward_false_keeps_the_node_forward_only() -> None:
    node = Fp32ScopedModule(Node(), FULL, backward=False)
    backward(step(node, torch.randn(4, 8, requires_grad=True)))
    assert probes.phases("fwd")["node-in"] == [FULL]
    assert_node_backward_in(DEFAULT)  # the control: without the feature this is what a node gets
    assert "backward=False" in repr(node)


@pytest.mark.compile
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_module_backward_and_its_lazy_compile_run_in_the_node_precision(backend: str) -> None:
    torch._dynamo.reset()
    compiled_in: list[Fp32Precision] = []

    def recording(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.registry import lookup_backend

        if backend == "inductor":
            compiled: Callable[..., Any] = lookup_backend("inductor")(gm, inputs)
            return compiled

        def record(g: torch.fx.GraphModule, _: list[torch.Tensor]) -> Callable[..., Any]:
            compiled_in.append(current_fp32_precision())  # forward graph, then backward graph

            def boxed(args: list[Any]) -> Any:  # AOTAutograd's calling convention
                return g(*args)

            boxed._boxed_call = True  # type: ignore[attr-defined]
            return boxed

        with_aot: Callable[..., Any] = aot_autograd(fw_compiler=record, bw_compiler=record)(gm, inputs)
        return with_aot

    a, b = twins()
    node = Fp32ScopedModule(torch.compile(a, backend=recording), FULL)
    x = torch.randn(4, 8, requires_grad=True)
    backward(step(node, x))
    assert_node_backward_in(FULL)
    if backend == "aot_eager":
        assert compiled_in == [FULL, FULL]  # the backward graph compiled at the first backward, in scope
    grads = [p.grad for p in a.parameters()]
    backward(step(b, x.detach().requires_grad_()))
    for got, expected in zip(grads, [p.grad for p in b.parameters()], strict=True):
        torch.testing.assert_close(got, expected)
    torch._dynamo.reset()


def test_decorated_function_and_its_closure_over_a_parameter() -> None:
    weight = torch.nn.Parameter(torch.randn(8, 8))

    @with_fp32_precision(FULL)
    def head(x: torch.Tensor) -> torch.Tensor:
        return probe(probe(x, "node-in") @ weight, "node-out")  # weight: reached by closure

    x = torch.randn(4, 8, requires_grad=True)
    backward(step(head, x))
    assert_node_backward_in(FULL)
    assert weight.grad is not None
    expected = torch.autograd.grad(step(lambda t: t @ weight, x), weight)[0]
    torch.testing.assert_close(weight.grad, expected)


@pytest.mark.parametrize("retain", [False, True])
def test_a_closure_over_an_activation_keeps_every_gradient_and_runs_its_backward_scoped(retain: bool) -> None:
    # The call reaches a non-leaf it does not take as an argument: its subgraph takes in that
    # tensor's history. Every gradient (the argument's included: it entered as an alias) must
    # be the unwrapped node's, and the node's backward must still run in its precision.
    torch.manual_seed(0)
    source = torch.randn(4, 8, requires_grad=True)
    activation = source * 3  # a non-leaf the function reaches without taking it as an argument

    @with_fp32_precision(FULL, name="closes-over")  # a new wrapper object: warned again
    def head(x: torch.Tensor) -> torch.Tensor:
        return probe(x + activation, "node-out")

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(Fp32BackwardNotScopedWarning, match="'closes-over'.*exact.*backward=False"):
        loss = step(head, x)
    backward(loss, retain_graph=retain)
    assert probes.phases("bwd")["node-out"] == [FULL]
    got = (x.grad, source.grad)
    assert got[0] is not None
    assert got[1] is not None
    x.grad = source.grad = None
    backward(step(lambda t: t + source * 3, x))
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], source.grad)


def test_the_not_scoped_warning_comes_once_per_wrapper_object() -> None:
    # Keyed on the wrapper, not on its name: two wrappers of one name each warn, once.
    torch.manual_seed(0)
    activation = torch.randn(4, 8, requires_grad=True) * 3

    def head(x: torch.Tensor) -> torch.Tensor:
        return x + activation

    first = with_fp32_precision(FULL, name="same-name")(head)
    second = with_fp32_precision(FULL, name="same-name")(head)
    x = torch.randn(4, 8, requires_grad=True)
    for wrapper in (first, second):
        with pytest.warns(Fp32BackwardNotScopedWarning, match="'same-name'"):
            wrapper(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Fp32BackwardNotScopedWarning)
            wrapper(x)


@pytest.mark.parametrize("how", ["backward", "grad", "grad of the unused parameter", "double backward"])
def test_a_closure_parameter_reached_only_by_an_unused_output(how: str) -> None:
    # The node's subgraph ends at a parameter only its unused output reaches: the nested
    # backward must not ask for that parameter's gradient as if it were needed.
    torch.manual_seed(0)
    used = torch.nn.Parameter(torch.randn(8))
    unused = torch.nn.Parameter(torch.randn(8))

    def node(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sin(x * used), torch.sin(x * unused)

    def run(fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor | None]:
        used.grad = unused.grad = None
        torch.manual_seed(1)
        x = torch.randn(8, requires_grad=True)
        loss = fn(x * 1)[0].pow(2).sum()
        if how == "backward":
            backward(loss)
            return [used.grad, unused.grad, x.grad]
        if how == "grad":
            return list(torch.autograd.grad(loss, [used, x]))
        if how == "grad of the unused parameter":
            return list(torch.autograd.grad(loss, [used, unused], allow_unused=True))
        (g,) = torch.autograd.grad(loss, [used], create_graph=True)
        backward(g.sum())
        return [used.grad, unused.grad, x.grad]

    expected = run(node)
    got = run(with_fp32_precision(FULL)(node))
    assert [g is None for g in got] == [g is None for g in expected]
    for mine, theirs in zip(got, expected, strict=True):
        if theirs is not None:
            torch.testing.assert_close(mine, theirs)
    if how == "grad":  # without allow_unused, torch's own error for the unused parameter
        loss = with_fp32_precision(FULL)(node)(torch.randn(8))[0].sum()
        with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
            torch.autograd.grad(loss, [used, unused])


def test_the_issues_lost_gradient_case_keeps_the_arguments_gradient() -> None:
    # A closure over a non-leaf matrix; the argument is a non-leaf too (x * 2).
    torch.manual_seed(0)
    w_base = torch.randn(8, 8, requires_grad=True)
    box = {"w": w_base * 1.0}

    @with_fp32_precision(FULL, name="lost")
    def scoped(h: torch.Tensor) -> torch.Tensor:
        return h @ box["w"]

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(Fp32BackwardNotScopedWarning):
        backward(scoped(x * 2.0).sum())
    got = (x.grad, w_base.grad)
    assert got[0] is not None
    assert got[1] is not None
    x.grad = w_base.grad = None
    backward(((x * 2.0) @ (w_base * 1.0)).sum())
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], w_base.grad)


def test_a_non_leaf_reached_inside_and_used_outside_too_gets_both_parts_once() -> None:
    # The closed-over tensor is also used after the node: its history runs in the nested
    # backward and in the caller's; the gradients still add up exactly once.
    torch.manual_seed(0)
    base = torch.randn(8, 8, requires_grad=True)
    shared = base.tanh()

    @with_fp32_precision(FULL, name="shared")
    def node(h: torch.Tensor) -> torch.Tensor:
        return h @ shared

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(Fp32BackwardNotScopedWarning):
        out = node(x * 2.0)
    backward(out.sum() + shared.sum())
    got = (x.grad, base.grad)
    x.grad = base.grad = None
    shared = base.tanh()
    backward(((x * 2.0) @ shared).sum() + shared.sum())
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], base.grad)


def test_inside_a_torch_func_transform_the_node_is_differentiated_as_it_is_with_a_warning() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    seen: list[Fp32Precision] = []
    linear.register_forward_pre_hook(lambda *_: seen.append(current_fp32_precision()))
    node = Fp32ScopedModule(linear, FULL, name="in-transform")
    x = torch.randn(8)
    with pytest.warns(Fp32BackwardNotScopedWarning, match="'in-transform'.*torch.func transform"):
        got = torch.func.grad(lambda t: node(t).sum())(x)
    expected = torch.func.grad(lambda t: linear(t).sum())(x)
    torch.testing.assert_close(got, expected)
    assert seen[0] == FULL


# -- gradients ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_gradients_equal_the_unwrapped_node_for_inputs_and_parameters(how: str) -> None:
    a, b = twins()
    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for node in (Fp32ScopedModule(a, FULL), b):
        set_process_default(Fp32Precision("highest", False))  # the same numerics on both sides
        loss = step(node, x)
        params = list((a if node is not b else b).parameters())
        if how == "backward":
            x.grad = None
            backward(loss)
            results.append([x.grad, *(p.grad for p in params)])
        else:
            results.append(list(torch.autograd.grad(loss, [x, *params])))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("passed", ["positionally", "by keyword"])
def test_a_parameter_reached_inside_and_through_the_input_gets_its_gradient_once(passed: str) -> None:
    # Tied weights (an LM head reusing the embedding): the weight is used inside the node and
    # also made the node's input. Its gradient must be the sum of both paths, each once.
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 8))
    tokens = torch.randn(4, 8)

    def head(h: torch.Tensor | None = None, *, hidden: torch.Tensor | None = None) -> torch.Tensor:
        x = h if h is not None else hidden
        assert x is not None
        return probe(x @ weight.t(), "node-out")

    def loss_of(node: Callable[..., torch.Tensor]) -> torch.Tensor:
        hidden = torch.tanh(tokens @ weight)
        out = node(hidden) if passed == "positionally" else node(hidden=hidden)
        return out.pow(2).sum()

    expected = torch.autograd.grad(loss_of(head), weight)[0]
    probes.SEEN.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp32BackwardNotScopedWarning)  # the input is cut off, not warned about
        got = torch.autograd.grad(loss_of(with_fp32_precision(FULL)(head)), weight)[0]
    torch.testing.assert_close(got, expected)
    assert probes.phases("bwd")["node-out"] == [FULL]


def test_an_argument_returned_as_is_comes_back_as_the_callers_tensor() -> None:
    @with_fp32_precision(FULL)
    def passthrough(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, y * 2

    x = torch.randn(3, requires_grad=True) * 1  # a non-leaf: enters the call as an alias
    out_x, out_y = passthrough(x, x)
    assert out_x is x
    backward(out_x.sum() + out_y.sum())


def test_retain_graph_and_a_second_backward() -> None:
    a, _ = twins()
    x = torch.randn(4, 8, requires_grad=True)
    node = Fp32ScopedModule(a, FULL)
    loss = step(node, x)
    backward(loss, retain_graph=True)
    first = a.linear.weight.grad.clone()  # type: ignore[union-attr]
    backward(loss)
    torch.testing.assert_close(a.linear.weight.grad, 2 * first)
    assert probes.phases("bwd")["node-out"] == [FULL, FULL]
    with pytest.raises(RuntimeError, match="backward through the graph a second time.*retain_graph=True"):
        backward(loss)


def test_without_retain_graph_the_nodes_activations_are_freed_after_backward() -> None:
    kept: list[weakref.ref[torch.Tensor]] = []

    class Saves(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = torch.tanh(self.linear(x))  # saved by tanh's and mul's backward only
            kept.append(weakref.ref(hidden))
            return hidden * hidden

    node = Fp32ScopedModule(Saves(), FULL)
    for retain in (True, False):
        kept.clear()
        out = node(torch.randn(4, 8, requires_grad=True))
        backward(out.sum(), retain_graph=retain)
        gc.collect()
        # `out` is still alive, as a training loop's last loss is until the next step.
        assert (kept[0]() is not None) is retain


def test_double_backward_runs_in_the_node_precision_and_matches() -> None:
    a, b = twins()
    results = []
    start = torch.randn(4, 8)
    for node in (Fp32ScopedModule(a, FULL), b):
        set_process_default(Fp32Precision("highest", False))
        source = start.clone().requires_grad_()
        h = source * 2
        probes.SEEN.clear()
        set_process_default(DEFAULT)
        (gh,) = torch.autograd.grad(node(h).pow(3).sum(), h, create_graph=True)
        penalty = gh.pow(2).sum()
        backward(penalty)
        params = a.parameters() if node is not b else b.parameters()
        results.append([gh.detach(), source.grad, *(p.grad for p in params)])
        if node is not b:
            # first-order backward, then the double backward: all of the node's own in FULL
            assert set(probes.phases("bwd")["node-out"]) == {FULL}
            assert len(probes.phases("bwd")["node-out"]) >= 2
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# -- exceptions -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["node-in", "node-out"])
def test_an_error_in_the_nodes_backward_restores_the_flags_and_the_next_step_works(where: str) -> None:
    node = Fp32ScopedModule(Node(), FULL)
    x = torch.randn(4, 8, requires_grad=True)
    before = _flags.read_all()
    probes.FAIL_IN_BACKWARD.add(where)
    with pytest.raises(probes.ProbeError, match=where):
        backward(step(node, x))
    assert _flags.read_all() == before
    probes.FAIL_IN_BACKWARD.clear()
    probes.SEEN.clear()
    backward(step(node, x))
    assert_node_backward_in(FULL)
    assert _flags.read_all() == before


precisions = st.builds(
    Fp32Precision, st.sampled_from(["highest", "high", "medium"]), st.sampled_from([True, False, None])
)


@settings(max_examples=40, deadline=None)
@given(default=precisions, declared=precisions, outer=st.none() | precisions, fail=st.booleans())
def test_property_backward_brackets_the_node_exactly(
    default: Fp32Precision, declared: Fp32Precision, outer: Fp32Precision | None, fail: bool
) -> None:
    """Whatever the default, the node's and an enclosing scope's precisions, and whether the
    node's backward raises: the node's backward sees its precision (fields it leaves None
    keep the surrounding value), the rest sees the surrounding precision, and the flags
    after backward() are exactly those before it."""
    set_process_default(default)
    probes.SEEN.clear()
    probes.FAIL_IN_BACKWARD.clear()
    node = Fp32ScopedModule(Node(), declared)
    loss = step(node, torch.randn(2, 8, requires_grad=True))
    if fail:
        probes.FAIL_IN_BACKWARD.add("node-in")
    before = _flags.read_all()
    try:
        with fp32_precision_scope(outer):
            around = current_fp32_precision()
            expected = Fp32Precision(
                declared.matmul or around.matmul,
                around.cudnn_allow_tf32 if declared.cudnn_allow_tf32 is None else declared.cudnn_allow_tf32,
            )
            backward(loss)
    except probes.ProbeError:
        assert fail
    else:
        assert not fail
        assert probes.phases("bwd")["pre"] == [around]
    assert probes.phases("bwd")["post"] == [around]
    assert probes.phases("bwd")["node-out"] == [expected]
    assert _flags.read_all() == before
    probes.FAIL_IN_BACKWARD.clear()


# -- graphs with several nodes --------------------------------------------------------------


def test_the_trace_names_each_phase_of_a_scoped_call() -> None:
    head = Fp32ScopedModule(torch.nn.Linear(3, 2), FULL, name="head")
    x = torch.ones(2, 3, requires_grad=True)
    with trace() as events:
        torch.autograd.backward(head(x).sum())
    assert [(e.name, e.phase) for e in events] == [("head", "forward"), ("head", "backward")]


def test_the_profiler_range_of_a_scoped_call_ends_with_the_call() -> None:
    from fp32scope._flags import hooks as _hooks

    head = Fp32ScopedModule(torch.nn.Linear(3, 2), FULL, name="head")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.backward(head(torch.ones(2, 3, requires_grad=True)).sum())
        assert _hooks.open_ranges == []  # each range the calls opened is closed
        torch.ones(2).mul(3)  # after the calls: in no range of theirs
    ranges = [e for e in prof.events() if e.name.startswith("fp32scope head")]
    assert [e.name for e in ranges] == [
        "fp32scope head forward highest/cudnn-fp32",
        "fp32scope head backward highest/cudnn-fp32",
    ]
    for scoped in ranges:
        assert not any(child.name == "aten::mul" for child in scoped.cpu_children)


def test_a_scope_around_backward_nests() -> None:
    node = Fp32ScopedModule(Node(), FULL)
    loss = step(node, torch.randn(4, 8, requires_grad=True))
    medium = Fp32Precision("medium", True)
    with fp32_precision_scope(medium):
        backward(loss)
        assert current_fp32_precision() == medium
    assert_node_backward_in(FULL, around=medium)
    assert current_fp32_precision() == DEFAULT


def test_two_nodes_of_different_precisions_each_get_their_own() -> None:
    medium = Fp32Precision("medium", True)

    @with_fp32_precision(FULL)
    def full(x: torch.Tensor) -> torch.Tensor:
        return probe(x * 3, "full")

    @with_fp32_precision(medium)
    def reduced(x: torch.Tensor) -> torch.Tensor:
        return probe(x * 5, "reduced")

    x = torch.randn(4, requires_grad=True)
    backward((reduced(full(x)) + full(x * 7)).sum())
    bwd = probes.phases("bwd")
    assert bwd["full"] == [FULL, FULL]
    assert bwd["reduced"] == [medium]
    torch.testing.assert_close(x.grad, torch.full((4,), 15.0 + 21.0))


def test_an_unused_output_runs_no_backward() -> None:
    @with_fp32_precision(FULL)
    def two(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"used": probe(x * 2, "used"), "unused": probe(x * 3, "unused")}

    x = torch.randn(4, requires_grad=True)
    out = two(x)
    backward(out["used"].sum())
    assert probes.phases("bwd") == {"used": [FULL]}
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))


# -- torch features -------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recomputes_and_backpropagates_in_the_node_precision(reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    a, b = twins()
    node = Fp32ScopedModule(a, FULL)
    x = torch.randn(4, 8, requires_grad=True)
    loss = probe(cast("torch.Tensor", checkpoint(node, probe(x, "pre"), use_reentrant=reentrant)), "post").sum()
    probes.SEEN.clear()
    backward(loss)
    fwd = probes.phases("fwd")  # in backward: only the recompute runs forward code
    assert set(fwd["node-in"]) == {FULL}
    assert_node_backward_in(FULL)
    grads = [p.grad for p in a.parameters()]
    backward(probe(b(probe(x, "pre")), "post").sum())
    for got, expected in zip(grads, [p.grad for p in b.parameters()], strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.compile
def test_a_compiled_parent_runs_its_scoped_childs_backward_in_the_childs_precision() -> None:
    torch._dynamo.reset()

    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = torch.nn.Linear(8, 8)
            self.child = as_module(Fp32ScopedModule(Node(), FULL))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return probe(self.child(probe(self.pre(x), "pre")), "post").sum()

    parent = Parent()
    backward(torch.compile(parent, backend="aot_eager")(torch.randn(4, 8, requires_grad=True)))
    assert_node_backward_in(FULL)
    assert parent.pre.weight.grad is not None
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing requires grad"])
def test_without_autograd_history_nothing_is_added(mode: str) -> None:
    node = Fp32ScopedModule(Node(), FULL)
    if mode == "nothing requires grad":
        node.requires_grad_(False)
        out = node(torch.randn(4, 8))
        assert out.grad_fn is None
        return
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        out = node(torch.randn(4, 8, requires_grad=True))
    assert out.grad_fn is None
    assert probes.phases("fwd")["node-in"] == [FULL]


def test_an_in_place_change_of_an_argument_is_refused_with_the_fix() -> None:
    @with_fp32_precision(FULL, name="in-place")
    def scales(x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)

    x = torch.randn(4, requires_grad=True) * 1  # has autograd history
    before = _flags.read_all()
    with pytest.raises(
        Fp32ScopeError, match=r"'in-place' modified one of its tensor arguments in place.*backward=False"
    ):
        scales(x)
    assert _flags.read_all() == before
    # Forward-only, the same call works as it does unwrapped.
    forward_only = with_fp32_precision(FULL, backward=False)(scales.__wrapped__)  # type: ignore[attr-defined]
    torch.testing.assert_close(forward_only(torch.ones(2, requires_grad=True) * 1), torch.full((2,), 2.0))


@pytest.mark.parametrize("grad", [True, False], ids=["recording", "no_grad"])
def test_a_flag_change_inside_the_node_is_reported_at_the_callers_line(grad: bool) -> None:
    @with_fp32_precision(FULL, name="flips")
    def flips(x: torch.Tensor) -> torch.Tensor:
        torch.set_float32_matmul_precision("medium")
        return x * 2

    x = torch.randn(2, requires_grad=True)
    with torch.set_grad_enabled(grad), pytest.warns(Fp32FlagsChangedWarning, match="'flips'") as caught:
        flips(x)
    assert [w.filename for w in caught] == [__file__]
    assert current_fp32_precision() == DEFAULT


def test_the_backward_keyword_is_checked() -> None:
    with pytest.raises(TypeError, match=r"backward must be True .* or False .*; got 'no' of type str"):
        Fp32ScopedModule(Node(), FULL, backward="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"backward must be True .*; got 1 of type int"):
        with_fp32_precision(FULL, backward=1)  # type: ignore[arg-type]


def test_copies_keep_backward_false() -> None:
    import copy
    import pickle

    node = Fp32ScopedModule(Node(), FULL, backward=False)
    for clone in (copy.copy(node), copy.deepcopy(node), pickle.loads(pickle.dumps(node))):  # noqa: S301
        assert "backward=False" in repr(clone)


# -- threads --------------------------------------------------------------------------------


def test_a_forward_on_another_thread_is_refused_while_a_backward_is_in_its_scope() -> None:
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    @with_fp32_precision(FULL, name="blocking")
    def blocking(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = Wait.apply(x)  # type: ignore[no-untyped-call]
        return out

    class Wait(torch.autograd.Function):
        @staticmethod
        def forward(_ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(_ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            inside.set()
            release.wait(30)
            return grad

    loss = blocking(torch.randn(4, requires_grad=True)).sum()

    def train() -> None:
        try:
            backward(loss)
        except BaseException as e:  # reported to the main thread
            errors.append(e)

    trainer = threading.Thread(target=train, name="trainer")
    trainer.start()
    assert inside.wait(30)
    try:
        assert current_fp32_precision() == FULL  # the backward holds the node's precision now
        other = Fp32ScopedModule(Node(), Fp32Precision("medium"), name="other")
        with pytest.raises(Fp32ScopeError, match="around 'other' on thread .* while thread 'trainer'"):
            other(torch.randn(4, 8))
    finally:
        release.set()
        trainer.join(30)
    assert not errors
    assert current_fp32_precision() == DEFAULT


# -- DDP ------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch build has no torch.distributed")
def test_ddp_example_all_reduces_through_the_scoped_head_in_full_fp32() -> None:
    from tests._support.examples import run_example

    out = run_example("ddp_training.py")
    for rank in (0, 1):
        assert f"rank {rank}: head backward ran in [{FULL}] (3 steps)" in out
        assert f"rank {rank}: gradients all-reduced (equal on every rank): True" in out
        assert f"rank {rank}: replicas identical after 3 steps: True" in out
        assert f"rank {rank}: flags after training: {DEFAULT}" in out
