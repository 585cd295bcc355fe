"""GPU checks of in-graph regions: a region inside ``mode="reduce-overhead"`` (CUDA graphs).

A region's op runs the node eagerly at run time; captured into a CUDA graph, its kernels
are recorded inside the node's scope and replayed as recorded, whatever the flags at replay
time. On a GPU the numerics show the precision (TF32 changes a large matmul), against a
float64 reference. Skipped without CUDA.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch._dynamo.utils import counters

from fp32scope import Fp32Precision, Fp32ScopedModule, set_process_default
from tests._support.common import FULL
from tests._support.gpu import needs_tf32

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

N = 2048


class Matmul(torch.nn.Module):
    def __init__(self, b: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("b", b)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a @ cast("torch.Tensor", self.b)


class Model(torch.nn.Module):
    """``x -> node(x) -> same matmul again``: the second matmul runs at the default."""

    def __init__(self, b: torch.Tensor, *, in_graph: bool) -> None:
        super().__init__()
        self.node = Fp32ScopedModule(Matmul(b), FULL, in_graph=in_graph)
        self.tail = Matmul(b)

    def forward(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inside = self.node(a)
        return inside, self.tail(a)


@needs_tf32
def test_a_region_in_reduce_overhead_is_captured_and_replayed_in_its_precision() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(N, N, device="cuda", generator=gen)
    b = torch.randn(N, N, device="cuda", generator=gen)
    reference = a.double() @ b.double()
    set_process_default(Fp32Precision("high", True))
    compiled = torch.compile(Model(b, in_graph=True), mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(4):  # warm up, record, replay
            inside, outside = compiled(a)
            inside, outside = inside.clone(), outside.clone()
    torch.cuda.synchronize()
    full = float((inside.double() - reference).abs().max())
    tf32 = float((outside.double() - reference).abs().max())
    assert tf32 > 10 * full  # the control ran TF32; the region did not
    assert torch.get_float32_matmul_precision() == "high"
    assert sum(counters["graph_break"].values()) == 0


@needs_tf32
def test_a_region_trains_on_the_gpu_with_its_backward_in_its_precision() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(N, N, device="cuda", generator=gen, requires_grad=True)
    b = torch.randn(N, N, device="cuda", generator=gen)
    set_process_default(Fp32Precision("high", True))
    compiled = torch.compile(Model(b, in_graph=True), fullgraph=True)
    inside, _ = compiled(a)
    torch.autograd.backward(inside, torch.ones_like(inside))
    assert a.grad is not None
    reference = torch.ones(N, N, dtype=torch.float64, device="cuda") @ b.double().T
    error = float((a.grad.double() - reference).abs().max())
    with torch.no_grad():
        tf32_error = float(((torch.ones_like(a) @ b.T).double() - reference).abs().max())
    assert tf32_error > 10 * error
    assert torch.get_float32_matmul_precision() == "high"


@needs_tf32
def test_a_region_trains_under_reduce_overhead_in_its_precision_at_every_replay() -> None:
    # CUDA graphs in training: the steps after warmup replay what was recorded (or, where
    # torch declines to record a graph, run it as compiled); each step's gradient must come
    # from the region's full float32 matmul, and a step's result must not leak into the next.
    gen = torch.Generator(device="cuda").manual_seed(0)
    b = torch.randn(N, N, device="cuda", generator=gen)
    set_process_default(Fp32Precision("high", True))
    compiled = torch.compile(Model(b, in_graph=True), mode="reduce-overhead", fullgraph=True)
    reference_b = b.double().T
    for step in range(5):  # warm up, record, replay
        torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]  # torch's untyped API
        a = torch.randn(N, N, device="cuda", generator=gen, requires_grad=True)
        grad_out = torch.randn(N, N, device="cuda", generator=gen)
        inside, _ = compiled(a)
        torch.autograd.backward(inside, grad_out)
        assert a.grad is not None
        reference = grad_out.double() @ reference_b
        error = float((a.grad.double() - reference).abs().max())
        with torch.no_grad():
            tf32_error = float(((grad_out @ b.T).double() - reference).abs().max())
        assert tf32_error > 10 * error, f"step {step}: the region's backward ran at the TF32 default"
        forward_error = float((inside.detach().double() - a.detach().double() @ b.double()).abs().max())
        assert forward_error * 10 < tf32_error, f"step {step}: the region's forward ran at the TF32 default"
    assert torch.get_float32_matmul_precision() == "high"
    assert sum(counters["graph_break"].values()) == 0
