"""GPU checks for fp32scope.trace() and the profiler ranges: the backward on autograd's device thread.

On CUDA, autograd runs a node's backward on its per-device worker thread (a C++ thread,
which Python names ``Dummy-N``): the trace and the profiler must see it there too.
Skipped without CUDA.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fp32scope import Fp32Precision, Fp32ScopedModule, set_process_default, trace
from tests._support.common import FULL
from tests._support.probe import backward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_backward_on_autograds_device_thread_is_traced() -> None:
    set_process_default(Fp32Precision("high", True))
    head = Fp32ScopedModule(torch.nn.Linear(64, 64).cuda(), FULL, name="head")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    with trace() as events:
        backward(head(x).sum())
    torch.cuda.synchronize()
    assert [(e.name, e.phase, e.observed) for e in events] == [("head", "forward", FULL), ("head", "backward", FULL)]
    assert events[0].thread == threading.current_thread().name
    assert events[1].thread != events[0].thread  # autograd's device thread


def test_the_profiler_range_of_the_backward_holds_its_cuda_kernels() -> None:
    head = Fp32ScopedModule(torch.nn.Linear(64, 64).cuda(), FULL, name="head")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        backward(head(x).sum())
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.name.startswith("fp32scope")]
    assert names == ["fp32scope head forward highest/cudnn-fp32", "fp32scope head backward highest/cudnn-fp32"]
