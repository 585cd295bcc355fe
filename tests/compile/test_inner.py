"""Regions compiled inside: under Inductor a region's node runs as Inductor's code, in its precision.

Whether the node ran compiled is read from Python itself: its ``forward`` frame starts only
when it runs eagerly (``python_frames``). Its precision is read where its kernels run, by
probes (opaque custom ops recording the flags, forward and backward) inside the compiled
code. Results are compared with the same scoped model run eagerly.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import pytest
import torch
from torch._dynamo.utils import counters

from fp32scope import Fp32Precision, Fp32ScopedModule, current_fp32_precision, set_process_default
from fp32scope._compat import REGION_OPS_UPDATE_CACHES_IN_PLACE
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL
from tests._support.compiled import forbid_recompiles, python_frames
from tests._support.probe import phases, probe
from tests._support.releases import TORCH_RELEASE

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

WIDTH = 16


def close(actual: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    """Equal to rounding: Inductor's code and eager's kernels add in other orders."""
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def _clear_probes() -> None:
    _probe.SEEN.clear()


class Node(torch.nn.Module):
    """Linear + GELU + Linear, with probes inside (they run where the node's kernels run)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(WIDTH, WIDTH)
        self.second = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(probe(torch.nn.functional.gelu(self.first(x)), "node"))
        return out


class Parent(torch.nn.Module):
    def __init__(self, node: torch.nn.Module, precision: Fp32Precision, **options: Any) -> None:
        super().__init__()
        self.before = torch.nn.Linear(WIDTH, WIDTH)
        self.node = Fp32ScopedModule(node, precision, **options)
        self.after = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        h = probe(self.before(x), "before")
        return probe(self.after(self.node(h, *rest)), "after")


def _bare(model: Parent) -> torch.nn.Module:
    node: torch.nn.Module = model.node.__wrapped__
    return node


def _eager_twin(model: Parent) -> Parent:
    # The same scoped model, run eagerly (a graph break where it is compiled: never here).
    twin = copy.deepcopy(model)
    twin.node = Fp32ScopedModule(_bare(twin), FULL, in_graph=False)
    return twin


def _step(model: Any, x: torch.Tensor, *, train: bool) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    if not train:
        with torch.no_grad():
            return model(x), []
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("train", [True, False], ids=["training", "no_grad"])
def test_under_inductor_a_region_node_runs_compiled_inside_its_op_in_its_precision(train: bool) -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    model = Parent(Node(), FULL)
    twin = _eager_twin(model)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.randn(4, WIDTH)
    _step(compiled, x, train=train)  # compiles
    for p in model.parameters():
        p.grad = None
    _probe.SEEN.clear()
    with forbid_recompiles(), python_frames(Node.forward.__code__) as frames:
        out, grads = _step(compiled, x, train=train)
    assert frames == [0]  # no Python forward of the node: it ran as Inductor's code
    assert phases("fwd") == {"before": [DEFAULT], "node": [FULL], "after": [DEFAULT]}
    if train:
        assert phases("bwd") == {"after": [DEFAULT], "node": [FULL], "before": [DEFAULT]}
    expected, expected_grads = _step(twin, x, train=train)
    close(out, expected)
    for grad, want in zip(grads, expected_grads, strict=True):
        close(grad, want)
    assert current_fp32_precision() == DEFAULT
    assert sum(counters["graph_break"].values()) == 0


class Unused(torch.nn.Module):
    """Reads only its first argument: the second, which needs a gradient, gets none."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out


def test_an_input_a_compiled_inside_node_never_reads_gets_no_gradient_as_in_eager() -> None:
    model = Parent(Unused(), FULL)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH, requires_grad=True)
    compiled(x, y).sum().backward()  # compiles (the traces run the node's Python on fake tensors)
    with python_frames(Unused.forward.__code__) as frames:
        compiled(x, y).sum().backward()
    assert frames == [0]  # compiled inside
    assert y.grad is None  # None, as eager leaves it: not zeros, which an optimizer would step on
    assert model.node.linear.weight.grad is not None


class Hooked(Node):
    """A node with a forward hook that notes its calls (in a list: no plain attribute of it changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.register_forward_hook(self._note)

    def _note(self, *_: object) -> None:
        self.seen.append(1)

    @property
    def calls(self) -> int:
        return len(self.seen)


class Norm(torch.nn.Module):
    """A batch norm in training: it updates its running statistics in place."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(probe(self.linear(x), "node"))
        return out


class Nested(torch.nn.Module):
    """A node holding a scoped node of another precision."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = torch.nn.Linear(WIDTH, WIDTH)
        self.inner = Fp32ScopedModule(Node(), DEFAULT, in_graph=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(probe(self.outer(x), "nested outer"))
        return out


def _eager_nodes() -> dict[str, tuple[torch.nn.Module, dict[str, Any]]]:
    return {
        "eager-node": (Node(), {"eager": True}),
        "forward-hook": (Hooked(), {}),
        "batch-norm-updating-buffers": (Norm(), {}),
        "nested-scoped-node": (Nested(), {}),
    }


@pytest.mark.parametrize("kind", list(_eager_nodes()))
def test_a_node_the_compiled_code_cannot_hold_exactly_runs_eagerly_in_its_op_as_eager_runs_it(kind: str) -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    node, options = _eager_nodes()[kind]
    model = Parent(node, FULL, **options)
    twin = _eager_twin(model)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.randn(4, WIDTH)
    for step in range(3):
        calls = getattr(node, "calls", 0)
        with python_frames(type(node).forward.__code__) as frames:
            out, grads = _step(compiled, x, train=True)
        expected, expected_grads = _step(twin, x, train=True)
        if step:  # (the first call compiles: the traces run the node's Python on fake tensors)
            assert frames == [1]  # the node's own forward, once per call
            assert getattr(node, "calls", 0) - calls == (kind == "forward-hook")  # and its hook
        close(out, expected)
        for grad, want in zip(grads, expected_grads, strict=True):
            close(grad, want)
        for mine, theirs in zip(model.buffers(), twin.buffers(), strict=True):
            torch.testing.assert_close(mine, theirs)
    assert phases("fwd")["node"][-1] == (DEFAULT if kind == "nested-scoped-node" else FULL)
    if kind == "nested-scoped-node":
        assert phases("fwd")["nested outer"][-1] == FULL
    assert sum(counters["graph_break"].values()) == 0


class Passthrough(torch.nn.Module):
    """Returns its input's view beside a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), x.view(-1)


def test_a_node_returning_a_view_of_its_input_runs_eagerly_with_eagers_results() -> None:
    class Caller(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.node = Fp32ScopedModule(Passthrough(), FULL)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, flat = self.node(x * 2)
            total: torch.Tensor = out.sum() + flat.square().sum()
            return total

    model = Caller()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.randn(4, WIDTH, requires_grad=True)
    compiled(x)  # compiles
    with python_frames(Passthrough.forward.__code__) as frames:
        got = compiled(x)
    got.backward()
    grad = x.grad
    x.grad = None
    model(x).backward()
    assert frames == [1]
    close(got, model(x))
    close(grad, x.grad)


class Counting(Node):
    """A node whose forward counts its calls on itself."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def test_a_node_whose_forward_changes_its_own_attributes_runs_its_python_at_every_call() -> None:
    model = Parent(Counting(), FULL)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.randn(4, WIDTH)
    _step(compiled, x, train=True)
    calls = cast("Counting", _bare(model)).calls
    with python_frames(Counting.forward.__code__) as frames:
        _step(compiled, x, train=True)
    assert frames == [1]
    assert cast("Counting", _bare(model)).calls == calls + 1


def test_a_node_called_with_tensors_of_dynamic_shape_runs_eagerly_in_its_op() -> None:
    set_process_default(DEFAULT)
    model = Parent(Node(), FULL)
    twin = _eager_twin(model)
    compiled = torch.compile(model, backend="inductor", fullgraph=True, dynamic=True)
    for rows in (4, 6, 6):
        x = torch.randn(rows, WIDTH)
        with python_frames(Node.forward.__code__) as frames:
            out, grads = _step(compiled, x, train=True)
        expected, expected_grads = _step(twin, x, train=True)
        close(out, expected)
        for grad, want in zip(grads, expected_grads, strict=True):
            close(grad, want)
        if rows == 6 and frames != [1]:  # (4 compiles; the first 6 may too, where 2.4 specializes)
            assert frames[0] > 1
    assert frames == [1]  # warm: the node's own forward, once per call
    assert phases("fwd")["node"][-1] == FULL


@pytest.mark.parametrize("train", [True, False], ids=["training", "no_grad"])
def test_inductor_generates_a_compiled_inside_node_code_in_the_node_precision(train: bool) -> None:
    # Inductor chooses some precision while it generates code (Triton's TF32 switches, the
    # CPU's packed bf16 linear): read the precision where its post-grad passes run.
    import torch._inductor.config

    seen: list[tuple[bool, Fp32Precision]] = []

    def record(graph: torch.fx.Graph) -> None:
        holds_region = any(str(node.target).startswith("fp32scope.inner") for node in graph.nodes)
        seen.append((holds_region, current_fp32_precision()))

    set_process_default(DEFAULT)
    model = Parent(Node(), FULL)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    with torch._inductor.config.patch(post_grad_custom_post_pass=record, fx_graph_cache=False):
        _step(compiled, torch.randn(4, WIDTH), train=train)
    graphs = 2 if train else 1  # the parent's, and the node's: forward (and backward)
    assert sorted(seen, key=lambda item: item[0]) == [(False, FULL)] * graphs + [(True, DEFAULT)] * graphs


class Dropped(torch.nn.Module):
    """Dropout, then a per-feature weight: the weight's gradient reads the forward's mask."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.nn.functional.dropout(x, 0.5, training=self.training) * self.weight
        return out


def test_a_compiled_inside_node_drawing_random_numbers_draws_anew_each_call_and_its_backward_uses_its_mask() -> None:
    class Caller(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.node = Fp32ScopedModule(Dropped(), FULL)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.node(x), self.node(x)  # two calls on one input: two draws

    model = Caller()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.ones(64, WIDTH)
    compiled(x)
    weight = _bare(cast("Parent", model)).weight
    with python_frames(Dropped.forward.__code__) as frames:
        first, second = compiled(x)
    assert frames == [0]
    assert not torch.equal(first == 0, second == 0)  # each call its own mask
    first.sum().backward()
    # d(sum(mask * x / 0.5 * w)) / dw = sum over rows of (mask * x / 0.5) = sum(first / w)
    torch.testing.assert_close(weight.grad, (first / weight).sum(0).detach())


def test_a_compiled_inside_node_backward_takes_its_inputs_themselves_not_copies_of_their_views() -> None:
    # A Linear's backward reads its input and its weight (transposed twice): leaving the
    # forward op as outputs, each would be a copy at every step. The backward takes the op's
    # inputs themselves and replays the views.
    from fp32scope._wrappers import inner

    model = Parent(Node(), FULL)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    _step(compiled, torch.randn(4, WIDTH), train=True)
    region = model.node._self_region
    assert region is not None
    (entry,) = [e for e in region.inner.values() if e is not None]
    outputs = list(next(n for n in reversed(entry.forward.gm.graph.nodes) if n.op == "output").args[0])
    assert not any(node.op == "placeholder" or inner._is_view(node) for node in outputs)
    taken = {index for kind, index in entry.sources if kind == 0}
    assert taken >= {0, 1, 3}  # the input, and both weights (the op's inputs: x, w1, b1, w2, b2)


def _write_column(k: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    k.select(1, 2).copy_(probe(x, "node"))  # as a static cache's update: one position of a bigger tensor
    return [k.sum(1) * 2]


@pytest.mark.skipif(
    not REGION_OPS_UPDATE_CACHES_IN_PLACE, reason=f"torch {TORCH_RELEASE}: regions copy what they update in place"
)
@pytest.mark.parametrize("layout", ["as compiled", "transposed"])
def test_a_compiled_inside_graph_writes_the_inputs_it_updates_in_place_where_they_are(layout: str) -> None:
    # An inference graph built to update its input in place (a cache's keys): its op writes
    # the caller's tensor itself and returns only the node's outputs, in the node's
    # precision. A tensor laid out otherwise than compiled for runs on a copy laid out so,
    # written back after.
    from fp32scope._flags.scope import wrapper_scope
    from fp32scope._wrappers import inner

    set_process_default(DEFAULT)
    example = torch.zeros(4, 8)
    entry = inner.build(
        _write_column,
        [example, torch.zeros(4)],
        0,
        (wrapper_scope(FULL, "node"), wrapper_scope(FULL, "node", "backward")),
        updates=(0,),
        in_place=(0,),
    )
    assert entry is not None
    assert entry.in_place == (0,)
    k = torch.randn(4, 8) if layout == "as compiled" else torch.randn(8, 4).t()
    x = torch.randn(4)
    want_k = k.clone()
    want = _write_column(want_k, x)
    _probe.SEEN.clear()
    (out,) = [inner._update_op(1)(0, entry.number, [x], [k])]
    assert phases("fwd")["node"] == [FULL]
    assert torch.equal(k, want_k)
    close(out, want[0])
    assert current_fp32_precision() == DEFAULT
