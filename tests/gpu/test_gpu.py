"""GPU checks: TF32 is chosen when a kernel is launched, compiled or captured.

Skipped without CUDA (and the TF32 ones without an Ampere-or-newer GPU). Run them on a GPU
machine with ``pytest tests/gpu -m gpu`` (``tests/gpu/run_on_device.sh`` does the set-up).
"""

from __future__ import annotations

from typing import cast

import pytest
import torch

from fp32scope import Fp32Precision, Fp32ScopedModule, capture_cuda_graph, set_process_default
from tests._support.common import FULL
from tests._support.gpu import needs_tf32

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

N = 4096


@pytest.fixture(scope="module")
def operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(N, N, device="cuda", generator=gen)
    b = torch.randn(N, N, device="cuda", generator=gen)
    return a, b, (a.double() @ b.double())


def error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference).abs().max().item())


class MatmulNode(torch.nn.Module):
    float32_matmul_precision = "highest"
    cudnn_allow_tf32 = False

    def __init__(self, b: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("b", b)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        b = cast("torch.Tensor", self.b)
        return a @ b


def errors_under(precision: str, a: torch.Tensor, b: torch.Tensor, reference: torch.Tensor) -> float:
    torch.set_float32_matmul_precision(precision)
    return error(a @ b, reference)


@pytest.fixture
def threshold(operands: tuple[torch.Tensor, ...]) -> float:
    """An error between full-fp32's and TF32's; the process default is then "high"."""
    a, b, reference = operands
    full = errors_under("highest", a, b, reference)
    tf32 = errors_under("high", a, b, reference)
    set_process_default(Fp32Precision("high", True))
    return (full + tf32) / 4


@needs_tf32
def test_tf32_changes_a_large_matmul_against_float64(operands: tuple[torch.Tensor, ...]) -> None:
    a, b, reference = operands
    full = errors_under("highest", a, b, reference)
    tf32 = errors_under("high", a, b, reference)
    assert tf32 > 10 * full


@needs_tf32
def test_a_scoped_compiled_module_gives_full_fp32_under_a_high_default(
    operands: tuple[torch.Tensor, ...], threshold: float
) -> None:
    a, b, reference = operands
    node = Fp32ScopedModule(torch.compile(MatmulNode(b)), FULL)
    with torch.no_grad():
        for _ in range(3):
            out = node(a)
    assert torch.get_float32_matmul_precision() == "high"
    assert error(out, reference) < threshold


@needs_tf32
def test_a_graph_captured_in_the_scope_replays_in_full_fp32_afterwards(
    operands: tuple[torch.Tensor, ...], threshold: float
) -> None:
    a, b, reference = operands
    node = Fp32ScopedModule(MatmulNode(b), FULL)
    static_a = a.clone()
    with torch.no_grad():
        graphed = capture_cuda_graph(node, [static_a])
    assert torch.get_float32_matmul_precision() == "high"  # the scope has exited
    out: torch.Tensor = graphed(a).clone()
    torch.cuda.synchronize()
    assert error(out, reference) < threshold
    # Control: a graph captured under the default replays with TF32.
    unscoped = capture_cuda_graph(MatmulNode(b), [static_a.clone()])
    replayed: torch.Tensor = unscoped(a)
    assert error(replayed.clone(), reference) > threshold


@needs_tf32
def test_make_graphed_callables_on_a_scoped_module_replays_the_graph_in_full_fp32(
    operands: tuple[torch.Tensor, ...], threshold: float
) -> None:
    a, b, reference = operands
    module = MatmulNode(b)
    node = Fp32ScopedModule(module, FULL)
    sample = a.clone().requires_grad_(False)
    graphed = torch.cuda.make_graphed_callables(node, (sample,))
    assert graphed is node
    assert module.forward is not MatmulNode.forward.__get__(module)  # the graph landed on the module
    with torch.no_grad():
        out = cast("torch.Tensor", node(a))
    torch.cuda.synchronize()
    assert error(out, reference) < threshold


@needs_tf32
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes_honor_the_scope(mode: str, operands: tuple[torch.Tensor, ...], threshold: float) -> None:
    a, b, reference = operands
    node = Fp32ScopedModule(torch.compile(MatmulNode(b), mode=mode), FULL)
    with torch.no_grad():
        for _ in range(4):  # warmup, record, replay
            out = node(a).clone()
    torch.cuda.synchronize()
    assert torch.get_float32_matmul_precision() == "high"
    assert error(out, reference) < threshold


def test_capture_helper_checks_its_inputs() -> None:
    with pytest.raises(TypeError, match="CUDA tensor"):
        capture_cuda_graph(torch.nn.Identity(), [torch.ones(2)])
