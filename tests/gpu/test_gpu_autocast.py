"""GPU checks for mixed precision: an ``autocast=False`` node under CUDA autocast (fp16, bf16).

The node computes in full float32 (TF32 off) under the caller's autocast, matches the same
stack written by hand step by step in fp16 training with a ``GradScaler``, and keeps doing
so when captured in a CUDA graph. The TF32 environment overrides are checked in fresh
processes. Skipped without CUDA (the TF32 ones without an Ampere-or-newer GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from fp32scope import (
    Fp32AutocastWarning,
    Fp32ScopedModule,
    capture_cuda_graph,
    fp32_precision_scope,
    set_process_default,
)
from tests._support.common import DEFAULT, FULL, ROOT
from tests._support.gpu import needs_tf32

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N = 2048
DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _default_high() -> None:
    set_process_default(DEFAULT)


class MatmulNode(torch.nn.Module):
    def __init__(self, b: torch.Tensor) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(b)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a @ self.b


class HandNode(MatmulNode):
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        with fp32_precision_scope(FULL), torch.autocast("cuda", enabled=False):
            return super().forward(a.float())


def error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((out.double() - reference).abs().max() / reference.abs().max()).item())


@pytest.fixture(scope="module")
def operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(N, N, device="cuda", generator=g)
    b = torch.randn(N, N, device="cuda", generator=g)
    return a, b, a.double() @ b.double()


@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_false_node_computes_in_full_float32(
    dtype: torch.dtype, operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    a, b, reference = operands
    with fp32_precision_scope(FULL):
        float32 = a @ b
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cuda", dtype=dtype), torch.no_grad():
            kept = Fp32ScopedModule(MatmulNode(b), FULL)(a)
            off = Fp32ScopedModule(MatmulNode(b), FULL, autocast=False)(a)
    assert [w.category for w in caught] == [Fp32AutocastWarning]
    assert f"cuda ({dtype})" in str(caught[0].message)
    assert kept.dtype == dtype
    assert off.dtype == torch.float32
    assert torch.equal(off, float32)
    assert error(off, reference) < error(kept, reference) / 10


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_with_a_grad_scaler_matches_the_hand_written_stack(dtype: torch.dtype) -> None:
    torch.manual_seed(0)

    def model(node: torch.nn.Module) -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), node, torch.nn.Linear(256, 8)).cuda()

    b = torch.randn(256, 256)
    wrapped = model(Fp32ScopedModule(MatmulNode(b.clone()), FULL, autocast=False))  # type: ignore[arg-type]
    hand = model(HandNode(b.clone()))
    hand.load_state_dict(wrapped.state_dict())
    results = []
    for m in (wrapped, hand):
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cuda", enabled=dtype is torch.float16)
        g = torch.Generator(device="cuda").manual_seed(1)
        steps = []
        for _ in range(3):
            x = torch.randn(64, 256, device="cuda", generator=g)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=dtype):
                out = m(x)
                loss = out.float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            steps.append([out.detach(), *(p.grad.clone() for p in m.parameters() if p.grad is not None)])
            steps[-1].extend(p.detach().clone() for p in m.parameters())
        results.append(steps)
    for got, expected in zip(*results, strict=True):
        for u, v in zip(got, expected, strict=True):
            assert u.dtype == v.dtype
            assert torch.equal(u, v)


@needs_tf32
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_graph_captured_under_autocast_replays_in_full_float32(
    dtype: torch.dtype, operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    a, b, reference = operands
    node = Fp32ScopedModule(MatmulNode(b), FULL, autocast=False)
    hand = HandNode(b)
    static = a.clone()
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        graphed = capture_cuda_graph(node, [static])
        by_hand = capture_cuda_graph(hand, [static.clone()], precision=FULL)
    out = graphed(a).clone()
    expected = by_hand(a).clone()
    torch.cuda.synchronize()
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    assert error(out, reference) < 1e-5  # full float32, not TF32 (about 1e-3) nor fp16/bf16


def run_fresh(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


_MATMUL = """
import warnings, torch
from fp32scope import Fp32Precision, Fp32ScopedModule
warnings.simplefilter("always")
g = torch.Generator(device="cuda").manual_seed(0)
a = torch.randn(2048, 2048, device="cuda", generator=g)
b = torch.randn(2048, 2048, device="cuda", generator=g)
ref = a.double() @ b.double()
class M(torch.nn.Module):
    def forward(self, x):
        return x @ b
node = Fp32ScopedModule(M(), Fp32Precision({precision!r}, False))
torch.set_float32_matmul_precision("high")
out = node(a)
print("error", ((out.double() - ref).abs().max() / ref.abs().max()).item())
"""


@needs_tf32
def test_the_cublas_override_makes_a_highest_node_run_tf32_and_is_warned() -> None:
    proc = run_fresh(_MATMUL.format(precision="highest"), TORCH_ALLOW_TF32_CUBLAS_OVERRIDE="1")
    assert proc.returncode == 0, proc.stderr
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in proc.stderr
    assert proc.stderr.count("RuntimeWarning") == 1
    err = float(proc.stdout.split()[-1])
    assert err > 1e-4  # TF32, whatever the scope says


@needs_tf32
def test_the_nvidia_override_makes_a_high_node_run_full_float32() -> None:
    proc = run_fresh(_MATMUL.format(precision="high"), NVIDIA_TF32_OVERRIDE="0")
    assert proc.returncode == 0, proc.stderr
    err = float(proc.stdout.split()[-1])
    assert err < 1e-5  # full float32, whatever "high" allows
    control = run_fresh(_MATMUL.format(precision="high"))
    assert float(control.stdout.split()[-1]) > 1e-4
