"""A scoped node that asks for full float32 but runs with bf16 or fp16 parameters.

The float32 precision flags act on float32 tensors: a node whose parameters are
bfloat16 or float16 when it runs computes its matmuls in that dtype, whatever its scope
says. Under FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` that is every
node inside a bf16 unit: the unit hands its modules bf16 copies of their parameters
between its pre-forward and post-forward. ``autocast=False`` does not change that (it
casts a node's arguments, not its parameters); under autocast it then makes a float32
argument meet a bf16 weight, a dtype mismatch error.

A wrapper whose precision asks for full float32 checks once, at its first call, what its
node's parameters are then, and what FSDP2 policy each unit inside the node has (a unit
of its own is still sharded, in float32, when the wrapper is called: its policy says what
its forward will compute with), and warns (:class:`~fp32scope.Fp32ParameterDtypeWarning`)
with how to give the node float32 parameters.
"""

from __future__ import annotations

import warnings

import torch

from fp32scope._compat import fsdp2_param_dtype
from fp32scope._errors import Fp32ParameterDtypeWarning, user_stacklevel
from fp32scope._flags import dynamo_exclude
from fp32scope._flags.precision import Fp32Precision

__all__ = ["low_precision_parameters", "parameter_dtype_message", "warn_low_precision_parameters"]


def _is_low(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize < torch.float32.itemsize


def low_precision_parameters(module: torch.nn.Module) -> tuple[str, torch.dtype, bool] | None:
    """The first reduced-precision parameter source of ``module``, or None.

    Returns (what, dtype, by FSDP2): an FSDP2 unit inside ``module`` (``module`` itself
    included) whose policy's ``param_dtype`` is bf16 or fp16, else the first parameter
    whose dtype is.
    """
    for name, sub in module.named_modules():
        dtype = fsdp2_param_dtype(sub)
        if dtype is not None and _is_low(dtype):
            return (f"FSDP2 unit {name!r}" if name else "its FSDP2 unit", dtype, True)
    for name, parameter in module.named_parameters():
        if _is_low(parameter.dtype):
            return (f"parameter {name!r}", parameter.dtype, False)
    return None


def parameter_dtype_message(name: str, precision: Fp32Precision | None, found: tuple[str, torch.dtype, bool]) -> str:
    """The warning for node ``name``, whose ``found`` parameters are not float32."""
    what, dtype, by_fsdp2 = found
    if by_fsdp2:
        where = f"{what} computes with {dtype} parameters (its MixedPrecisionPolicy(param_dtype={dtype}))"
    else:
        where = f"its {what} is {dtype} when it runs (an FSDP2 unit around it with param_dtype={dtype}, or a cast)"
    return (
        f"Scoped node {name!r} asks for full float32 ({precision}) but {where}: the float32 precision flags act "
        f"on float32 tensors only, so its matmuls run in {dtype}; with autocast=False under torch.autocast its "
        f"float32 arguments meet {dtype} weights (a dtype mismatch error). Give the node float32 parameters: "
        "under FSDP2, a unit of its own with a float32 policy, fully_shard(node, "
        "mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32)), before its parent's fully_shard; otherwise "
        "keep its parameters float32 (node.float())."
    )


def warn_low_precision_parameters(module: torch.nn.Module, precision: Fp32Precision | None, name: str) -> None:
    """Warn when ``module``'s parameters are bf16 or fp16 (see the module docstring)."""
    found = low_precision_parameters(module)
    if found is not None:
        message = parameter_dtype_message(name, precision, found)
        warnings.warn(message, Fp32ParameterDtypeWarning, stacklevel=user_stacklevel())


# Frames only: these run in a wrapper's eager call, where a compiling caller's Dynamo
# callback is active.
dynamo_exclude.exclude(
    warn_low_precision_parameters, low_precision_parameters, parameter_dtype_message, _is_low, graph_break=False
)
dynamo_exclude.exclude(fsdp2_param_dtype, graph_break=False)
