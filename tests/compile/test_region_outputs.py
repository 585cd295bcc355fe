"""In-graph regions at their edges: what a node returns, takes and updates, compared with eager.

Each case runs a parent (``pre -> node -> post``) compiled whole with the node as a region,
against its twin run eagerly with the same node scoped as a plain wrapper: the outputs with
and without gradients, then every gradient, parameters and input alike. A probe inside the
node records the precision it ran in, forward and backward. The nodes are the shapes that
break an opaque op: outputs that alias an input or each other, outputs laid out unlike a
fresh tensor, tensors passed by keyword, weights tied inside the node, outputs mixing
tensors with and without gradients, a region called twice on one input, buffers that
change without their version counter moving (batch norm's running statistics), and outputs
in every container torch's pytree knows (dicts, dataclasses, named tuples, a ModelOutput).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils import _pytree

from fp32scope import (
    Fp32RegionBreakWarning,
    Fp32ScopedModule,
    Fp32ScopeError,
    current_fp32_precision,
    set_process_default,
)
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL, BoomError
from tests._support.compiled import parent_graphs
from tests._support.hf import gpt2_unavailable
from tests._support.probe import phases, probe

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

WIDTH = 8
BACKENDS = ["aot_eager", "inductor"]


@pytest.fixture(autouse=True)
def _clear_probes() -> None:
    _probe.SEEN.clear()


class SplitHeads(torch.nn.Module):
    """Returns a view of its input (an attention's head split): the op's output aliases its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = probe(x, "node")
        return x.view(x.shape[0], 2, WIDTH // 2).transpose(0, 1)


class SplitHeadsOfArgument(torch.nn.Module):
    """A view of the argument itself, no op before it: the output shares the input's storage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], 2, WIDTH // 2).transpose(0, 1)


class HandsBack(torch.nn.Module):
    """Returns its input unchanged, beside its own result."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, probe(self.linear(x), "node")


class TwoViews(torch.nn.Module):
    """Two outputs that are views of one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = probe(self.linear(x), "node")
        return y, y.view(-1, 2, WIDTH // 2)


class Strided(torch.nn.Module):
    """Outputs laid out unlike a fresh tensor: every other column, and rows from the second on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = probe(self.linear(x), "node")
        return y[:, ::2], y[1:]


class Overlapping(torch.nn.Module):
    """An output at an offset of a fresh tensor, rows overlapping: its storage's size, laid out unlike a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = probe(self.linear(x), "node")
        return torch.as_strided(y, y.shape, (0, 1), storage_offset=1)  # every row: y's elements 1 to WIDTH


class WithConstants(torch.nn.Module):
    """Returns constants beside its tensor: None, an int and a float, which the parent adds in."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, int, float]:
        return probe(self.linear(x), "node"), None, 3, 0.5


class GradFreeFirst(torch.nn.Module):
    """Outputs mixing tensors without and with gradients, the gradient-free ones first."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = probe(self.linear(x), "node")
        return y.argmax(-1), y.detach() * 2, y


class Saturating(torch.nn.Module):
    """Ends in tanh, whose backward reads the node's own output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(probe(self.linear(x), "node"))


class Tied(torch.nn.Module):
    """Two linears sharing one weight inside the node."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(WIDTH, WIDTH)
        self.second = torch.nn.Linear(WIDTH, WIDTH)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = probe(self.second(torch.tanh(self.first(x))), "node")
        return out


class Scaled(torch.nn.Module):
    """Takes a tensor by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = probe(self.linear(x) * scale, "node")
        return out


def _sum_of(out: Any) -> torch.Tensor:
    """One tensor from a node's output: every floating-point tensor in it, squared and summed."""
    leaves = out if isinstance(out, tuple) else (out,)
    total = torch.zeros(())
    for leaf in leaves:
        if leaf is None:
            continue
        if isinstance(leaf, (int, float)):  # a constant the node returned, counted too
            total = total + leaf
            continue
        total = total + (leaf.square().sum() if leaf.is_floating_point() else leaf.sum())
    return total


class Parent(torch.nn.Module):
    """``pre -> node -> post``; the node is called as ``call`` says."""

    def __init__(self, node: torch.nn.Module, *, in_graph: bool, call: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(WIDTH, WIDTH)
        self.node = Fp32ScopedModule(node, FULL, in_graph=in_graph)
        self.scale = torch.nn.Parameter(torch.full((WIDTH,), 1.5))
        self.heads = torch.nn.Linear(WIDTH // 2, 3)  # on a head split's output
        self.call = call
        if isinstance(node, Normed):  # the batch norm, reached by the parent (not through the proxy)
            self.stats = node.norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        if self.call is not None:
            called: torch.Tensor = self.call(self, h)
            return called
        out: torch.Tensor = _sum_of(self.node(h)) + h.sum()
        return out


def _twins(
    node: torch.nn.Module, call: Callable[..., Any] | None = None, *, eager_node: bool = False
) -> tuple[Parent, Parent]:
    torch.manual_seed(0)
    eager = Parent(node, in_graph=False, call=call)
    region = copy.deepcopy(eager)
    region.node = Fp32ScopedModule(region.node.__wrapped__, FULL, in_graph=True, eager=eager_node)
    return eager, region


def _step(model: Callable[[torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter], x: torch.Tensor) -> Any:
    for p in params:
        p.grad = None
    x = x.detach().requires_grad_()
    loss = model(x)
    torch.autograd.backward(loss)
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    return loss.detach(), grads, x.grad


def _assert_same(got: Any, want: Any) -> None:
    # Not bit for bit: a compiled backward sums the gradients of a tensor used twice in its
    # own order. The faults looked for here are off by far more (wrong or lost values).
    torch.testing.assert_close(got, want)


def _check(  # noqa: PLR0913  (the case, and what to expect of it)
    backend: str,
    node: torch.nn.Module,
    call: Callable[..., Any] | None = None,
    *,
    probed: bool = True,
    calls: int = 1,
    breaks: bool = False,
    eager_node: bool = False,
) -> None:
    """The region's parent, compiled whole, against its eager twin: outputs, gradients, precisions."""
    set_process_default(DEFAULT)
    eager, region = _twins(node, call, eager_node=eager_node)
    compiled = torch.compile(region, backend=backend, fullgraph=not breaks)
    for _ in range(2):  # the first call compiles; the second runs what was compiled
        x = torch.randn(6, WIDTH)
        with torch.no_grad():
            _assert_same(compiled(x), eager(x))
        _probe.SEEN.clear()
        got = _step(compiled, list(region.parameters()), x)
        if probed:  # each call of the node ran in its precision, forward and backward
            assert phases("fwd")["node"] == [FULL] * calls
            assert phases("bwd")["node"] == [FULL] * calls
        _assert_same(got, _step(eager, list(eager.parameters()), x))
        assert current_fp32_precision() == DEFAULT
    assert (sum(counters["graph_break"].values()) > 0) == breaks


NODES: dict[str, Callable[[], torch.nn.Module]] = {
    "view-of-input": SplitHeads,
    "view-of-argument": SplitHeadsOfArgument,
    "input-handed-back": HandsBack,
    "outputs-aliasing-each-other": TwoViews,
    "strided-and-offset-outputs": Strided,
    "overlapping-output-at-an-offset": Overlapping,
    "constants-beside-a-tensor": WithConstants,
    "grad-free-outputs-first": GradFreeFirst,
    "tied-weights": Tied,
    "output-its-backward-reads": Saturating,
}


@pytest.mark.parametrize("backend", [*BACKENDS, "inductor, node eager"])
@pytest.mark.parametrize("name", list(NODES))
def test_a_regions_outputs_and_gradients_are_eagers(name: str, backend: str) -> None:
    # "node eager": the node runs eagerly inside its op (eager=True) under Inductor, whose
    # code reads the op's outputs by the layout its fake kernel declared.
    eager_node = backend.endswith("node eager")
    _check(backend.split(",", maxsplit=1)[0], NODES[name](), probed=name != "view-of-argument", eager_node=eager_node)


class Ignores(torch.nn.Module):
    """Uses neither its second argument nor one of its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.unused = torch.nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor, ignored: torch.Tensor) -> torch.Tensor:
        del ignored
        out: torch.Tensor = probe(self.linear(x), "node")
        return out


def _ignored_call(parent: Parent, h: torch.Tensor) -> torch.Tensor:
    return _sum_of(parent.node(h, parent.scale * 2.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_the_node_never_uses_gets_no_gradient_as_in_eager(backend: str) -> None:
    # None, not zeros: an optimizer skips a parameter without a gradient, and steps one with zeros.
    _check(backend, Ignores(), _ignored_call)
    set_process_default(DEFAULT)
    _, region = _twins(Ignores(), _ignored_call)
    compiled = torch.compile(region, backend=backend, fullgraph=True)
    torch.autograd.backward(compiled(torch.randn(6, WIDTH)))
    assert region.scale.grad is None
    assert cast("Ignores", region.node).unused.grad is None
    assert cast("Ignores", region.node).linear.weight.grad is not None


def _heads_call(parent: Parent, h: torch.Tensor) -> torch.Tensor:
    # A matmul on the node's output, which is a view of h: h's memory, free once the op has
    # run as far as the graph knows, is where Inductor puts the matmul's result.
    return _sum_of(parent.heads(parent.node(h)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_view_of_an_argument_then_a_matmul_is_eagers(backend: str) -> None:
    _check(backend, SplitHeadsOfArgument(), _heads_call, probed=False)


def _two_views_call(parent: Parent, h: torch.Tensor) -> torch.Tensor:
    # The first output's last use comes before the second's: the graph may put a later
    # result where the first output was, unaware that the second one shares that memory.
    first, second = parent.node(h)
    later = parent.pre(torch.sigmoid(first))  # the sigmoid may be written where first was
    return _sum_of(later) + _sum_of(second)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_outputs_sharing_memory_used_apart_are_eagers(backend: str) -> None:
    _check(backend, TwoViews(), _two_views_call)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tensor_passed_by_keyword_gets_its_gradient(backend: str) -> None:
    def call(parent: Parent, h: torch.Tensor) -> torch.Tensor:
        return _sum_of(parent.node(h, scale=parent.scale))

    _check(backend, Scaled(), call)


class Rotary(torch.nn.Module):
    """Takes its rotary embedding as a tuple ``(cos, sin)`` that needs no gradient, and keeps it for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], *, scale: float) -> torch.Tensor:
        cos, sin = rotary
        q = probe(self.linear(x), "node")
        first, second = q.chunk(2, dim=-1)
        out: torch.Tensor = (q * cos + torch.cat((-second, first), dim=-1) * sin) * scale
        return out


def _rotary_call(parent: Parent, h: torch.Tensor) -> torch.Tensor:
    # cos and sin are made in the compiled graph and used by nothing after the node: their
    # memory is free for the graph's later buffers once the node's op has run.
    angles = torch.arange(WIDTH, dtype=h.dtype) * 0.1 + h.detach()[:, :1]
    out = parent.node(h, (angles.cos(), angles.sin()), scale=0.5)
    later = parent.pre(torch.tanh(out))  # new buffers of cos's and sin's size
    return _sum_of(parent.pre(later))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tuple_argument_the_node_keeps_for_its_backward_stays_its_own(backend: str) -> None:
    _check(backend, Rotary(), _rotary_call)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_region_called_twice_on_one_input_has_a_backward_for_each_call(backend: str) -> None:
    def call(parent: Parent, h: torch.Tensor) -> torch.Tensor:
        return parent.node(h).sum() + parent.node(h).square().sum()  # type: ignore[no-any-return]

    _check(backend, Tied(), call, calls=2)


class Raising(torch.nn.Module):
    """Raises BoomError while ``armed`` (read when it runs)."""

    armed = False

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        if Raising.armed:
            raise BoomError
        return out


def test_flags_are_restored_when_the_node_raises_in_a_training_call() -> None:
    set_process_default(DEFAULT)
    _, region = _twins(Raising())
    compiled = torch.compile(region, backend="aot_eager", fullgraph=True)
    x = torch.randn(6, WIDTH)
    compiled(x).backward()
    Raising.armed = True
    try:
        with pytest.raises(BoomError):
            compiled(x)
    finally:
        Raising.armed = False
    assert current_fp32_precision() == DEFAULT
    compiled(x).backward()  # and the region works on
    assert current_fp32_precision() == DEFAULT


class Normed(torch.nn.Module):
    """A batch norm: its running statistics change without their version counters moving."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = probe(self.norm(x), "node")
        return out


def _reads_statistics_before(parent: Parent, h: torch.Tensor) -> torch.Tensor:
    # Read before the node runs: in eager the old statistics. An op that updates them in
    # place while declaring no mutation lets the compiled read see the new ones.
    statistics = parent.stats.running_mean
    assert statistics is not None
    before = statistics * 1.0
    return _sum_of(parent.node(h)) + (before * h).sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "training"])
def test_a_batch_norms_statistics_read_around_a_region_are_eagers(backend: str, *, grad: bool) -> None:
    set_process_default(DEFAULT)
    eager, region = _twins(Normed(), _reads_statistics_before)
    compiled = torch.compile(region, backend=backend, fullgraph=True)
    for step in range(3):
        x = torch.randn(6, WIDTH)
        with torch.set_grad_enabled(grad):
            got, want = compiled(x), eager(x)
        _assert_same(got, want)
        for (name, mine), theirs in zip(region.named_buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(mine, theirs, msg=f"buffer {name} after step {step}")
    assert sum(counters["graph_break"].values()) == 0


class Holder:
    """An object carrying a tensor in a slot: a region carries only objects whose state is a ``__dict__``."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class UsesHolder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, holder: Holder) -> torch.Tensor:
        out: torch.Tensor = probe(self.linear(x) + holder.tensor, "node")
        return out


def _holder_call(parent: Parent, h: torch.Tensor) -> torch.Tensor:
    return _sum_of(parent.node(h, Holder(h.detach() * 0.5)))


def test_an_object_argument_makes_that_call_a_graph_break_with_one_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # so that a second warning would be recorded, not filtered out
        _check("aot_eager", UsesHolder(), _holder_call, breaks=True)  # four calls through the break
    found = [w for w in caught if issubclass(w.category, Fp32RegionBreakWarning)]
    assert len(found) == 1, [str(w.message) for w in found]
    message = str(found[0].message)
    assert re.search(r"'UsesHolder' .* with argument 1 of type Holder, which a region cannot carry", message)
    # The real reason, and what is carried.
    assert re.search(r"keeps its state outside a __dict__|carries on torch >= 2.13 only", message)
    assert "a region carries plain objects" in message


def test_an_object_argument_under_fullgraph_fails_saying_what_to_do() -> None:
    set_process_default(DEFAULT)
    _, region = _twins(UsesHolder(), _holder_call)
    compiled = torch.compile(region, backend="aot_eager", fullgraph=True)
    pattern = r"'UsesHolder' .* with argument 1 of type Holder, which a region cannot carry.*fullgraph=True"
    with pytest.raises(Fp32ScopeError, match=pattern):  # fp32scope's own error, not Dynamo's
        compiled(torch.randn(6, WIDTH))
    assert current_fp32_precision() == DEFAULT


@dataclasses.dataclass
class Pair:
    """A dataclass output, registered with torch's pytree as a user would register it."""

    first: torch.Tensor
    second: torch.Tensor


if hasattr(_pytree, "register_dataclass"):  # torch >= 2.5
    _pytree.register_dataclass(Pair)
else:
    _pytree.register_pytree_node(Pair, lambda p: ([p.first, p.second], None), lambda v, _: Pair(*v))


class Named(NamedTuple):
    out: torch.Tensor
    rest: dict[str, Any]


def _model_output(y: torch.Tensor, z: torch.Tensor) -> Any:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return BaseModelOutputWithPast(last_hidden_state=y, hidden_states=(z, y))


STRUCTURES: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "dict-nested-with-constants": lambda y, z: {"y": y, "rest": [z, None, 3, 0.5, "s", torch.float16, (y,)]},
    "registered-dataclass": Pair,
    "named-tuple-of-a-dict": lambda y, z: Named(y, {"z": z, "flag": True}),
    "ordered-dict": lambda y, z: collections.OrderedDict(z=z, y=y),
    "model-output": _model_output,
    "tuple-of-a-list": lambda y, z: (y, [z, 2.5]),
}


class Structured(torch.nn.Module):
    """Returns its two tensors in the structure ``build`` makes."""

    def __init__(self, build: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.build = build

    def forward(self, x: torch.Tensor) -> Any:
        y = probe(self.linear(x), "node")
        return self.build(y, torch.tanh(y))


class Returns(torch.nn.Module):
    """``pre -> node``, the node's output returned as it is."""

    def __init__(self, node: torch.nn.Module, *, in_graph: bool) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(WIDTH, WIDTH)
        self.node = Fp32ScopedModule(node, FULL, in_graph=in_graph)

    def forward(self, x: torch.Tensor) -> Any:
        return self.node(self.pre(x))


def _loss(out: Any) -> torch.Tensor:
    return sum((t.square().sum() for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), torch.zeros(()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(STRUCTURES))
def test_a_regions_structured_output_is_eagers_in_one_graph(name: str, backend: str) -> None:
    # The node's output, as the compiled parent returns it: the same classes, structure and
    # constants as the eager scoped twin's, the same tensors and gradients, the node in its
    # precision forward and backward, and one graph without a break (fullgraph=True).
    if name == "model-output" and (why := gpt2_unavailable()):
        pytest.skip(why)
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    eager = Returns(Structured(STRUCTURES[name]), in_graph=False)
    region = copy.deepcopy(eager)
    region.node = Fp32ScopedModule(region.node.__wrapped__, FULL, in_graph=True)
    compiled = torch.compile(region, backend=backend, fullgraph=True)
    for _ in range(2):  # the first call compiles; the second runs what was compiled
        x = torch.randn(6, WIDTH)
        _probe.SEEN.clear()
        got, want = compiled(x), eager(x)
        assert phases("fwd")["node"] == [FULL, FULL]
        got_leaves, got_spec = _pytree.tree_flatten(got)
        want_leaves, want_spec = _pytree.tree_flatten(want)
        assert type(got) is type(want)
        assert got_spec == want_spec
        for mine, theirs in zip(got_leaves, want_leaves, strict=True):
            if isinstance(theirs, torch.Tensor):
                torch.testing.assert_close(mine, theirs)
            else:
                assert type(mine) is type(theirs)
                assert mine == theirs
        _probe.SEEN.clear()
        torch.autograd.backward(_loss(got))
        torch.autograd.backward(_loss(want))
        assert phases("bwd")["node"] == [FULL, FULL]
        for (pname, mine_p), theirs_p in zip(region.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(mine_p.grad, theirs_p.grad, msg=f"gradient of {pname}")
            mine_p.grad = theirs_p.grad = None
        assert current_fp32_precision() == DEFAULT
    assert sum(counters["graph_break"].values()) == 0
    assert parent_graphs() == 1


def test_an_output_holding_an_object_pytree_does_not_know_is_refused_saying_what_to_do() -> None:
    set_process_default(DEFAULT)
    region = Returns(Structured(lambda y, z: (y, Holder(z))), in_graph=True)
    compiled = torch.compile(region, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"'Structured' returned a Holder inside its output") as raised:
        compiled(torch.randn(6, WIDTH))
    assert "in_graph=False" in str(raised.value)
    assert current_fp32_precision() == DEFAULT


class ReturnsItsScale(torch.nn.Module):
    """Returns a plain attribute beside its tensor, in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"y": probe(self.linear(x), "node"), "scale": self.scale}


def test_a_graph_traced_again_returns_the_constants_its_node_returns_now() -> None:
    # The output's constants are the trace's: traced again (a reset, here) after the node's
    # attribute changed, the same call layout gives the new value, as eager code does.
    set_process_default(DEFAULT)
    node = ReturnsItsScale()
    region = Returns(node, in_graph=True)
    x = torch.randn(6, WIDTH)
    assert torch.compile(region, backend="aot_eager", fullgraph=True)(x)["scale"] == 0.5
    node.scale = 2.0
    torch._dynamo.reset()
    assert torch.compile(region, backend="aot_eager", fullgraph=True)(x)["scale"] == 2.0


class ConstantOnly(torch.nn.Module):
    """Returns a constant alone: its attribute, or None."""

    def __init__(self, value: float | None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.value = value

    def forward(self, x: torch.Tensor) -> float | None:
        self.linear(x)
        return self.value


class UsesConstant(torch.nn.Module):
    def __init__(self, value: float | None) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(WIDTH, WIDTH)
        self.node = Fp32ScopedModule(ConstantOnly(value), FULL, in_graph=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        got = self.node(x)
        out: torch.Tensor = self.pre(x) * (1.0 if got is None else got)
        return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [None, 3.0], ids=["none", "float"])
def test_a_node_returning_only_a_constant_returns_it_in_one_graph(value: float | None, backend: str) -> None:
    # (No tensor of the node's reaches the parent's output, so the graph may drop its op, as
    # it drops any unused code: what is checked is the constant, and one graph.)
    set_process_default(DEFAULT)
    model = UsesConstant(value)
    x = torch.randn(6, WIDTH)
    got = torch.compile(model, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(got, model.pre(x) * (1.0 if value is None else value))
    assert current_fp32_precision() == DEFAULT
    assert sum(counters["graph_break"].values()) == 0
    assert parent_graphs() == 1
