"""A scoped node under ``torch.autocast``: keep the caller's autocast, warn, or run the node without it.

``torch.autocast`` picks the dtype of each op itself (bf16 or fp16 for matmuls and
convolutions), whatever the float32 precision flags say: a node scoped to full float32
would run its matmuls in bf16 under a caller's autocast. A wrapper's ``autocast``
argument says what happens then:

* ``False``: the node runs with autocast off on every device type where the caller has it
  on, its floating-point tensor arguments of those device types (float64 aside, also
  inside lists, tuples and dicts) cast to float32 first, as
  ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` does; the caller's autocast is back
  after the call, also when it raises;
* ``True``: the caller's autocast stays on;
* ``None``: the caller's autocast stays on, and a node that asks for full float32 warns
  (:class:`~fp32scope.Fp32AutocastWarning`) once.

Outside autocast a wrapper adds one C call (``torch._C._is_any_autocast_enabled``) and
nothing else, and only while its policy has something to do under autocast
(``autocast=False``, or a node asking for full float32 that has not warned yet); any other
wrapper does not ask. The cast happens before the wrapper's scope and its autograd boundary: the
casts' backward (back to the caller's dtype) belongs to the caller's graph, as the casts a
hand-written ``.float()`` makes do.

The module also holds the check for ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE``, which makes
cuBLAS use TF32 whatever a node's precision says.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from fp32scope._errors import Fp32AutocastWarning, user_stacklevel
from fp32scope._flags import dynamo_exclude
from fp32scope._flags.precision import Fp32Precision
from fp32scope._flags.scope import _is_exporting

__all__ = [
    "AutocastPolicy",
    "any_autocast",
    "asks_full_float32",
    "cast_to_float32",
    "check_autocast",
    "cublas_override_message",
    "run_under_autocast",
    "warn_cublas_override",
    "warn_once_under_autocast",
]

#: One C call: whether autocast is on for any device type on this thread.
any_autocast: Callable[[], bool] = torch._C._is_any_autocast_enabled

# Every supported torch (>= 2.4) takes a device type in these; the device
# types are those torch's autocast knows (_is_autocast_available raises for the others).
_is_enabled: Callable[[str], bool] = torch.is_autocast_enabled
_set_enabled: Callable[[str, bool], None] = torch.set_autocast_enabled
_get_dtype: Callable[[str], torch.dtype] = torch.get_autocast_dtype


def _device_types() -> tuple[str, ...]:
    # The common ones first: a call stops looking once no autocast is left on.
    candidates = ["cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu"]
    candidates.append(torch._C._get_privateuse1_backend_name())
    is_available = getattr(torch._C, "_is_autocast_available", None)
    found = []
    for name in dict.fromkeys(candidates):
        try:
            _is_enabled(name)  # raises for a device type autocast does not know
            available = is_available(name) if is_available is not None else True
        except RuntimeError:
            continue
        if available:
            found.append(name)
    return tuple(found)


_DEVICE_TYPES: Final = _device_types()

_KEEP: Final = 0
_WARN: Final = 1
_OFF: Final = 2


def check_autocast(value: object, *, field: str = "autocast", node: str | None = None) -> bool | None:
    """Return ``value`` if it is True, False or None, else raise :class:`TypeError` naming ``field``."""
    if value is None or type(value) is bool:
        return value
    where = f" of node {node!r}" if node is not None else ""
    msg = (
        f"{field}{where} must be False (run the node without the caller's torch.autocast, its floating-point "
        "arguments cast to float32), True (keep the caller's autocast) or None (keep it, and warn if the node "
        f"asks for full float32); got {value!r} of type {type(value).__name__}."
    )
    raise TypeError(msg)


def asks_full_float32(precision: Fp32Precision | None) -> bool:
    """Whether ``precision`` asks for full float32: matmul "highest" or cuDNN TF32 off."""
    return precision is not None and (precision.matmul == "highest" or precision.cudnn_allow_tf32 is False)


class AutocastPolicy:
    """What one wrapper does when it is called under autocast (see the module docstring)."""

    __slots__ = ("action", "mode", "name", "precision")

    def __init__(self, mode: bool | None, precision: Fp32Precision | None, name: str) -> None:
        self.mode = mode
        self.precision = precision
        self.name = name
        #: None: nothing to do under autocast (the wrapper's only check); else _WARN or _OFF.
        self.action: int | None
        if mode is False:
            self.action = _OFF
        elif mode is None and asks_full_float32(precision):
            self.action = _WARN
        else:
            self.action = None


def _cast(value: Any, device_types: tuple[str, ...]) -> Any:  # noqa: PLR0911  (one return per kind)
    # torch.amp.custom_fwd's rule: floating tensors of an autocast device type, float64
    # aside; containers rebuilt with their own type (a namedtuple through _make).
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype is not torch.float64 and value.device.type in device_types:
            return value.to(torch.float32)
        return value
    if isinstance(value, list):
        return type(value)(_cast(v, device_types) for v in value)
    if isinstance(value, tuple):
        items = [_cast(v, device_types) for v in value]
        make = getattr(type(value), "_make", None)
        return make(items) if make is not None else type(value)(items)
    if isinstance(value, Mapping):
        cast = {k: _cast(v, device_types) for k, v in value.items()}
        kind: Any = type(value)
        try:
            return kind(cast)
        except TypeError:  # a mapping type that cannot be built from a dict
            return cast
    return value


def cast_to_float32(value: Any, device_types: tuple[str, ...]) -> Any:
    """``value`` with its floating-point tensors of ``device_types`` cast to float32 (float64 aside)."""
    return _cast(value, device_types)


def warn_once_under_autocast(policy: AutocastPolicy) -> None:
    """Warn now if ``policy`` still has to (a full-float32 node with ``autocast=None``), once."""
    if policy.action == _WARN:
        policy.action = None
        _warn(policy)


def _warn(policy: AutocastPolicy) -> None:
    on = [f"{d} ({_get_dtype(d)})" for d in _DEVICE_TYPES if _is_enabled(d)]
    msg = (
        f"Scoped node {policy.name!r} asks for full float32 ({policy.precision}) but runs under "
        f"torch.autocast on {', '.join(on) or 'a device type'}: autocast casts its matmuls and convolutions "
        "to that dtype whatever the float32 precision says. Wrap it with autocast=False to run it in float32 "
        "(autocast off inside the node, its floating-point arguments cast to float32), or autocast=True to "
        "keep the caller's autocast and silence this warning."
    )
    warnings.warn(msg, Fp32AutocastWarning, stacklevel=user_stacklevel())


def run_under_autocast(
    policy: AutocastPolicy, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Call the wrapper ``call`` again, as ``policy`` says, while some autocast is on.

    ``_WARN`` warns and then keeps the autocast (the policy then has nothing left to do);
    ``_OFF`` turns autocast off on each device type where it is on, casts the arguments,
    and calls ``call``, which then meets no autocast and runs as outside it.
    """
    if policy.action == _WARN:
        policy.action = None
        _warn(policy)
        return call(*args, **kwargs)
    if _is_exporting():
        return _exported(call, args, kwargs)
    disabled: list[str] = []
    try:
        for device_type in _DEVICE_TYPES:
            if _is_enabled(device_type):
                _set_enabled(device_type, False)
                disabled.append(device_type)
                if not any_autocast():
                    break
        if any_autocast():  # pragma: no cover  (a device type this torch's autocast added later)
            msg = (
                f"Scoped node {policy.name!r} (autocast=False) could not turn off torch.autocast: it is on for a "
                f"device type other than {', '.join(_DEVICE_TYPES)}."
            )
            raise RuntimeError(msg)
        types = tuple(disabled)
        cast_args = tuple(_cast(a, types) for a in args)
        cast_kwargs = {k: _cast(v, types) for k, v in kwargs.items()} if kwargs else kwargs
        return call(*cast_args, **cast_kwargs)
    finally:
        for device_type in disabled:
            _set_enabled(device_type, True)


def _exported(call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # torch.export records a torch.autocast region as a wrap_with_autocast node of the
    # program (writing the flags directly would only change what is traced): so the
    # exported program runs the node with autocast off wherever it is called, as a
    # hand-written ``with torch.autocast(device_type, enabled=False)`` does.
    types = tuple(d for d in _DEVICE_TYPES if _is_enabled(d))
    with contextlib.ExitStack() as stack:
        for device_type in types:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        cast_args = tuple(_cast(a, types) for a in args)
        cast_kwargs = {k: _cast(v, types) for k, v in kwargs.items()} if kwargs else kwargs
        return call(*cast_args, **cast_kwargs)


# -- TORCH_ALLOW_TF32_CUBLAS_OVERRIDE ----------------------------------------------------

#: The environment variables of torch and of NVIDIA's libraries that override the TF32 flags.
CUBLAS_OVERRIDE: Final = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"
NVIDIA_OVERRIDE: Final = "NVIDIA_TF32_OVERRIDE"


def cublas_override_message(
    precision: Fp32Precision | None, environ: Mapping[str, str], cuda_available: bool, name: str
) -> str | None:
    """The warning for a node asking for a full float32 matmul where torch allows TF32 anyway, or None."""
    if precision is None or precision.matmul != "highest" or not cuda_available:
        return None
    if environ.get(CUBLAS_OVERRIDE) != "1":  # torch reads "1" as on, "0" as off
        return None
    return (
        f"Scoped node {name!r} asks for full float32 matmuls ({precision}), but {CUBLAS_OVERRIDE}=1 is set in "
        "this process's environment: torch then lets cuBLAS use TF32 for every float32 matmul on CUDA, whatever "
        "the matmul precision says, so this node's matmuls run TF32. Unset the variable to get full float32."
    )


_warned_override: list[bool] = []
_cuda_available = torch.cuda.is_available


def warn_cublas_override(precision: Fp32Precision | None, name: str) -> None:
    """Warn, once per process, when a node asks for full float32 under the cuBLAS TF32 override."""
    if _warned_override or precision is None or precision.matmul != "highest":
        return
    if CUBLAS_OVERRIDE not in os.environ:
        return
    msg = cublas_override_message(precision, os.environ, _cuda_available(), name)
    if msg is not None:
        _warned_override.append(True)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


# Frames only: these run in a wrapper's eager call, where a compiling caller's Dynamo
# callback is active; the call they make is the wrapper's, compiled as before.
dynamo_exclude.exclude(
    run_under_autocast, _cast, _warn, _exported, cast_to_float32, warn_once_under_autocast, graph_break=False
)
