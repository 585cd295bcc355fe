"""Capturing a scoped callable in a CUDA graph, the short and right way."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp32scope._flags.precision import Fp32Precision, check_precision
from fp32scope._flags.scope import fp32_precision_scope
from fp32scope._wrappers.proxy import precision_of

__all__ = ["CapturedCudaGraph", "capture_cuda_graph"]


class CapturedCudaGraph:
    """A CUDA graph captured by :func:`capture_cuda_graph`, replayed by calling it.

    Calling it copies the arguments into the static inputs, replays the graph and returns
    the static output (the same tensors each time: clone them to keep a result). The graph
    keeps the precision it was captured with, whatever the flags are at replay.
    """

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        static_inputs: tuple[torch.Tensor, ...],
        static_output: Any,
        precision: Fp32Precision | None,
    ) -> None:
        self.graph = graph
        self.static_inputs = static_inputs
        self.static_output = static_output
        self.precision = precision

    def __call__(self, *args: torch.Tensor) -> Any:
        """Copy ``args`` into the static inputs, replay, return the static output."""
        if len(args) != len(self.static_inputs):
            msg = f"expected {len(self.static_inputs)} input tensors, as captured; got {len(args)}."
            raise TypeError(msg)
        for static, arg in zip(self.static_inputs, args, strict=True):
            static.copy_(arg)
        self.graph.replay()
        return self.static_output

    def __repr__(self) -> str:
        return f"CapturedCudaGraph(precision={self.precision!r}, inputs={len(self.static_inputs)})"


def capture_cuda_graph(
    fn: Callable[..., Any],
    sample_inputs: Sequence[torch.Tensor],
    *,
    precision: Fp32Precision | None = None,
    warmup: int = 3,
    pool: Any = None,
) -> CapturedCudaGraph:
    """Warm up and capture ``fn(*sample_inputs)`` in a CUDA graph, inside its precision scope.

    TF32 is chosen when a kernel is captured, so warmup (on a side stream, as CUDA graphs
    need) and capture both run inside ``fp32_precision_scope(precision)``; ``precision``
    defaults to the one ``fn`` carries (an :class:`~fp32scope.Fp32ScopedModule` or a
    :func:`~fp32scope.with_fp32_precision` function). The replayed graph keeps that
    precision after the scope has exited. The sample inputs become the static inputs
    (they must be CUDA tensors). Returns a :class:`CapturedCudaGraph`: calling it copies new
    inputs into the static ones and replays the graph. Raises :class:`RuntimeError` without
    a CUDA device.
    """
    checked = check_precision(precision)
    if not callable(fn):
        msg = f"fn must be callable; got {fn!r} of type {type(fn).__name__}."
        raise TypeError(msg)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        msg = f"warmup must be an int >= 1 (cuBLAS and cuDNN must initialise outside capture); got {warmup!r}."
        raise ValueError(msg)
    if not torch.cuda.is_available():
        msg = (
            "capture_cuda_graph needs a CUDA device, and torch.cuda.is_available() is False here. "
            "On a CPU, call the scoped callable directly."
        )
        raise RuntimeError(msg)
    inputs = tuple(sample_inputs)
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
            msg = f"sample_inputs[{i}] must be a CUDA tensor; got {tensor!r}."
            raise TypeError(msg)
    if checked is None:
        checked = precision_of(fn)
    scope = fp32_precision_scope(checked)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), scope:
        for _ in range(warmup):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with scope, torch.cuda.graph(graph, pool=pool):
        output = fn(*inputs)
    return CapturedCudaGraph(graph, inputs, output, checked)


# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
CapturedCudaGraph.__module__ = "fp32scope"
