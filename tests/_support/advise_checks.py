"""The advise tests' own measurements: a policy's error through scope_modules, and a snapshot of all advise must keep.

Independent of advise's code: the error is measured here with scope_modules and plain torch.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Any

import torch

import fp32scope
from fp32scope import Fp32Precision, fp32_precision_scope, scope_modules, unscope_modules
from fp32scope._flags import torch_flags as _flags
from tests._support.common import FULL


def as_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, dict):
        return (), batch
    return tuple(batch), {}


def floats(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [v for v in output.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]  # ModelOutput


def run(
    model: torch.nn.Module,
    batch: Any,
    precision: Fp32Precision,
    dtype: torch.dtype | None,
    call: Any = None,
) -> list[torch.Tensor]:
    args, kwargs = as_batch(batch)
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(fp32_precision_scope(precision))
        if dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=dtype))
        output = model(*args, **kwargs) if call is None else call(model, *args, **kwargs)
        return [t.double() for t in floats(output)]


def measured(  # noqa: PLR0913  (the setting, as advise takes it)
    model: torch.nn.Module,
    batches: list[Any],
    policy: dict[str, Any],
    *,
    fast: Fp32Precision,
    dtype: torch.dtype | None,
    call: Any = None,
) -> float:
    """The largest relative L2 error over the batches, with ``policy`` applied through scope_modules."""
    return max(each(model, batches, policy, fast=fast, dtype=dtype, call=call))


def each(  # noqa: PLR0913  (the setting, as advise takes it)
    model: torch.nn.Module,
    batches: list[Any],
    policy: dict[str, Any],
    *,
    fast: Fp32Precision,
    dtype: torch.dtype | None,
    call: Any = None,
) -> list[float]:
    """The relative L2 error of each batch, with ``policy`` applied through scope_modules."""
    errors = []
    for batch in batches:
        reference = run(model, batch, FULL, None, call)
        if policy:
            scope_modules(model, policy, autocast=False if dtype is not None else None)
        try:
            output = run(model, batch, fast, dtype, call)
        finally:
            unscope_modules(model)
        diff = math.sqrt(sum(float((o - r).norm()) ** 2 for o, r in zip(output, reference, strict=True)))
        norm = math.sqrt(sum(float(r.norm()) ** 2 for r in reference))
        errors.append(diff / norm)
    return errors


def assert_meets_and_is_minimal(  # noqa: PLR0913  (the setting, as advise takes it)
    model: torch.nn.Module,
    batches: list[Any],
    advice: fp32scope.Fp32Advice,
    *,
    fast: Fp32Precision,
    dtype: torch.dtype | None,
    call: Any = None,
) -> None:
    tolerance = advice.tolerance / advice.margin  # what the search meets on the calibration batches
    assert measured(model, batches, advice.policy, fast=fast, dtype=dtype, call=call) <= tolerance
    for name in advice.policy:
        rest = {k: v for k, v in advice.policy.items() if k != name}
        assert measured(model, batches, rest, fast=fast, dtype=dtype, call=call) > tolerance, f"{name} can be dropped"


class Snapshot:
    """Everything advise must leave as it found it: module objects, tensors, grads, modes, flags, RNG."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.modules = [(name, id(m), type(m)) for name, m in model.named_modules()]
        self.children = [(id(m), dict(m._modules)) for m in model.modules()]
        self.tensors = {k: (v, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
        self.buffers = {k: (v, v.clone()) for k, v in model.named_buffers()}  # non-persistent ones too
        self.requires_grad = [p.requires_grad for p in model.parameters()]
        self.grads = [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
        self.training = [m.training for m in model.modules()]
        self.flags = _flags.save_raw_state()
        self.process = fp32scope.current_fp32_precision()
        self.autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        self.rng = torch.get_rng_state()

    def assert_unchanged(self) -> None:
        model = self.model
        assert [(name, id(m), type(m)) for name, m in model.named_modules()] == self.modules
        assert [(id(m), dict(m._modules)) for m in model.modules()] == self.children
        assert not any(isinstance(m, fp32scope.Fp32ScopedModule) for m in model.modules())
        assert fp32scope.scoped_modules(model) == {}
        now = model.state_dict(keep_vars=True)
        assert list(now) == list(self.tensors)
        for key, (tensor, saved) in self.tensors.items():
            assert now[key] is tensor, key
            assert torch.equal(tensor, saved), key
        buffers = dict(model.named_buffers())
        assert list(buffers) == list(self.buffers)
        for key, (tensor, saved) in self.buffers.items():
            assert buffers[key] is tensor, key
            assert torch.equal(tensor, saved), key
        assert [p.requires_grad for p in model.parameters()] == self.requires_grad
        for p, grad, saved in self.grads:
            assert p.grad is grad
            assert grad is None or (saved is not None and torch.equal(grad, saved))
        assert [m.training for m in model.modules()] == self.training
        assert _flags.save_raw_state() == self.flags
        assert fp32scope.current_fp32_precision() == self.process
        assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == self.autocast
        assert torch.equal(torch.get_rng_state(), self.rng)


def calls_of(model: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls
