""":func:`~fp32scope.advise` with ``compile=``: each candidate compiled alone, and the rules kept nodes get.

A node's sensitivity under ``compile=`` is the error of the model run eagerly (at the
reference's setting) with that node alone compiled (at the fast setting), its candidate
submodules kept eager inside it: what compiling that node's own work does to the output.
Each such run compiles one node, not the model; the search's policies are then measured
on the model compiled whole (see ``_Search`` in the search module).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from fp32scope._flags import torch_flags
from fp32scope._tools.advise.measure import _Runner, _to_float32
from fp32scope._tools.advise.report import FULL_FLOAT32
from fp32scope._wrappers.policy import scope_modules, unscope_modules

__all__ = ["EAGER", "FULL_FLOAT32_EAGER", "kept_rule", "sensitivities"]

#: The rule of a node kept with ``reference="eager"``: it runs as eager runs it.
EAGER = "eager"
#: The rule of a node kept with ``compile=`` and the full float32 reference: full float32,
#: run as eager runs it, an in-graph region of the compiled model (no graph break). Not a
#: region compiled inside: Inductor's own choices (fused float32 chains, other math
#: routines) would still part it from the full float32 reference it is measured against.
#: Also how a candidate's candidate submodules run while it is compiled alone.
FULL_FLOAT32_EAGER: dict[str, Any] = {"matmul": "highest", "cudnn_allow_tf32": False, "eager": True}


def kept_rule(runner: _Runner) -> str | dict[str, Any]:
    """The policy value of a kept node for ``runner``'s reference and compile."""
    if runner.reference_fast:
        return EAGER
    if runner.compile is not None:
        return dict(FULL_FLOAT32_EAGER)
    return dict(FULL_FLOAT32)


def _alone(compiled: Callable[..., Any], runner: _Runner) -> Callable[..., Any]:
    """A forward that calls a candidate's forward compiled, at the fast setting."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            if runner.reference_fast:  # the run is at the fast setting already
                return compiled(*args, **kwargs)
            with ExitStack() as stack:
                token = torch_flags.apply(runner.fast.matmul, runner.fast.cudnn_allow_tf32)
                stack.callback(torch_flags.restore, token)
                if runner.dtype is not None:
                    stack.enter_context(torch.autocast(runner.device_type, runner.dtype))
                output = compiled(*args, **kwargs)
            # Low-precision outputs go back into full float32 work, as they would from a fast node.
            return _to_float32(output) if runner.dtype is not None else output
        finally:
            runner.compile_seconds += time.perf_counter() - started

    return forward


def _put_back_forward(module: torch.nn.Module, found: object) -> None:
    if found is _NONE:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = found


_NONE = object()


def sensitivities(  # noqa: PLR0913, PLR0917  (the search's state, kept together)
    runner: _Runner,
    chosen: list[int],
    modules: dict[int, torch.nn.Module],
    names: dict[int, list[str]],
    inside: dict[int, set[int]],
    calibration: range,
) -> dict[int, float]:
    """Each candidate's error with it alone compiled, the rest of the model eager at the reference's setting."""
    root = runner.root
    out: dict[int, float] = {}
    for i, key in enumerate(chosen):
        below = [d for d in chosen if d in inside[key]]
        nearest = [d for d in below if not any(d in inside[e] for e in below)]
        inner: dict[str, Any] = {
            name: EAGER if runner.reference_fast else dict(FULL_FLOAT32_EAGER) for d in nearest for name in names[d]
        }
        autocast = False if runner.dtype is not None and not runner.reference_fast else None
        with ExitStack() as stack:
            if inner:
                scope_modules(root, inner, autocast=autocast)
                stack.callback(unscope_modules, root)  # the model had no scoped node before (checked): all ours
            # The module itself stays in the model (its parent may read its attributes); its
            # forward, an instance attribute for the run, is its own forward compiled.
            module = modules[key]
            found = module.__dict__.get("forward", _NONE)
            module.__dict__["forward"] = _alone(runner.compiled(module.forward, whole=False), runner)
            stack.callback(_put_back_forward, module, found)
            what = f"sensitivity {i + 1}/{len(chosen)} (compiled alone): {names[key][0]}"
            out[key] = max(runner.errors(what, calibration, fast=runner.reference_fast))
    return out
