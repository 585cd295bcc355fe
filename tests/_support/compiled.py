"""Helpers for the tests of compiled nodes: a recording backend, a no-recompile guard, a runner.

Used by ``tests/compile/`` and by the compiled-policy tests in ``tests/wrappers/``; the
``fresh_dynamo`` fixture that resets Dynamo around a test lives in ``tests/conftest.py``.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, cast

import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch._aot_autograd.utils import make_boxed_func

from fp32scope._compat import DYNAMO_RESETS_MEDIUM
from fp32scope._wrappers import trampoline as _trampoline
from tests._support.common import DEFAULT

#: The feature width of the input :func:`run` feeds.
WIDTH = 8


@contextmanager
def python_frames(code: CodeType) -> Iterator[list[int]]:
    """Count the Python frames of ``code`` started inside the block: what ran uncompiled."""
    seen = [0]

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code is code:
            seen[0] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


@contextmanager
def forbid_recompiles() -> Iterator[None]:
    """Make any recompile an error (torch >= 2.6 spells the old error_on_recompile as a limit)."""
    config = torch._dynamo.config
    if "error_on_recompile" in config._config:  # type: ignore[attr-defined]
        with config.patch(error_on_recompile=True):
            yield
    else:
        with config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            yield


class Recording:
    """An aot_autograd backend noting each graph it compiles and the matmul precision then."""

    def __init__(self) -> None:
        self.forward: list[str] = []
        self.backward: list[str] = []

    def _note(self, seen: list[str]) -> Callable[[torch.fx.GraphModule, Any], Callable[..., Any]]:
        def compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
            seen.append(torch.get_float32_matmul_precision())
            return make_boxed_func(gm.forward)

        return compiler

    def backend(self) -> Any:
        """The backend to hand to torch.compile."""
        return aot_autograd(fw_compiler=self._note(self.forward), bw_compiler=self._note(self.backward))


def _library_reason(reason: str) -> bool:
    # The wrappers' deliberate break: the library's reason, or on torch 2.4 (whose
    # torch.compiler.disable takes no reason) the disabled wrapper named.
    return "fp32scope: a scoped call" in reason or bool(re.search(r"disable\(\) wrapped function <function", reason))


def check_dynamo_never_failed_in_the_package() -> None:
    """Assert that Dynamo failed no frame and broke no graph inside the package but deliberately."""
    frames = counters["frames"]
    assert frames["total"] == frames["ok"], dict(frames)
    package = str(Path(_trampoline.__file__).resolve().parents[1])  # fp32scope/, the whole package
    for reason in counters["graph_break"]:
        assert _library_reason(reason) or package not in reason, reason


def run(
    compiled: Callable[[torch.Tensor], torch.Tensor],
    eager: Callable[[torch.Tensor], torch.Tensor],
    *,
    grad: bool,
    calls: int = 3,
) -> None:
    """Call ``compiled`` ``calls`` times (backward too in grad mode), never recompiling after the first."""
    x = torch.randn(2, 3, WIDTH)

    def call() -> None:
        out = compiled(x)
        torch.testing.assert_close(out, expected)
        if grad:
            torch.autograd.backward(out.sum())

    with torch.set_grad_enabled(grad):
        expected = eager(x)
        call()  # compiles
        with forbid_recompiles():
            for _ in range(calls - 1):
                call()
    assert torch.get_float32_matmul_precision() == DEFAULT.matmul


def dynamo_inlines_modules() -> bool:
    """Whether Dynamo takes modules' parameters as graph inputs (``inline_inbuilt_nn_modules``; not on torch 2.4)."""
    with warnings.catch_warnings():  # (deprecated from torch 2.13: always on)
        warnings.simplefilter("ignore", FutureWarning)
        return bool(getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", False))


def node_graphs(backend: object) -> int:
    """The Dynamo graphs a region's node adds of its own: 1 where its op compiles it with the parent's backend.

    That is every backend but Inductor (which compiles the node inside, no Dynamo graph of its
    own) and cudagraphs, where :func:`nodes_compile_in_op`; 0 elsewhere (the node eager in its op).
    """
    return 0 if backend in {"inductor", "cudagraphs"} or not nodes_compile_in_op() else 1


def nodes_compile_in_op() -> bool:
    """Whether a region's op compiles its node with a parent's backend other than Inductor on this torch.

    Not before torch 2.9 (its Dynamo resets "medium" while it compiles), nor where Dynamo
    guards parameters by identity (:func:`dynamo_inlines_modules`).
    """
    return dynamo_inlines_modules() and not DYNAMO_RESETS_MEDIUM


def parent_graphs() -> int:
    """Dynamo's graphs since its reset, less those of regions' nodes compiled in their ops.

    A node compiled by its parent's backend in its op (every backend but Inductor) is a
    frame of its own, a trampoline per node, whose graphs Dynamo counts among its
    ``unique_graphs``: these are its cache entries, for every live region.
    """
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from fp32scope._wrappers.region import regions

    own = 0
    for region in list(regions._regions.values()):
        for call in region._compiled_calls.values():
            trampoline = cast("Any", cast("functools.partial[Any]", call).func)._torchdynamo_orig_callable
            own += len(_debug_get_cache_entry_list(trampoline.__code__))
    return int(counters["stats"]["unique_graphs"]) - own


def step(model: Any, x: torch.Tensor, *, train: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``model(x)``: under ``no_grad``, or a training step (its parameters' gradients, set afresh, come back too)."""
    if not train:
        with torch.no_grad():
            return model(x), []
    for p in model.parameters():
        p.grad = None
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]
