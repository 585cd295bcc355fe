"""What a graph break inside a loop does to other compiled models (the compiled guide's warning).

On torch 2.8 and later, Dynamo skips a frame whose graph break falls inside a ``for`` loop and
marks its code object: every model that runs that code afterwards runs it uncompiled, also a
model with no scoped node at all. ``torch.nn.Sequential.forward`` is such code. Python
``forward`` frames, counted with ``sys.setprofile``, show what ran uncompiled.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import cast

import pytest
import torch

from fp32scope import Fp32ScopedModule
from tests._support.common import FULL
from tests._support.releases import TORCH_RELEASE

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

SEQUENTIAL = torch.nn.Sequential.forward.__code__


def _module(proxy: Fp32ScopedModule) -> torch.nn.Module:
    # A proxy is a torch.nn.Module at run time (isinstance holds); its static type is wrapt's.
    return cast("torch.nn.Module", proxy)


@contextmanager
def _sequential_frames() -> Iterator[list[int]]:
    seen = [0]

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code is SEQUENTIAL:
            seen[0] += 1

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


def _plain_sequential_runs_python_after(first: torch.nn.Module) -> int:
    x = torch.randn(4, 8)
    with torch.no_grad():
        compiled_first = torch.compile(first, backend="aot_eager")
        compiled_first(x)
        compiled_first(x)
        other = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), backend="aot_eager")
        other(x)
        with _sequential_frames() as seen:
            other(x)
    return seen[0]


def _releases_skip_the_loops_code() -> bool:
    major, minor = (int(part) for part in TORCH_RELEASE.split(".")[:2])
    return (major, minor) >= (2, 8)


def test_a_break_in_a_sequential_makes_every_sequential_run_uncompiled_on_recent_torch() -> None:
    broken = torch.nn.Sequential(
        torch.nn.Linear(8, 8), _module(Fp32ScopedModule(torch.nn.Linear(8, 8), FULL, in_graph=False))
    )
    frames = _plain_sequential_runs_python_after(broken)
    if _releases_skip_the_loops_code():
        assert frames == 1  # the unscoped model's forward ran as Python: uncompiled
    else:  # torch 2.4 compiles the other model still
        assert frames == 0


def test_a_region_in_a_sequential_leaves_every_sequential_compiled() -> None:
    region = _module(Fp32ScopedModule(torch.nn.Linear(8, 8), FULL, in_graph=True))
    regions = torch.nn.Sequential(torch.nn.Linear(8, 8), region)
    assert _plain_sequential_runs_python_after(regions) == 0
