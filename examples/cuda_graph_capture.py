"""Wrapping a module before CUDA graph capture.

TF32 is chosen when a kernel is captured, and a replayed graph keeps what it was
captured with. So the warmup and the capture must run inside the node's scope:

* ``capture_cuda_graph(scoped, [static_x])`` warms up on a side stream and captures,
  both inside the scope, and returns a callable that replays the graph;
* ``torch.cuda.make_graphed_callables`` on an ``Fp32ScopedModule`` captures the forward
  through the proxy (inside the scope) and installs the graph by assigning
  ``module.forward``, which the proxy forwards to the wrapped module, so that later
  calls replay the graph.

Without a CUDA device the script says what it would do, shows on the CPU that the proxy
forwards a ``forward`` assignment the way ``make_graphed_callables`` makes it, and exits
0.
"""

from __future__ import annotations

from typing import Any

import torch

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    capture_cuda_graph,
    current_fp32_precision,
    set_process_default,
)

PRECISION = Fp32Precision("highest", cudnn_allow_tf32=False)


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def on_gpu() -> None:
    device = torch.device("cuda")
    head = Fp32ScopedModule(Head().to(device).eval(), PRECISION, name="head")
    x = torch.randn(64, 256, device=device)
    with torch.no_grad():
        expected = head(x)
        graph = capture_cuda_graph(head, [torch.zeros_like(x)], warmup=3)
        print(f"captured: {graph!r}")
        out = graph(x).clone()  # replays as captured, under any flags
    matches = torch.allclose(out, expected, atol=1e-5)
    print(f"capture_cuda_graph: replay matches the eager call: {matches}")

    trained = Fp32ScopedModule(Head().to(device), PRECISION, name="trained head")
    sample = (torch.randn(64, 256, device=device),)
    graphed = torch.cuda.make_graphed_callables(trained, sample)
    y = graphed(x)
    assert isinstance(y, torch.Tensor)
    # The backward graph was captured outside the proxy's call: under the default.
    y.sum().backward()  # type: ignore[no-untyped-call]
    print(f"make_graphed_callables: graphed is the proxy: {graphed is trained}")
    print(f"output {tuple(y.shape)}")
    print(f"process default afterwards: {current_fp32_precision()}")


def on_cpu() -> None:
    print("No CUDA device: this is what the script does on a GPU:")
    print("  1. capture_cuda_graph(Fp32ScopedModule(head, highest), [static_x]):")
    print("     warmup and capture in the scope;")
    print("     replays keep full float32 whatever the flags are at replay time.")
    print("  2. torch.cuda.make_graphed_callables(Fp32ScopedModule(head, p), ...):")
    print("     forward captured in the scope; the graph is installed through the")
    print("     proxy's forward and replayed by every call.")
    try:
        capture_cuda_graph(Fp32ScopedModule(Head(), PRECISION), [torch.zeros(1, 256)])
    except RuntimeError as error:
        print(f"capture_cuda_graph on this machine: RuntimeError: {error}")

    # What make_graphed_callables does after capturing, shown with a plain function.
    head = Fp32ScopedModule(Head(), PRECISION, name="head")
    seen: list[Fp32Precision] = []

    def installed_forward(*_args: Any) -> str:
        seen.append(current_fp32_precision())
        return "graph replayed"

    head.forward = installed_forward  # the assignment lands on the wrapped module
    result = head(torch.zeros(1, 256))
    gives = f"calling the proxy gives {result!r}, run in {seen[0]}"
    print(f"after 'module.forward = graphed': {gives}")
    held = head.__wrapped__.forward is installed_forward
    print(f"the wrapped module holds it: {held}")
    print(f"process default afterwards: {current_fp32_precision()}")


def main() -> None:
    set_process_default(Fp32Precision("high", cudnn_allow_tf32=True))
    if torch.cuda.is_available():
        on_gpu()
    else:
        on_cpu()


if __name__ == "__main__":
    main()
