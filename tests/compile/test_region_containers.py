"""A region child seen by its compiling parent as the module it wraps: ``isinstance`` and slicing.

Code a compiled parent runs may ask whether a child is a module (``nn.ModuleList`` does, for
each module it takes) and may slice the list holding it (Hugging Face's Llama loops over
``self.layers[: config.num_hidden_layers]``). Eagerly the proxy answers as the module it wraps.

Dynamo on torch 2.15 answers ``isinstance(child, nn.Module)`` from the proxy's own type
instead (its ``isinstance`` folds plain classes with ``issubclass`` of the traced object's
type, a rule the earlier tested releases do not have): False where eager says True, and a
slice of a ``ModuleList`` holding a region fails, a graph break (an error under
``fullgraph=True``). The tests below are strict expected failures there, so that the day
they pass they say so; the guide's limits name the case and what to do.
"""

from __future__ import annotations

import pytest
import torch

from fp32scope import Fp32Precision, Fp32ScopedModule
from tests._support.releases import TORCH_RELEASE

FULL = Fp32Precision("highest", False)


def _isinstance_by_type() -> bool:
    # Present by name where Dynamo decides isinstance of a plain class by issubclass of the
    # traced object's type (torch 2.15), absent on the releases before it.
    from torch._dynamo.variables import builtin

    return hasattr(builtin, "_VALUE_INDEPENDENT_TYPES")


by_type = pytest.mark.xfail(
    _isinstance_by_type(),
    strict=True,
    reason=f"torch {TORCH_RELEASE}'s Dynamo answers isinstance(region child, nn.Module) from the proxy's type",
)


class Layers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
        self.layers[1] = Fp32ScopedModule(self.layers[1], FULL, name="layer1")  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:2]:  # as Llama's decoder loop
            x = torch.tanh(layer(x))
        return x


@by_type
def test_a_fullgraph_parent_slices_a_module_list_holding_a_region_as_eager_does() -> None:
    model = Layers()
    x = torch.randn(2, 8)
    expected = model(x)
    got = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class Asks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Fp32ScopedModule(torch.nn.Linear(8, 8), FULL, name="child")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1 if isinstance(self.child, torch.nn.Module) else x - 1


@by_type
def test_isinstance_of_a_region_child_in_compiled_code_is_the_eager_answer() -> None:
    model = Asks()
    x = torch.zeros(1)
    assert isinstance(model.child, torch.nn.Module)
    torch.testing.assert_close(torch.compile(model, backend="eager", fullgraph=True)(x), model(x))
