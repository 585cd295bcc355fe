"""GPU checks for training: a scoped node's gradients are computed in the node's precision.

On CUDA, autograd runs the backward on its per-device worker thread, so these also check
that a node's backward scope there nests inside a scope held by the thread that called
``backward()``, and that a real second thread is still refused. Skipped without CUDA (the
TF32 ones without an Ampere-or-newer GPU).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    Fp32ScopeError,
    current_fp32_precision,
    fp32_precision_scope,
    set_process_default,
)
from tests._support.common import DEFAULT, FULL
from tests._support.gpu import needs_tf32
from tests._support.probe import backward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

N = 2048


@pytest.fixture(autouse=True)
def _default_high() -> None:
    set_process_default(DEFAULT)


def weight_grad_error(node: Any, linear: torch.nn.Linear, x: torch.Tensor, upstream: torch.Tensor) -> float:
    """The max error of the weight gradient against float64 (dW = upstream^T @ x)."""
    linear.weight.grad = None
    out = node(x)
    backward(out, upstream)
    torch.cuda.synchronize()
    reference = upstream.double().t() @ x.double()
    assert linear.weight.grad is not None
    return float((linear.weight.grad.double() - reference).abs().max().item())


@needs_tf32
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_weight_gradient_of_a_wrapped_highest_linear_is_full_fp32(compiled: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    linear = torch.nn.Linear(N, N, bias=False, device="cuda")
    x = torch.randn(N, N, device="cuda", generator=gen)
    upstream = torch.randn(N, N, device="cuda", generator=gen)
    target: Any = torch.compile(linear) if compiled else linear
    wrapped = Fp32ScopedModule(target, FULL)
    errors = {}
    for name, node in (("wrapped", wrapped), ("unwrapped", target), ("wrapped-again", wrapped)):
        weight_grad_error(node, linear, x, upstream)  # warm up (and compile) first
        errors[name] = weight_grad_error(node, linear, x, upstream)
    assert errors["unwrapped"] > 10 * errors["wrapped"], errors  # TF32 level against fp32 level
    assert errors["wrapped-again"] < errors["unwrapped"] / 10, errors
    assert current_fp32_precision() == DEFAULT


def test_a_scope_around_backward_nests_the_nodes_backward_on_the_device_thread() -> None:
    seen: list[tuple[Fp32Precision, bool]] = []

    class Record(torch.autograd.Function):
        @staticmethod
        def forward(_ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(_ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen.append((current_fp32_precision(), threading.current_thread() is threading.main_thread()))
            return grad

    class Node(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(64, 64, device="cuda")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = Record.apply(self.linear(x))  # type: ignore[no-untyped-call]
            return out

    node = Fp32ScopedModule(Node(), FULL)
    loss = node(torch.randn(8, 64, device="cuda", requires_grad=True)).sum()
    medium = Fp32Precision("medium", True)
    with fp32_precision_scope(medium):
        backward(loss)  # the main thread waits in the engine; the device thread runs the node
        assert current_fp32_precision() == medium
    assert seen == [(FULL, False)]
    assert current_fp32_precision() == DEFAULT


def test_a_forward_on_another_thread_is_refused_while_the_device_thread_is_in_a_backward_scope() -> None:
    inside = threading.Event()
    release = threading.Event()
    refused: list[BaseException] = []

    class Wait(torch.autograd.Function):
        @staticmethod
        def forward(_ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(_ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            inside.set()
            release.wait(30)
            return grad

    class Node(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = Wait.apply(x * 2)  # type: ignore[no-untyped-call]
            return out

    node = Fp32ScopedModule(Node(), FULL, name="node")
    loss = node(torch.randn(8, device="cuda", requires_grad=True)).sum()

    def other_forward() -> None:
        inside.wait(30)
        try:
            Fp32ScopedModule(torch.nn.Identity(), Fp32Precision("medium"), name="other")(torch.ones(2))
        except Fp32ScopeError as e:
            refused.append(e)
        finally:
            release.set()

    thread = threading.Thread(target=other_forward, name="other")
    thread.start()
    backward(loss)
    thread.join(30)
    assert len(refused) == 1
    assert "around 'other'" in str(refused[0])
    assert current_fp32_precision() == DEFAULT
