"""A region's node is compiled by its parent's backend, in its precision, whatever that backend is.

Under Inductor the node is compiled inside its op (``tests/compile/test_inner.py``). Under any
other backend (``aot_eager``, ``eager``, a user's own callable) the op compiles the node with
that backend, inside the node's scope, as ``torch.compile`` of the child alone would: its
``forward`` runs as compiled code after the first call (no Python frame of it,
``python_frames``), and probes read the node's precision where its kernels run, forward and
backward. An ``eager=True`` node stays eager. Results are compared with the same scoped model
run eagerly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch._dynamo.utils import counters

from fp32scope import Fp32ScopedModule, current_fp32_precision, set_process_default
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL
from tests._support.compiled import forbid_recompiles, nodes_compile_in_op, python_frames, step
from tests._support.probe import phases, probe

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

WIDTH = 8


class Node(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return probe(torch.tanh(self.linear(x)), "node")


class Parent(torch.nn.Module):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.before = torch.nn.Linear(WIDTH, WIDTH)
        self.node = Fp32ScopedModule(Node(), FULL, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return probe(self.node(self.before(x)), "after")


@pytest.fixture(autouse=True)
def _clear_probes() -> None:
    _probe.SEEN.clear()


class Counting:
    """A user's backend: runs each graph as Dynamo hands it over, counting them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return gm.forward


def _twin(model: Parent) -> Parent:
    twin = copy.deepcopy(model)
    twin.node = Fp32ScopedModule(cast("Any", twin.node).__wrapped__, FULL, in_graph=False)
    return twin


@pytest.mark.parametrize("train", [True, False], ids=["training", "no_grad"])
@pytest.mark.parametrize("backend", ["aot_eager", "eager", "callable"])
def test_a_regions_node_is_compiled_by_its_parents_backend_in_its_precision(backend: str, *, train: bool) -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    model = Parent()
    twin = _twin(model)
    user = Counting()
    compiled = torch.compile(model, backend=user if backend == "callable" else backend, fullgraph=True)
    x = torch.randn(4, WIDTH)
    # Compiles the parent, then the node in its op; the second call may compile the node once
    # more (aot_eager's first run hands it tensors without autograd's dispatch keys).
    for _ in range(2):
        step(compiled, x, train=train)
    _probe.SEEN.clear()
    with forbid_recompiles(), python_frames(Node.forward.__code__) as frames:
        got = step(compiled, x, train=train)
    assert frames == ([0] if nodes_compile_in_op() else [1])  # compiled code, not the node's Python
    assert phases("fwd") == {"node": [FULL], "after": [DEFAULT]}
    if train:
        assert phases("bwd") == {"after": [DEFAULT], "node": [FULL]}
    assert current_fp32_precision() == DEFAULT
    if backend == "callable" and nodes_compile_in_op():
        assert user.graphs >= 2  # the parent's graph, and the node's own, compiled in its op
    want = step(twin, x, train=train)
    torch.testing.assert_close(got[0], want[0])
    for grad, expected in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(grad, expected)
    assert sum(counters["graph_break"].values()) == 0


def test_an_eager_node_stays_eager_under_any_backend() -> None:
    model = Parent(eager=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    step(compiled, x, train=True)
    with python_frames(Node.forward.__code__) as frames:
        step(compiled, x, train=True)
    assert frames == [1]  # its own eager forward, at every call, in its op
    assert phases("fwd")["node"][-1] == FULL
