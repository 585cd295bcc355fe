"""A whole training loop: torch.compile, an optimizer, and one block in full float32.

The process default is "high" (TF32 matmuls on an Ampere-or-newer GPU, cuDNN TF32). One
block of the model, the router, needs full float32 in its outputs and in its gradients:
it declares so on its class, and the model wraps it in ``Fp32ScopedModule``. The whole
model is then compiled; the optimizer steps as usual. The wrapper scopes the router's
forward and its backward; everything else runs under the default.

A probe inside the router prints the precision its forward and its backward run with (a
``torch.compiler.disable``'d identity, so it runs eagerly, where it can read the flags).
``backend="aot_eager"`` keeps the example fast on a CPU; drop it to use Inductor, the
default: the wrapping is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    current_fp32_precision,
    node_fp32_precision,
    set_process_default,
)


class _Probe(torch.autograd.Function):
    """Identity that prints the precision its forward and its backward run with."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        del ctx
        print(f"  router forward:  {current_fp32_precision()}")
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        del ctx
        print(f"  router backward: {current_fp32_precision()}")
        return grad


def _probe(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _Probe.apply(x)  # type: ignore[no-untyped-call]
    return out


# Runs eagerly, between the router's graphs, where it can read the flags.
probe: Callable[[torch.Tensor], torch.Tensor]
probe = torch.compiler.disable(_probe)  # type: ignore[no-untyped-call]


class Router(torch.nn.Module):
    """The block that needs full float32, and says so."""

    float32_matmul_precision = "highest"
    cudnn_allow_tf32 = False

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(probe(x)))


class Model(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
        router = Router(width)
        # Read the declaration (checked now, at build time) and wrap the block.
        precision = node_fp32_precision("router", router)
        self.router = Fp32ScopedModule(router, precision, name="router")
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out: torch.Tensor = self.out(h * self.router(h))
        return out


def main() -> None:
    torch.manual_seed(0)
    default = Fp32Precision("high", cudnn_allow_tf32=True)
    set_process_default(default)  # once, at start-up

    model = Model()
    # Compile the whole model, the wrapped block included.
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 32), torch.randn(64, 1)

    losses = []
    for step in range(3):
        print(f"step {step}:")
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(loss.item())
        print(f"  loss {loss.item():.4f}; after the step: {current_fp32_precision()}")
        assert current_fp32_precision() == default

    assert losses[-1] < losses[0]
    print(f"the loss went down ({losses[0]:.4f} -> {losses[-1]:.4f})")
    print("the default is back after every step")


if __name__ == "__main__":
    main()
