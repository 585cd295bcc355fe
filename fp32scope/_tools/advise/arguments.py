""":func:`~fp32scope.advise`'s arguments, each checked before the model runs."""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fp32scope._flags.precision import Fp32Precision, check_matmul
from fp32scope._flags.process import current_fp32_precision
from fp32scope._tools.advise.measure import Batch
from fp32scope._wrappers.policy import _bare, _Policy, _walk, scoped_modules


def _check_model(model: object) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        msg = f"model must be a torch.nn.Module; got {model!r} of type {type(model).__name__}."
        raise TypeError(msg)
    root = _bare(model)
    if root is not model:
        msg = (
            f"model is an Fp32ScopedModule around a {type(root).__name__}; advise measures a bare model "
            "(it refuses scoped ones rather than advising around their scopes): pass model.__wrapped__, or "
            "call fp32scope.unscope_modules on its parent first."
        )
        raise ValueError(msg)
    if scoped_modules(root):
        msg = (
            f"model has scoped nodes already ({', '.join(scoped_modules(root))}); advise measures a bare "
            "model (it refuses scoped ones rather than advising around their scopes): call "
            "fp32scope.unscope_modules(model) first."
        )
        raise ValueError(msg)
    on_meta = [name for name, t in [*root.named_parameters(), *root.named_buffers()] if t.is_meta]
    if on_meta:
        msg = (
            f"model has tensors on the meta device ({', '.join(on_meta[:3])}{', ...' if len(on_meta) > 3 else ''}): "
            "they hold no values to run; materialize the model first (model.to_empty(device=...) then "
            "load_state_dict, or build it on a real device)."
        )
        raise ValueError(msg)
    return root


def _one_batch(batch: object, where: str) -> Batch:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, tuple):
        return batch, {}
    if isinstance(batch, Mapping):
        if not all(isinstance(k, str) for k in batch):
            msg = f"{where} is a mapping, so its keys must be keyword names (str); got {list(batch)!r}."
            raise TypeError(msg)
        return (), dict(batch)
    msg = (
        f"{where} must be a batch (a tuple of positional arguments, a dict of keyword arguments or a "
        f"tensor) or a list of batches; got {batch!r} of type {type(batch).__name__}."
    )
    raise TypeError(msg)


def _check_inputs(inputs: object, name: str = "inputs") -> list[Batch]:
    if isinstance(inputs, list):
        if not inputs:
            msg = f"{name} is an empty list; give one batch or a list of at least one."
            raise ValueError(msg)
        batches = [_one_batch(b, f"{name}[{i}]") for i, b in enumerate(inputs)]
    else:
        batches = [_one_batch(inputs, name)]
    for i, (args, kwargs) in enumerate(batches):
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in [*args, *kwargs.values()]):
            msg = f"{name}[{i}] holds a tensor on the meta device, which holds no values to run; give real tensors."
            raise ValueError(msg)
    return batches


def _check_held_out(held_out: object) -> list[Batch]:
    if held_out is None:
        return []
    if isinstance(held_out, list) and not held_out:
        msg = "held_out is an empty list; give None (no held-out batches), one batch, or a list of batches."
        raise ValueError(msg)
    return _check_inputs(held_out, "held_out")


def _check_margin(margin: object) -> float:
    if type(margin) not in (int, float):
        msg = f"margin must be a number >= 1; got {margin!r} of type {type(margin).__name__}."
        raise TypeError(msg)
    value = float(margin)  # type: ignore[arg-type]  # int or float, checked above
    if not (value >= 1 and math.isfinite(value)):
        msg = (
            f"margin must be a finite number >= 1 (the search meets tolerance / margin; 1: no margin); got {margin!r}."
        )
        raise ValueError(msg)
    return value


def _check_not_the_reference(fast: Fp32Precision, dtype: torch.dtype | None, device_type: str) -> None:
    """Refuse a fast setting that is the reference itself: there would be nothing to measure."""
    if dtype is None and fast.matmul == "highest" and (fast.cudnn_allow_tf32 is False or device_type != "cuda"):
        msg = (
            f"the fast setting is the reference itself (fast={fast}, autocast=None: full float32"
            f"{'' if device_type == 'cuda' else f' on {device_type}, which has no cuDNN'}), so no node can "
            "need full float32: give the setting the model runs at, e.g. fast='high' or 'medium', or "
            "autocast=torch.bfloat16."
        )
        raise ValueError(msg)


def _check_fast(fast: object) -> Fp32Precision:
    process = current_fp32_precision()
    if fast is None:
        return process
    if isinstance(fast, str):
        return Fp32Precision(check_matmul(fast, field="fast"), process.cudnn_allow_tf32)
    if isinstance(fast, Fp32Precision):
        matmul = check_matmul(fast.matmul, field="fast.matmul")
        cudnn = fast.cudnn_allow_tf32
        if cudnn is not None and type(cudnn) is not bool:
            msg = f"fast.cudnn_allow_tf32 must be True, False or None; got {cudnn!r}."
            raise TypeError(msg)
        return Fp32Precision(
            matmul if matmul is not None else process.matmul,
            cudnn if cudnn is not None else process.cudnn_allow_tf32,
        )
    msg = (
        f"fast must be an fp32scope.Fp32Precision, a matmul precision ('highest', 'high', 'medium') or None "
        f"(the process default); got {fast!r} of type {type(fast).__name__}."
    )
    raise TypeError(msg)


def _check_autocast_dtype(autocast: object) -> torch.dtype | None:
    if autocast is None:
        return None
    if not isinstance(autocast, torch.dtype):
        msg = (
            f"autocast must be None (no torch.autocast) or a dtype (torch.bfloat16, torch.float16) the model "
            f"runs under torch.autocast with; got {autocast!r} of type {type(autocast).__name__}."
        )
        raise TypeError(msg)
    if autocast not in (torch.bfloat16, torch.float16):
        msg = f"autocast must be torch.bfloat16 or torch.float16 (or None); got {autocast}."
        raise ValueError(msg)
    return autocast


def _check_tolerance(tolerance: object) -> float:
    if type(tolerance) not in (int, float):
        msg = f"tolerance must be a positive number; got {tolerance!r} of type {type(tolerance).__name__}."
        raise TypeError(msg)
    value = float(tolerance)  # type: ignore[arg-type]  # int or float, checked above
    if not (value > 0 and math.isfinite(value)):
        msg = f"tolerance must be a positive finite number; got {tolerance!r}."
        raise ValueError(msg)
    return value


def _check_callable(value: object, name: str, shape: str) -> Callable[..., Any] | None:
    if value is None or callable(value):
        return value
    msg = f"{name} must be None or a callable {shape}; got {value!r} of type {type(value).__name__}."
    raise TypeError(msg)


def _check_compile(compile: object) -> dict[str, Any] | None:  # noqa: A002  (advise's argument)
    """torch.compile's keyword arguments for the fast runs (None: eager, ``compile=False``)."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if isinstance(compile, Mapping):
        # torch.compile's keyword arguments in this torch (through a functools.wraps wrapper, the wrapped one's).
        known = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
        for key in compile:
            if not isinstance(key, str):
                msg = f"compile is a mapping, so its keys must be torch.compile's keyword names (str); got {key!r}."
                raise TypeError(msg)
            if key not in known:
                msg = (
                    f"compile[{key!r}] is not an argument of torch.compile in torch {torch.__version__} "
                    f"(it takes {', '.join(known)})."
                )
                raise ValueError(msg)
        return dict(compile)
    msg = (
        "compile must be False (the fast runs eager), True (the model compiled whole, torch.compile's "
        'defaults) or a mapping of torch.compile keyword arguments (e.g. {"fullgraph": True, "backend": '
        f'"inductor"}}); got {compile!r} of type {type(compile).__name__}.'
    )
    raise TypeError(msg)


def _check_reference(reference: object, compile_options: dict[str, Any] | None) -> bool:
    """Whether the reference is the model run eagerly at the fast setting (else full float32)."""
    if reference not in ("float32", "eager") or not isinstance(reference, str):
        msg = (
            "reference must be 'float32' (the model in full float32, eagerly) or 'eager' (the model run "
            f"eagerly at the fast setting; needs compile=); got {reference!r}."
        )
        raise ValueError(msg) if isinstance(reference, str) else TypeError(msg)
    if reference == "eager" and compile_options is None:
        msg = (
            "reference='eager' compares the compiled model with the same model run eagerly at the fast "
            "setting; without compile= the fast run is that very run, so there would be nothing to "
            "measure: pass compile=True (or torch.compile's arguments), or reference='float32'."
        )
        raise ValueError(msg)
    return reference == "eager"


def _check_progress(progress: object) -> bool:
    if progress is None:
        isatty = getattr(sys.stderr, "isatty", None)
        return bool(isatty is not None and isatty())
    if type(progress) is bool:
        return progress
    msg = f"progress must be True, False or None (a bar when stderr is a terminal); got {progress!r}."
    raise TypeError(msg)


def _aliases(root: torch.nn.Module) -> tuple[dict[int, list[str]], dict[int, torch.nn.Module], list[str]]:
    """Every submodule's qualified names (a shared module has several), its module, and the order."""
    names: dict[int, list[str]] = {}
    modules: dict[int, torch.nn.Module] = {}
    order: list[str] = []
    for slot in _walk(root):
        module = _bare(slot.stored)
        names.setdefault(id(module), []).append(slot.name)
        modules[id(module)] = module
        order.append(slot.name)
    return names, modules, order


def _select(root: torch.nn.Module, candidates: object) -> list[int]:
    """The ids of the modules ``candidates`` selects (each selector must select one), in module order."""
    if isinstance(candidates, (str, type)) or callable(candidates) or not isinstance(candidates, Sequence):
        msg = (
            "candidates must be None (every submodule doing floating-point work of its own) or a list of "
            f"selectors as scope_modules takes them; got {candidates!r} of type {type(candidates).__name__}."
        )
        raise TypeError(msg)
    if not candidates:
        msg = (
            "candidates is an empty list: a policy would have no node to keep; give None (every submodule "
            "doing floating-point work of its own) or at least one selector."
        )
        raise ValueError(msg)
    slots = _walk(root)
    chosen: set[int] = set()
    for selector in candidates:
        policy = _Policy({selector: "highest"})  # checks the selector's type and pattern
        found = [id(_bare(s.stored)) for s in slots if policy.decide(s.name, _bare(s.stored), set()) is not None]
        if not found:
            examples = ", ".join(repr(s.name) for s in slots[:3]) or "none: the model has no submodules"
            msg = (
                f"candidates selector {selector!r} matches no submodule of {type(root).__name__}; names are "
                f"those of model.named_modules() (e.g. {examples})."
            )
            raise ValueError(msg)
        chosen.update(found)
    seen: list[int] = []
    for slot in slots:
        key = id(_bare(slot.stored))
        if key in chosen and key not in seen:
            seen.append(key)
    return seen
