"""A compiled-inside node's Python state: an attribute changed after compiling gives the new result.

Plain ``torch.compile`` guards a module's attributes (its submodules' too) and recompiles when
one changes. A region's node compiled inside its op is traced by fp32scope, not by Dynamo,
so the op checks the node's plain attributes at every call and runs graphs traced for their
values now: traced again on the first call with new values, kept per value. Each test
compares with the same scoped model run eagerly (``in_graph=False``) after the same change,
and reads with ``python_frames`` that the node still ran as compiled code, not its Python.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest
import torch

from fp32scope import Fp32ScopedModule, Fp32ScopeError, current_fp32_precision, set_process_default
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL
from tests._support.compiled import python_frames, step
from tests._support.probe import phases, probe

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

WIDTH = 8


class Act(torch.nn.Module):
    """A leaky ReLU whose slope is a plain attribute of a submodule of the node."""

    def __init__(self) -> None:
        super().__init__()
        self.negative_slope = 0.1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.leaky_relu(x, self.negative_slope)


class Node(torch.nn.Module):
    """Linear, times ``scale``, through ``act``; a probe reads the precision where it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.act = Act()
        self.scale = 2.0
        self.width = WIDTH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.linear(x) * self.scale)[..., : self.width]
        return probe(out, "node")


class Parent(torch.nn.Module):
    def __init__(self, *, in_graph: bool = True) -> None:
        super().__init__()
        self.before = torch.nn.Linear(WIDTH, WIDTH)
        self.node = Fp32ScopedModule(Node(), FULL, in_graph=in_graph)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.node(self.before(x))
        return out


@pytest.fixture(autouse=True)
def _clear_probes() -> None:
    _probe.SEEN.clear()


def _bare(model: Parent) -> Node:
    return cast("Node", cast("Any", model.node).__wrapped__)


def _twins() -> tuple[Parent, Parent]:
    torch.manual_seed(0)
    model = Parent()
    twin = copy.deepcopy(model)
    twin.node = Fp32ScopedModule(_bare(twin), FULL, in_graph=False)
    return model, twin


def _same(got: tuple[torch.Tensor, list[torch.Tensor]], want: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert len(got[1]) == len(want[1])
    for grad, expected in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5)


def _set(model: Parent, twin: Parent, path: str, value: object) -> None:
    for node in (_bare(model), _bare(twin)):
        owner, _, name = path.rpartition(".")
        setattr(node.get_submodule(owner) if owner else node, name, value)


@contextmanager
def _recompile_limit(limit: int) -> Iterator[None]:
    config = torch._dynamo.config
    name = "recompile_limit" if "recompile_limit" in config._config else "cache_size_limit"  # type: ignore[attr-defined]
    with config.patch(name, limit):
        yield


@pytest.mark.parametrize("train", [True, False], ids=["training", "no_grad"])
@pytest.mark.parametrize("path", ["scale", "act.negative_slope"], ids=["own", "submodule"])
def test_an_attribute_changed_after_compiling_gives_the_new_result_as_plain_torch(path: str, *, train: bool) -> None:
    set_process_default(DEFAULT)
    model, twin = _twins()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.randn(4, WIDTH)
    _same(step(compiled, x, train=train), step(twin, x, train=train))
    for value in (3.0, 0.5, 3.0):  # new values, then one seen before (its kept graphs)
        _set(model, twin, path, value)
        step(compiled, x, train=train)  # (traces the node again for a new value: its Python runs, on fake tensors)
        _probe.SEEN.clear()
        with python_frames(Node.forward.__code__) as frames:
            got = step(compiled, x, train=train)
        assert frames == [0], "the node ran its Python: it should run its compiled graphs for the new value"
        assert phases("fwd")["node"] == [FULL]
        if train:
            assert phases("bwd")["node"] == [FULL]
        assert current_fp32_precision() == DEFAULT
        _same(got, step(twin, x, train=train))
    _set(model, twin, path, 2.0 if path == "scale" else 0.1)  # back to the value compiled first
    _same(step(compiled, x, train=train), step(twin, x, train=train))


def test_under_aot_eager_a_changed_attribute_gives_the_new_result() -> None:
    model, twin = _twins()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, WIDTH)
    step(compiled, x, train=True)
    _set(model, twin, "act.negative_slope", 0.7)
    _same(step(compiled, x, train=True), step(twin, x, train=True))


def test_past_dynamos_recompile_limit_a_changed_attribute_is_an_error_saying_what_to_do() -> None:
    set_process_default(DEFAULT)
    model, twin = _twins()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.randn(4, WIDTH)
    with _recompile_limit(3):
        step(compiled, x, train=False)
        for value in (3.0, 4.0):  # the graphs for three values in all: the limit
            _set(model, twin, "scale", value)
            _same(step(compiled, x, train=False), step(twin, x, train=False))
        _set(model, twin, "scale", 5.0)
        with pytest.raises(Fp32ScopeError, match=r"'scale' = 2\.0, now 5\.0.*recompile limit \(3"):
            step(compiled, x, train=False)
        assert current_fp32_precision() == DEFAULT
        _set(model, twin, "scale", 4.0)  # a value whose graphs are kept still runs
        _same(step(compiled, x, train=False), step(twin, x, train=False))


@pytest.mark.parametrize("train", [True, False], ids=["training", "no_grad"])
def test_a_change_that_alters_the_nodes_outputs_is_an_error_saying_to_compile_again(*, train: bool) -> None:
    set_process_default(DEFAULT)
    model, twin = _twins()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.randn(4, WIDTH)
    step(compiled, x, train=train)
    _set(model, twin, "width", WIDTH // 2)
    with pytest.raises(Fp32ScopeError, match=r"'width' = 8, now 4.*other outputs.*torch\.compiler\.reset"):
        step(compiled, x, train=train)
    assert current_fp32_precision() == DEFAULT
    torch.compiler.reset()  # as the message says: compiled again, for the new width
    _same(step(compiled, x, train=train), step(twin, x, train=train))


def test_an_attribute_changed_between_a_forward_and_its_backward_is_an_error_not_a_wrong_gradient() -> None:
    set_process_default(DEFAULT)
    model, _ = _twins()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.randn(4, WIDTH)
    step(compiled, x, train=True)
    out = compiled(x)
    _bare(model).scale = 3.0
    with pytest.raises(Fp32ScopeError, match="between its forward and its backward"):
        out.sum().backward()
    assert current_fp32_precision() == DEFAULT
