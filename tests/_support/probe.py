"""A probe that records torch's float32 precision flags where it runs: forward and backward.

``probe(x, tag)`` is the identity, as a ``torch.library.custom_op`` whose backward is
another custom op. Custom ops are opaque to Dynamo and Inductor, so both read the flags at
run time, also inside compiled graphs and in lazily compiled backward graphs. Each run
appends ``(phase, tag, Fp32Precision)`` to ``SEEN``; a tag in ``FAIL_IN_BACKWARD`` makes
its backward raise ``ProbeError`` (standing in for an out-of-memory error).
"""

# No ``from __future__ import annotations``: torch 2.4's custom_op reads the annotations as
# objects, not strings.
import torch

from fp32scope import Fp32Precision, current_fp32_precision

__all__ = ["FAIL_IN_BACKWARD", "SEEN", "ProbeError", "backward", "phases", "probe"]

SEEN: list[tuple[str, str, Fp32Precision]] = []
FAIL_IN_BACKWARD: set[str] = set()


class ProbeError(RuntimeError):
    """Raised by a probe's backward when its tag is in FAIL_IN_BACKWARD."""


@torch.library.custom_op("fp32scope_tests::probe", mutates_args=())
def _probe(x: torch.Tensor, tag: str) -> torch.Tensor:
    SEEN.append(("fwd", tag, current_fp32_precision()))
    return x.clone()


@_probe.register_fake
def _(x: torch.Tensor, tag: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fp32scope_tests::probe_backward", mutates_args=())
def probe_backward(grad: torch.Tensor, tag: str) -> torch.Tensor:
    """The identity on a gradient; records the flags and raises for a tag in FAIL_IN_BACKWARD."""
    SEEN.append(("bwd", tag, current_fp32_precision()))
    if tag in FAIL_IN_BACKWARD:
        msg = f"probe {tag!r} failed in backward (as an out-of-memory error would)"
        raise ProbeError(msg)
    return grad.clone()


@probe_backward.register_fake
def _(grad: torch.Tensor, tag: str) -> torch.Tensor:
    return torch.empty_like(grad)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...], output: object) -> None:
    ctx.tag = inputs[1]  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    out: torch.Tensor = probe_backward(grad, ctx.tag)  # type: ignore[attr-defined]
    return out, None


_probe.register_autograd(_backward, setup_context=_setup_context)
# The backward is itself differentiable (the identity again), so a double backward is probed too.
probe_backward.register_autograd(_backward, setup_context=_setup_context)


def probe(x: torch.Tensor, tag: str) -> torch.Tensor:
    """The identity; records the flags in forward (and, through its autograd formula, backward)."""
    out: torch.Tensor = _probe(x, tag)
    return out


def phases(phase: str) -> dict[str, list[Fp32Precision]]:
    """What each tag saw in ``phase`` ("fwd" or "bwd"), in order."""
    out: dict[str, list[Fp32Precision]] = {}
    for p, tag, precision in SEEN:
        if p == phase:
            out.setdefault(tag, []).append(precision)
    return out


def backward(tensor: torch.Tensor, gradient: torch.Tensor | None = None, *, retain_graph: bool | None = None) -> None:
    """``tensor.backward(gradient, retain_graph=...)``, typed (Tensor.backward is not, for mypy)."""
    torch.autograd.backward(tensor, gradient, retain_graph=retain_graph)
