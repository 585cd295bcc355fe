"""A region child seen by its compiling parent as the module it wraps: ``isinstance`` and slicing.

Code a compiled parent runs may ask whether a child is a module (``nn.ModuleList`` does, for
each module it takes) and may slice the list holding it (Hugging Face's Llama loops over
``self.layers[: config.num_hidden_layers]``). Eagerly the proxy answers as the module it wraps.

Dynamo on torch 2.15 answers ``isinstance(child, nn.Module)`` from the proxy's own type (its
``isinstance`` folds plain classes with ``issubclass`` of the traced object's type, a rule
the earlier tested releases do not have): without fp32scope's answer there
(``_compat.dynamo_isinstance_as_python``) it said False where eager says True, and a slice
of a ``ModuleList`` holding a region failed, a graph break (an error under
``fullgraph=True``). These tests run on every release; on 2.15 they fail without that answer.

A compiled parent also reads a scoped container as code reads a module (index it, iterate,
``len``, ``parameters()``): the results equal eager's everywhere, and the readings that are a
graph break on a tested release are exactly those the guide's limits list (``BREAKS``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from fp32scope import Fp32Precision, Fp32ScopedModule, fp32_precision_scope, scope_modules
from fp32scope._compat import dynamo_isinstance_as_python
from tests._support import probe as _probe
from tests._support.hf import probe_attentions, tiny_llama
from tests._support.probe import phases, probe
from tests._support.releases import TORCH_RELEASE

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

FULL = Fp32Precision("highest", False)
DEFAULT = Fp32Precision("high", True)


@pytest.fixture(autouse=True)
def _clear_probes() -> None:
    _probe.SEEN.clear()


class Probed(torch.nn.Module):
    """A Linear whose output passes a probe tagged with the layer's index."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.tag = f"layer{index}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return probe(self.linear(x), self.tag)


class Layers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([Probed(i) for i in range(3)])
        self.layers[1] = Fp32ScopedModule(self.layers[1], FULL, name="layer1")  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:2]:  # as Llama's decoder loop
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_fullgraph_parent_slices_a_module_list_holding_a_region_as_eager_does(backend: str) -> None:
    model = Layers()
    x = torch.randn(2, 8)
    with fp32_precision_scope(DEFAULT):
        expected = model(x)
        got = torch.compile(model, backend=backend, fullgraph=True)(x)
    # Inductor's own code for the tanh may differ from eager's in the last bit (torch 2.4.1).
    tolerance = 0.0 if backend == "aot_eager" else None
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    # Eager, then compiled: the region ran in its precision, the layer before it in the default.
    assert phases("fwd") == {"layer0": [DEFAULT, DEFAULT], "layer1": [FULL, FULL]}


class Asks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Fp32ScopedModule(torch.nn.Linear(8, 8), FULL, name="child")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = x + 1 if isinstance(self.child, torch.nn.Module) else x - 1
        linear = module * 2 if isinstance(self.child, torch.nn.Linear) else module * 3
        return linear + 5 if isinstance(self.child, Fp32ScopedModule) else linear + 7


def test_isinstance_of_a_region_child_in_compiled_code_is_the_eager_answer() -> None:
    model = Asks()
    x = torch.zeros(1)
    assert isinstance(model.child, torch.nn.Module)
    assert isinstance(model.child, torch.nn.Linear)
    assert isinstance(model.child, Fp32ScopedModule)
    expected = model(x)
    torch.testing.assert_close(expected, torch.full((1,), 7.0))
    torch.testing.assert_close(torch.compile(model, backend="eager", fullgraph=True)(x), expected)


def test_isinstance_of_other_objects_in_compiled_code_is_unchanged() -> None:
    # Dynamo's own answers for everything that is not a proxy: a plain module, a tensor, a list.
    linear = torch.nn.Linear(2, 2)

    def asks(x: torch.Tensor, items: list[int]) -> torch.Tensor:
        y = x + 1 if isinstance(linear, torch.nn.Module) else x - 1
        y = y * 2 if isinstance(x, torch.Tensor) else y * 3
        y = y + 5 if isinstance(items, tuple) else y + 7
        return y + 11 if isinstance(linear, Fp32ScopedModule) else y + 13

    x = torch.zeros(1)
    torch.testing.assert_close(torch.compile(asks, backend="eager", fullgraph=True)(x, [1]), asks(x, [1]))


def test_a_llama_decoder_layer_as_a_region_trains_in_its_sliced_loop_as_its_eager_scoped_twin() -> None:
    # Llama's model loops over self.layers[: config.num_hidden_layers]: the slice holds the region.
    model = tiny_llama().train()
    probe_attentions(model, r"re:model\.layers\.\d+\.self_attn")
    twin = copy.deepcopy(model)
    scope_modules(model, {"model.layers.1": FULL}, in_graph=True)
    scope_modules(twin, {"model.layers.1": FULL})
    compiled: Callable[..., Any] = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with fp32_precision_scope(DEFAULT):
        loss = compiled(input_ids=ids, use_cache=False).logits.square().mean()
        torch.autograd.backward(loss)
        seen = phases("fwd")["attention"], phases("bwd")["attention"]
        expected = twin(input_ids=ids, use_cache=False).logits.square().mean()
        torch.autograd.backward(expected)
    # Layer 0's attention in the default, layer 1's inside its scoped layer (backward: reversed).
    assert seen == ([DEFAULT, FULL], [FULL, DEFAULT])
    assert sum(counters["graph_break"].values()) == 0
    torch.testing.assert_close(loss, expected)
    for (name, got), want in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, msg=name)


class Reads(torch.nn.Module):
    """A compiled parent reading its scoped ``Sequential`` child as code reads a module."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        # Any: read as the Sequential it wraps, and as the proxy (__wrapped__).
        self.child: Any = Fp32ScopedModule(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()), FULL, name="c")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: PLR0911  (one branch per way of reading)
        if self.how == "index":
            return self.child[0](x)  # type: ignore[no-any-return]
        if self.how == "index wrapped":
            return self.child.__wrapped__[0](x)  # type: ignore[no-any-return]
        if self.how == "iterate":
            for module in self.child:
                x = module(x)
            return x
        if self.how == "len":
            return x * len(self.child)
        if self.how == "child parameters":
            first: torch.Tensor = next(self.child.parameters())
            return x * first.sum()
        if self.how == "parent parameters":
            return x * sum(p.sum() for p in self.parameters())
        return x * len(list(self.modules()))  # "modules"


READS = ["index", "index wrapped", "iterate", "len", "child parameters", "parent parameters", "modules"]
#: The readings that are a graph break in a compiled parent, by tested release (the guide's limits list them).
BREAKS = {"2.4": {"child parameters"}, "2.13": {"index"}, "2.15": set()}


@pytest.mark.parametrize("how", READS)
def test_a_compiled_parent_reads_a_scoped_container_as_eager_does(how: str) -> None:
    model = Reads(how)
    x = torch.randn(2, 4)
    torch.testing.assert_close(torch.compile(model, backend="eager")(x), model(x), rtol=0, atol=0)


def test_the_readings_that_break_the_graph_are_those_the_guide_lists() -> None:
    release = ".".join(TORCH_RELEASE.split(".")[:2])
    if release not in BREAKS:
        pytest.skip(f"torch {TORCH_RELEASE} is not a tested release; BREAKS lists 2.4, 2.13 and 2.15")
    breaking = set()
    for how in READS:
        torch._dynamo.reset()
        counters.clear()
        model = Reads(how)
        torch.compile(model, backend="eager")(torch.randn(2, 4))
        if sum(counters["graph_break"].values()):
            breaking.add(how)
    assert breaking == BREAKS[release], "update BREAKS and the guide's limits (docs/guide/compiled.rst)"


@pytest.mark.skipif(
    not dynamo_isinstance_as_python(Fp32ScopedModule),
    reason=f"torch {TORCH_RELEASE}'s Dynamo answers isinstance of a proxy itself (fp32scope wraps nothing there)",
)
def test_isinstance_of_a_region_child_with_a_non_class_raises_as_eager_does() -> None:
    # fp32scope's answer hands a TypeError back to Dynamo's own handler, which raises it in the traced code.
    child = Fp32ScopedModule(torch.nn.Linear(2, 2), FULL, name="child")

    def asks(x: torch.Tensor) -> torch.Tensor:
        try:
            isinstance(child, 5)  # type: ignore[arg-type]
        except TypeError:
            return x + 1
        return x - 1

    x = torch.zeros(1)
    torch.testing.assert_close(torch.compile(asks, backend="eager", fullgraph=True)(x), asks(x))
