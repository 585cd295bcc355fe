"""Decorating compiled node callables with a float32 precision.

An engine sets the process default once with ``set_process_default``; each node that
needs another precision is wrapped *around* its ``torch.compile``'d callable, so that
every call, the first (compiling) one included, runs with the node's precision, and the
process default is back as soon as the call returns.

The nodes read the precision in the middle of their forward through a probe that
``torch.compiler.disable`` keeps out of the graph (reading the flags inside a compiled
frame is a graph break anyway). ``backend="eager"`` keeps the example fast on a CPU: the
wrapping is the same for Inductor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    current_fp32_precision,
    node_fp32_precision,
    precision_of,
    set_process_default,
    with_fp32_precision,
)


def _probe(node: str) -> None:
    """Print the precision the node's kernels run with (eagerly, between graphs)."""
    print(f"  inside {node:<7} {current_fp32_precision()}")


probe: Callable[[str], None]
probe = torch.compiler.disable(_probe)  # type: ignore[no-untyped-call]


class Encoder(torch.nn.Module):
    """A node that declares nothing: it runs under the process default."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probe("encoder")
        return torch.relu(self.linear(x))


class Head(torch.nn.Module):
    """A node that declares full float32 matmuls and no cuDNN TF32."""

    float32_matmul_precision = "highest"
    cudnn_allow_tf32 = False

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probe("head")
        out: torch.Tensor = self.linear(x)
        return out


# A compiled function, decorated: the decorator goes on top of torch.compile.
@with_fp32_precision(Fp32Precision("medium"), name="decode")
@torch.compile(backend="eager")
def decode(logits: torch.Tensor) -> torch.Tensor:
    probe("decode")
    return logits.softmax(dim=-1) @ torch.eye(4)


def main() -> None:
    torch.manual_seed(0)
    set_process_default(Fp32Precision("high", cudnn_allow_tf32=True))
    default = current_fp32_precision()
    print(f"process default: {default}")

    encoder = torch.compile(Encoder(), backend="eager")
    # torch.compile returns an OptimizedModule for a module (annotated as a Callable).
    compiled_head = cast("torch.nn.Module", torch.compile(Head(), backend="eager"))
    # The engine reads the declaration (through the compiled module) at load time ...
    declared = node_fp32_precision("head", compiled_head)
    print(f"head declares:   {declared}")
    # ... and wraps the compiled module, so that every call runs inside the scope.
    head = Fp32ScopedModule(compiled_head, declared, name="head")
    print(f"precision_of(head) = {precision_of(head)}")
    print(f"precision_of(decode) = {precision_of(decode)}")

    x = torch.randn(8, 16)
    # Step 0 compiles every node, inside its scope; step 1 reuses the graphs.
    for step in range(2):
        print(f"step {step}:")
        probs = decode(head(encoder(x)))
        print(f"  after the step: {current_fp32_precision()}")
        assert current_fp32_precision() == default
    print(f"output shape {tuple(probs.shape)}")
    print(f"the process default is back after every call: {default}")


if __name__ == "__main__":
    main()
