"""In-graph regions (``in_graph=True``): a scoped node inside one compiled graph, in its precision.

The precision is read where kernels run: probes (opaque custom ops that record the flags
when they execute, forward and backward) sit before, inside and after the scoped node.
Graphs and graph breaks are Dynamo's counters. Gradients, outputs and buffers are compared
with the same model run eagerly with today's scoped modules (``in_graph=False``), which
the wrapper tests check against hand-set precisions.
"""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    current_fp32_precision,
    scope_modules,
    set_process_default,
    trace,
    with_fp32_precision,
)
from fp32scope._wrappers import region as region_module
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL, BoomError, run_module
from tests._support.compiled import forbid_recompiles, parent_graphs
from tests._support.hf import tiny_gpt2
from tests._support.probe import phases, probe

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

WIDTH = 16
MEDIUM = Fp32Precision("medium", True)

#: (process default, the node's precision): full float32 under a TF32 default, a reduced
#: precision under a full-float32 default, and the cuDNN flag alone.
DIRECTIONS = [(DEFAULT, FULL), (FULL, MEDIUM), (DEFAULT, Fp32Precision(None, False))]


@pytest.fixture(autouse=True)
def _clear_probes() -> None:
    _probe.SEEN.clear()
    _probe.FAIL_IN_BACKWARD.clear()


class Block(torch.nn.Module):
    """Linear + GELU with a probe on its output, tagged."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.tag = tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return probe(torch.nn.functional.gelu(self.linear(x)), self.tag)


class Stack(torch.nn.Module):
    """``before -> node -> after``, the node scoped with ``precision`` (and ``in_graph``)."""

    def __init__(self, precision: Fp32Precision, *, in_graph: bool, node: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.before = Block("before")
        self.node = Fp32ScopedModule(node if node is not None else Block("node"), precision, in_graph=in_graph)
        self.after = Block("after")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.after(self.node(self.before(x)))
        return out


def _module(proxy: Fp32ScopedModule) -> torch.nn.Module:
    # A proxy is a torch.nn.Module at run time (isinstance holds); its static type is wrapt's.
    return cast("torch.nn.Module", proxy)


def node_of(model: torch.nn.Sequential) -> Block:
    """The bare Block that ``model[1]`` wraps."""
    bare: Block = cast("Fp32ScopedModule", model[1]).__wrapped__
    return bare


def _graphs_and_breaks() -> tuple[int, int]:
    # The parents' graphs: a node compiled in its op by the parent's backend has its own.
    return parent_graphs(), sum(counters["graph_break"].values())


def _train_step(
    model: Callable[[torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter], x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    loss = model(x).square().mean()
    torch.autograd.backward(loss)
    return loss.detach(), [p.grad.clone() for p in params if p.grad is not None]


@pytest.mark.parametrize(
    ("default", "node"), DIRECTIONS, ids=["highest-under-high", "medium-under-highest", "cudnn-off"]
)
def test_a_region_runs_its_node_in_its_precision_inside_one_fullgraph(
    default: Fp32Precision, node: Fp32Precision
) -> None:
    set_process_default(default)
    torch.manual_seed(0)
    eager = Stack(node, in_graph=False)
    model = copy.deepcopy(eager)
    model.node = Fp32ScopedModule(model.node.__wrapped__, node, in_graph=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    expected = current_fp32_precision()  # the default, as the process reads it
    inside = Fp32ScopedModule(torch.nn.Identity(), node)
    with inside._self_scope:
        in_node = current_fp32_precision()

    with torch.no_grad():
        out = compiled(x)
    assert phases("fwd") == {"before": [expected], "node": [in_node], "after": [expected]}
    assert current_fp32_precision() == expected
    with torch.no_grad():
        torch.testing.assert_close(out, eager(x), rtol=0, atol=0)

    _probe.SEEN.clear()
    loss, grads = _train_step(compiled, list(model.parameters()), x)
    assert phases("fwd") == {"before": [expected], "node": [in_node], "after": [expected]}
    assert phases("bwd") == {"after": [expected], "node": [in_node], "before": [expected]}
    assert current_fp32_precision() == expected
    ref_loss, ref_grads = _train_step(eager, list(eager.parameters()), x)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _graphs_and_breaks() == (2, 0)  # one forward-only graph, one training graph; no break


def test_a_region_compiles_once_under_inductor_and_trains_as_eager() -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    eager = Stack(FULL, in_graph=False)
    model = copy.deepcopy(eager)
    model.node = Fp32ScopedModule(model.node.__wrapped__, FULL, in_graph=True)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, WIDTH)
    params = list(model.parameters())
    _train_step(compiled, params, x)
    with torch.no_grad():
        compiled(x)
    _probe.SEEN.clear()
    with forbid_recompiles():
        loss, grads = _train_step(compiled, params, x)
        with torch.no_grad():
            compiled(x)
    assert phases("fwd")["node"] == [FULL, FULL]
    assert phases("bwd")["node"] == [FULL]
    assert {p for tag in ("before", "after") for p in phases("fwd")[tag]} == {DEFAULT}
    ref_loss, ref_grads = _train_step(eager, list(eager.parameters()), x)
    torch.testing.assert_close(loss, ref_loss)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert _graphs_and_breaks() == (2, 0)


def test_a_region_called_eagerly_is_todays_scoped_call() -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    eager = Stack(FULL, in_graph=False)
    model = copy.deepcopy(eager)
    model.node = Fp32ScopedModule(model.node.__wrapped__, FULL, in_graph=True)
    x = torch.randn(4, WIDTH)
    loss, grads = _train_step(model, list(model.parameters()), x)
    assert phases("fwd")["node"] == [FULL]
    assert phases("bwd")["node"] == [FULL]
    ref_loss, ref_grads = _train_step(eager, list(eager.parameters()), x)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class Raising(torch.nn.Module):
    """A node that raises BoomError while ``armed`` (read when it runs, not when it is traced)."""

    armed = False

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Raising.armed:
            raise BoomError
        out: torch.Tensor = self.linear(x)
        return out


def test_flags_are_restored_when_the_node_raises_inside_its_region() -> None:
    set_process_default(DEFAULT)
    model = Stack(FULL, in_graph=True, node=Raising())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    with torch.no_grad():
        compiled(x)
    Raising.armed = True
    try:
        with torch.no_grad(), pytest.raises(BoomError):
            compiled(x)
    finally:
        Raising.armed = False
    assert current_fp32_precision() == DEFAULT


def test_flags_are_restored_when_the_nodes_backward_raises_inside_its_region() -> None:
    set_process_default(DEFAULT)
    model = Stack(FULL, in_graph=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    _probe.FAIL_IN_BACKWARD.add("node")
    with pytest.raises(_probe.ProbeError):
        compiled(x).sum().backward()
    assert current_fp32_precision() == DEFAULT
    assert phases("bwd")["node"] == [FULL]


class Normed(torch.nn.Module):
    """Linear then BatchNorm1d: a node that updates buffers in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.linear(x))
        return out


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_buffers_a_region_updates_end_as_in_eager(backend: str) -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    eager = Stack(FULL, in_graph=False, node=Normed())
    model = copy.deepcopy(eager)
    model.node = Fp32ScopedModule(model.node.__wrapped__, FULL, in_graph=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    params = list(model.parameters())
    for step in range(3):
        x = torch.randn(8, WIDTH)
        loss, grads = _train_step(compiled, params, x)
        ref_loss, ref_grads = _train_step(eager, list(eager.parameters()), x)
        torch.testing.assert_close(loss, ref_loss)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want)
        for (name, got), want in zip(model.named_buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(got, want, msg=f"buffer {name} after step {step}")
    assert int(model.node.norm.num_batches_tracked) == 3
    model.eval()
    eager.eval()
    x = torch.randn(8, WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x))
    assert int(model.node.norm.num_batches_tracked) == 3
    assert sum(counters["graph_break"].values()) == 0


#: The backends: the node run eagerly inside its op (aot_eager), and compiled inside (Inductor).
BACKENDS = pytest.mark.parametrize("backend", ["aot_eager", "inductor"])


def _close(actual: torch.Tensor, expected: torch.Tensor, backend: str) -> None:
    """Exactly under aot_eager; to rounding under Inductor, whose code adds in other orders."""
    exact = backend == "aot_eager"
    loose = expected.dtype != torch.float32
    rtol = 0 if exact else 2e-2 if loose else 1e-5
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol)


@BACKENDS
def test_a_region_with_autocast_false_runs_without_the_callers_autocast(backend: str) -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    node = Block("node")
    eager = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), _module(Fp32ScopedModule(node, FULL, autocast=False)))
    model = copy.deepcopy(eager)
    model[1] = _module(Fp32ScopedModule(node_of(model), FULL, autocast=False, in_graph=True))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(4, WIDTH)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
        ref = eager(x)
    assert out.dtype == ref.dtype == torch.float32
    _close(out, ref, backend)
    assert phases("fwd")["node"][-1] == FULL
    torch.autograd.backward(out.sum())
    grad = node_of(model).linear.weight.grad
    assert grad is not None
    assert grad.dtype == torch.float32


@BACKENDS
def test_a_region_keeps_the_callers_autocast_where_its_policy_says_so(backend: str) -> None:
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), _module(Fp32ScopedModule(Block("node"), FULL, autocast=True))
    )
    model = copy.deepcopy(eager)
    model[1] = _module(Fp32ScopedModule(node_of(model), FULL, autocast=True, in_graph=True))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(4, WIDTH)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
        ref = eager(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    _close(out, ref, backend)


@BACKENDS
def test_checkpointing_around_a_region_recomputes_it_in_its_precision(backend: str) -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)

    class Checkpointed(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.utils.checkpoint.checkpoint(self.node, self.before(x), use_reentrant=False)
            out: torch.Tensor = self.after(y)
            return out

    eager = Checkpointed(FULL, in_graph=False)
    model = copy.deepcopy(eager)
    model.node = Fp32ScopedModule(model.node.__wrapped__, FULL, in_graph=True)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, WIDTH)
    loss, grads = _train_step(compiled, list(model.parameters()), x)
    assert phases("fwd")["node"] == [FULL, FULL]  # the forward, and its recompute in the backward
    assert phases("bwd")["node"] == [FULL]
    ref_loss, ref_grads = _train_step(eager, list(eager.parameters()), x)
    _close(loss, ref_loss, backend)
    for got, want in zip(grads, ref_grads, strict=True):
        _close(got, want, backend)


@BACKENDS
def test_a_compiled_model_with_regions_serves_from_another_thread_without_recompiling(backend: str) -> None:
    set_process_default(DEFAULT)
    model = Stack(FULL, in_graph=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(4, WIDTH)
    with torch.no_grad():
        warm = compiled(x)

    def serve() -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = compiled(x)
            return out

    _probe.SEEN.clear()
    with forbid_recompiles(), concurrent.futures.ThreadPoolExecutor(1) as pool:
        served = pool.submit(serve).result()
    torch.testing.assert_close(served, warm, rtol=0, atol=0)
    assert phases("fwd") == {"before": [DEFAULT], "node": [FULL], "after": [DEFAULT]}


def test_a_model_with_breaks_and_one_with_regions_never_share_a_compiled_entry() -> None:
    set_process_default(DEFAULT)
    x = torch.randn(4, WIDTH)
    broken = torch.compile(Stack(FULL, in_graph=False), backend="aot_eager")
    with torch.no_grad():
        broken(x)
    assert sum(counters["graph_break"].values()) > 0
    counters.clear()
    regions = torch.compile(Stack(FULL, in_graph=True), backend="aot_eager", fullgraph=True)
    _probe.SEEN.clear()
    with torch.no_grad():
        regions(x)
    assert sum(counters["graph_break"].values()) == 0
    assert parent_graphs() == 1  # compiled for itself: one graph, no break
    assert phases("fwd")["node"] == [FULL]


def test_fullgraph_with_a_break_says_to_pass_in_graph() -> None:
    compiled = torch.compile(Stack(FULL, in_graph=False), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="disable") as raised:
        compiled(torch.randn(4, WIDTH))
    # On every release: in fp32scope's reason (torch >= 2.8), or in the name of the wrapper
    # that torch 2.4's message gives (its disable takes no reason).
    assert "in_graph=True" in str(raised.value)


class CallsForward(torch.nn.Module):
    """A parent that calls its child's ``forward`` directly (hooks skipped), as some models do."""

    def __init__(self) -> None:
        super().__init__()
        self.before = Block("before")
        self.node = Fp32ScopedModule(Block("node"), FULL, in_graph=True)
        self.after = Block("after")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.after(self.node.forward(self.before(x)))
        return out


def test_a_parents_call_of_the_childs_forward_is_a_region_too() -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    model = CallsForward()
    hooks: list[str] = []
    _module(model.node).register_forward_hook(lambda *_: hooks.append("hook"))
    eager = copy.deepcopy(model)
    params = list(model.parameters())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    with forbid_recompiles():
        for _ in range(2):
            _probe.SEEN.clear()
            loss, grads = _train_step(compiled, params, x)
            assert phases("fwd") == {"before": [DEFAULT], "node": [FULL], "after": [DEFAULT]}
            assert phases("bwd") == {"after": [DEFAULT], "node": [FULL], "before": [DEFAULT]}
    expected_loss, expected_grads = _train_step(eager, list(eager.parameters()), x)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert hooks == []  # ``forward`` skips the module's hooks, compiled as in eager
    assert _graphs_and_breaks()[1] == 0


def test_scope_modules_makes_regions_from_its_argument_and_from_a_json_rule() -> None:
    set_process_default(DEFAULT)
    model = torch.nn.Sequential(Block("a"), Block("b"), Block("c"))
    done = scope_modules(model, {"0": "highest", "1": {"matmul": "highest", "in_graph": False}}, in_graph=True)
    assert set(done) == {"0", "1"}
    assert model[0]._self_region is not None
    assert model[1]._self_region is None
    counters.clear()
    with torch.no_grad():
        torch.compile(model, backend="aot_eager")(torch.randn(4, WIDTH))
    assert sum(counters["graph_break"].values()) > 0  # the rule's own in_graph=False: a break at "1"
    with pytest.raises(TypeError, match=r"policy\['2'\]\['in_graph'\] must be True .* got 'yes'"):
        scope_modules(model, {"2": {"matmul": "highest", "in_graph": "yes"}})
    assert model[2].__class__ is Block  # nothing changed
    with pytest.raises(TypeError, match="in_graph must be True"):
        scope_modules(model, {"2": "highest"}, in_graph=1)


def test_a_function_region_runs_in_its_precision_and_passes_gradients() -> None:
    set_process_default(DEFAULT)

    @with_fp32_precision(FULL, in_graph=True)
    def head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return probe(x @ w, "head")

    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(4, WIDTH, requires_grad=True)
    compiled = torch.compile(lambda x, w: head(x.relu(), w).sum(), backend="aot_eager", fullgraph=True)
    torch.autograd.backward(compiled(x, w))
    assert phases("fwd")["head"] == [FULL]
    assert phases("bwd")["head"] == [FULL]
    gx, gw = torch.autograd.grad((x.relu() @ w).sum(), [x, w])
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(w.grad, gw)
    assert sum(counters["graph_break"].values()) == 0


def test_one_compiled_function_given_several_regions_in_turn_runs_each_in_its_own_precision() -> None:
    # The same frame recompiled per region: Dynamo must not turn what names the region into a
    # symbol (an int that differs between compiles does become one, and the trace then fails).
    set_process_default(DEFAULT)
    precisions = [FULL, MEDIUM, FULL]

    def body(x: torch.Tensor) -> torch.Tensor:
        return probe(torch.tanh(x), "node")

    nodes = [with_fp32_precision(p, in_graph=True)(body) for p in precisions]

    def run(node: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return node(x) * 2

    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    for node in nodes:
        torch.testing.assert_close(compiled(node, x), torch.tanh(x) * 2, rtol=0, atol=0)
    assert phases("fwd")["node"] == precisions
    assert current_fp32_precision() == DEFAULT
    assert _graphs_and_breaks() == (len(nodes), 0)  # each region a constant of its own graph (the guide says so)


def test_a_region_that_reaches_a_tensor_needing_grad_by_closure_is_refused() -> None:
    outside = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))

    @with_fp32_precision(FULL, in_graph=True, name="closure")
    def head(x: torch.Tensor) -> torch.Tensor:
        return x @ outside

    compiled = torch.compile(lambda x: head(x).sum(), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"'closure' \(in_graph=True\) uses a tensor which is neither"):
        compiled(torch.randn(4, WIDTH))
    # Also where the argument needs a gradient (the region's training path).
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: head(x).sum(), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"'closure' \(in_graph=True\) uses a tensor"):
        compiled(torch.randn(4, WIDTH, requires_grad=True))


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: float, *, extra: Any = None) -> tuple[torch.Tensor, None]:
        return self.linear(x) * scale, None


class Counted(torch.nn.Module):
    """``linear(x) * k`` over the first ``n`` rows: ints a parent passes that vary between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, k: int, *, n: int) -> torch.Tensor:
        return probe(self.linear(x[:n]) * k, "node")


def test_ints_that_vary_between_calls_are_inputs_of_the_region_not_recompiles() -> None:
    # Dynamo makes an int that changes between calls symbolic (as it does a varying size):
    # the region takes it as an op input, so it compiles no more graphs than the same
    # function without fp32scope does, and runs every value in its precision.
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    eager = Counted()
    node = Fp32ScopedModule(copy.deepcopy(eager), FULL, in_graph=True)
    calls = [(1, 6), (2, 5), (3, 4), (4, 3), (5, 6), (6, 2)]
    x = torch.randn(6, WIDTH)

    plain = torch.compile(lambda x, k, n: eager(x, k, n=n).sum(), backend="aot_eager", fullgraph=True)
    for k, n in calls:
        plain(x, k, n)
    graphs_without_fp32scope = _graphs_and_breaks()[0]
    assert graphs_without_fp32scope < len(calls)  # the control: this torch makes the ints symbolic
    torch._dynamo.reset()
    counters.clear()
    _probe.SEEN.clear()

    compiled = torch.compile(lambda x, k, n: node(x, k, n=n).sum(), backend="aot_eager", fullgraph=True)
    weight = cast("Counted", node.__wrapped__).linear.weight
    for k, n in calls:
        loss = compiled(x, k, n)
        torch.autograd.backward(loss)
        expected = (eager.linear(x[:n]) * k).sum()
        torch.testing.assert_close(loss, expected, rtol=0, atol=0)
        torch.testing.assert_close(weight.grad, torch.autograd.grad(expected, eager.linear.weight)[0], rtol=0, atol=0)
        weight.grad = None
    assert _graphs_and_breaks() == (graphs_without_fp32scope, 0)
    assert phases("fwd")["node"] == [FULL] * len(calls)
    assert phases("bwd")["node"] == [FULL] * len(calls)


def test_a_float_that_varies_between_calls_is_refused_saying_what_to_do() -> None:
    if torch._dynamo.config.specialize_float:
        pytest.skip("this torch's Dynamo specializes floats (a graph per value): no float is symbolic")
    node = Fp32ScopedModule(Scaled(), FULL, in_graph=True, name="scaled")
    compiled = torch.compile(lambda x, s: node(x, s)[0], backend="aot_eager", fullgraph=True)
    compiled(torch.randn(4, WIDTH), 2.0)
    with pytest.raises(Exception, match=r"'scaled' was called with argument 1 of type SymFloat.*specialize_float"):
        compiled(torch.randn(4, WIDTH), 3.0)


def test_a_region_takes_constants_and_returns_tuples() -> None:
    torch.manual_seed(0)
    eager = Scaled()
    node = Fp32ScopedModule(copy.deepcopy(eager), FULL, in_graph=True)
    compiled = torch.compile(lambda x: node(x, 2.0, extra="text")[0], backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    torch.testing.assert_close(compiled(x), eager(x, 2.0)[0], rtol=0, atol=0)
    bad = torch.compile(lambda x: node(x, 2.0, extra=[1, 2j])[0], backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"cannot carry"):  # a complex number: a graph break (under fullgraph, an error)
        bad(x)


@pytest.mark.parametrize("strict", [False, True])
def test_export_of_a_model_with_a_region_is_refused_naming_the_per_node_path(strict: bool) -> None:
    model = Stack(FULL, in_graph=True)
    with pytest.raises(Exception, match=r"torch.export cannot export a scoped call.*save_exported_program"):
        torch.export.export(model, (torch.randn(4, WIDTH),), strict=strict)


def test_a_regions_kept_forward_graph_is_freed_after_its_backward_and_when_never_used() -> None:
    from fp32scope._wrappers import region as _region

    model = Stack(FULL, in_graph=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    compiled(x).sum().backward()
    assert _region._saved == {}
    out = compiled(x)  # a forward whose backward never runs
    assert len(_region._saved) == 1
    del out
    assert _region._saved == {}


def test_in_graph_is_checked_and_kept_by_copies_and_pickles() -> None:
    import pickle

    with pytest.raises(TypeError, match=r"in_graph must be True .* got 'yes' of type str"):
        Fp32ScopedModule(torch.nn.Linear(2, 2), FULL, in_graph="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="in_graph must be True"):
        with_fp32_precision(FULL, in_graph=1)  # type: ignore[arg-type]
    scoped = Fp32ScopedModule(torch.nn.Linear(2, 2), FULL, in_graph=True)
    for other in (copy.copy(scoped), copy.deepcopy(scoped), pickle.loads(pickle.dumps(scoped))):  # noqa: S301
        assert other._self_region is not None
        assert other._self_region is not scoped._self_region
    assert "in_graph=True" in repr(scoped)


def test_a_hugging_face_gpt2_compiled_whole_with_regions_trains_as_its_eager_scoped_twin() -> None:

    set_process_default(DEFAULT)
    eager = tiny_gpt2().train()
    for module in eager.modules():  # the same steps in both: no random numbers drawn
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model = copy.deepcopy(eager)
    policy = {"lm_head": "highest", r"re:transformer\.h\.\d+\.mlp": {"matmul": "highest", "cudnn_allow_tf32": False}}
    scope_modules(eager, policy)
    scope_modules(model, policy, in_graph=True)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied through the region too
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        losses = []
        for net, optimizer in ((compiled, opt), (eager, eager_opt)):
            optimizer.zero_grad()
            loss = net(ids, labels=ids).loss
            torch.autograd.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
        for (name, got), want in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got, want, msg=f"parameter {name}")
    assert current_fp32_precision() == DEFAULT
    assert not any("fp32scope" in str(reason) for reason in counters["graph_break"])


class Parent(torch.nn.Module):
    """A node holding two scoped children: one a graph break, one a region of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = Fp32ScopedModule(Block("broken"), MEDIUM)
        self.region = Fp32ScopedModule(Block("inner"), FULL, in_graph=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.region(self.broken(x))
        return out


def test_scoped_nodes_nested_in_a_region_run_in_their_own_precisions() -> None:
    set_process_default(DEFAULT)
    model = Stack(Fp32Precision("highest", True), in_graph=True, node=Parent())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    with torch.no_grad():
        compiled(x)
    _probe.SEEN.clear()
    torch.autograd.backward(compiled(x).sum())
    fwd, bwd = phases("fwd"), phases("bwd")
    assert fwd["broken"] == bwd["broken"] == [MEDIUM]
    assert fwd["inner"] == bwd["inner"] == [FULL]
    assert fwd["before"] == bwd["before"] == [DEFAULT]
    assert current_fp32_precision() == DEFAULT
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_retain_graph_a_second_backward_through_a_region_as_without_fp32scope(backend: str) -> None:
    # The region inside a compiled parent (not the wrapper compiled itself, which compiles
    # what it wraps and has no region op), against the same parent with the node bare.
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    model = Stack(FULL, in_graph=True)
    bare = copy.deepcopy(model)
    inner: Block = bare.node.__wrapped__
    inner.tag = "bare node"
    bare.node = inner  # type: ignore[assignment]  # the bare node where the proxy was
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    reference = torch.compile(bare, backend=backend, fullgraph=True)
    x = torch.randn(4, WIDTH)
    kept = len(region_module._saved)
    out, expected = compiled(x).square().sum(), reference(x).square().sum()
    # Under Inductor the node is compiled inside its op, its backward's tensors saved by the
    # parent's graph; under aot_eager it runs eagerly, its forward graph kept for the backward.
    inside = backend == "inductor"
    assert len(region_module._saved) == kept + (0 if inside else 1)
    region = model.node._self_region
    assert region is not None
    assert any(entry is not None for entry in region.inner.values()) is inside
    for retain in (True, False):
        _probe.SEEN.clear()
        torch.autograd.backward(out, retain_graph=retain)
        torch.autograd.backward(expected, retain_graph=retain)
        assert phases("bwd")["node"] == [FULL]  # this backward of the region, in its precision
    for mine, theirs in zip(model.parameters(), bare.parameters(), strict=True):
        assert mine.grad is not None
        assert theirs.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad)
    # Both backwards ran; the second freed the compiled graph and with it the kept one.
    assert len(region_module._saved) == kept
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.backward(out)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.backward(expected)
    assert current_fp32_precision() == DEFAULT


@pytest.mark.parametrize(
    ("backend", "eager"),
    [("aot_eager", False), ("inductor", False), ("inductor", True)],
    ids=["eager region", "compiled inside", "eager node"],
)
def test_trace_and_profiler_report_a_regions_backward_as_the_eager_scoped_twins(backend: str, *, eager: bool) -> None:
    # What a user reads to see which precision each node ran in: fp32scope.trace()'s events
    # and the profiler's ranges, for a compiled training step, against the same model scoped
    # eagerly. The region's backward must say backward, as the eager node's does.
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    twin = Stack(FULL, in_graph=False)
    twin.node = Fp32ScopedModule(twin.node.__wrapped__, FULL, name="node", in_graph=False)
    model = copy.deepcopy(twin)
    model.node = Fp32ScopedModule(model.node.__wrapped__, FULL, name="node", in_graph=True, eager=eager)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(4, WIDTH)
    _train_step(compiled, list(model.parameters()), x)  # compiles

    def reported(
        fn: Callable[[torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter]
    ) -> tuple[list[tuple[str, str, Fp32Precision, Fp32Precision]], list[str]]:
        with trace() as events, torch.profiler.profile() as prof:
            _train_step(fn, params, x)
        ranges = [e.name for e in prof.events() if e.name.startswith("fp32scope node ")]
        return [(e.name, e.phase, e.precision, e.observed) for e in events], ranges

    want = reported(twin, list(twin.parameters()))
    assert want[0] == [("node", "forward", FULL, FULL), ("node", "backward", FULL, FULL)]
    assert reported(compiled, list(model.parameters())) == want
    assert _graphs_and_breaks() == (1, 0)
    assert current_fp32_precision() == DEFAULT


def test_a_process_is_never_served_another_process_region_graph_from_inductors_disk_cache() -> None:
    # Two processes make the same parent graphs, each around its own regions, behind which
    # stand nodes of other output shapes. With one disk cache, the second process must
    # compile its own graphs: one served from the first would call this process's node
    # under the first one's shapes (a size assertion, or silently wrong values). A graph
    # names the node's compiled-inside entry, or for an eager=True node the region itself:
    # each process compiles a parent of each (one pair of processes for both: a second
    # compile in a process takes a fraction of the first's time). The disk cache is
    # Inductor's own, where the suite's other compiles leave its C++ kernels built (a
    # fresh one takes the first process 10 s more): a graph another run of this test left
    # there is another process's too, and must not be served either.
    env = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    for kind in ("doubles", "halves"):
        proc = run_module("tests._support.region_process", kind, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        for case in ("compiled inside", "eager node"):
            assert f"{kind}, {case}: compiled equals eager" in proc.stdout
