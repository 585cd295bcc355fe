"""The search: :func:`~fp32scope.advise` measures each node, then grows and prunes a policy."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp32scope._flags.precision import Fp32Precision
from fp32scope._tools.advise.arguments import (
    _aliases,
    _check_autocast_dtype,
    _check_callable,
    _check_fast,
    _check_inputs,
    _check_model,
    _check_progress,
    _check_tolerance,
    _select,
)
from fp32scope._tools.advise.measure import _Census, _device_type, _left_as_found, _OwnWork, _Progress, _Runner
from fp32scope._tools.advise.report import FULL_FLOAT32, Fp32Advice, Fp32AdviceNode
from fp32scope._wrappers.policy import _bare, _walk, scope_modules, unscope_modules

__all__ = ["advise"]

# -- the search -----------------------------------------------------------------------------


class _Search:
    def __init__(self, runner: _Runner, names: dict[int, list[str]], tolerance: float) -> None:
        self.runner = runner
        self.names = names
        self.tolerance = tolerance
        self.cache: dict[frozenset[int], float] = {}

    def policy(self, kept: Sequence[int]) -> dict[str, dict[str, Any]]:
        """The policy keeping ``kept`` (every name of a shared module), in module order."""
        chosen = set(kept)
        return {name: dict(FULL_FLOAT32) for key in self.names if key in chosen for name in self.names[key]}

    def error(self, kept: Sequence[int], what: str) -> float:
        key = frozenset(kept)
        if key not in self.cache:
            if not kept:
                self.cache[key] = self.runner.error(what)
            else:
                root = self.runner.root
                scope_modules(root, self.policy(kept), autocast=False if self.runner.dtype is not None else None)
                try:
                    self.cache[key] = self.runner.error(what)
                finally:
                    _unscope(root)
        return self.cache[key]


def _unscope(root: torch.nn.Module) -> None:
    unscope_modules(root)  # the model had no scoped node before (checked): every wrapper is ours


def advise(  # noqa: C901, PLR0912, PLR0913, PLR0915  (one public entry point: check, measure, search)
    model: torch.nn.Module,
    inputs: Any,
    *,
    fast: Fp32Precision | str | None = None,
    autocast: torch.dtype | None = None,
    tolerance: float = 1e-3,
    loss: Callable[[Any], torch.Tensor] | None = None,
    candidates: Sequence[Any] | None = None,
    metric: Callable[[Any, Any], float] | None = None,
    progress: bool | None = None,
) -> Fp32Advice:
    """Find the submodules that must run in full float32 for ``model`` to stay within ``tolerance``.

    ``model`` runs on ``inputs``: one batch or a list of batches, a batch being a tuple of
    positional arguments, a dict of keyword arguments or a single tensor. The *reference* is
    the model in full float32 (matmul ``"highest"``, cuDNN TF32 off, no autocast); the *fast*
    setting is how it runs without a policy: at ``fast`` (an :class:`~fp32scope.Fp32Precision`
    or a matmul precision; default the process's precision at the call, and a field left None
    is the process's) and, when ``autocast`` is a dtype (``torch.bfloat16``,
    ``torch.float16``), under ``torch.autocast(<the inputs' device type>, autocast)``.

    The *error* of a run is the relative L2 error ``||y - y_ref|| / ||y_ref||`` in float64
    over every floating-point tensor of the output taken together (tensors, tuples, lists,
    dicts, Hugging Face ``ModelOutput``), the largest over the batches; ``metric(output,
    reference)`` replaces it. With ``loss`` (``loss(output)`` a scalar), every run also does
    the backward, and the error is the larger of that and the same relative error over all
    parameter gradients together. One batch is a sample: advise over several batches, and
    check the policy on held-out ones.

    ``candidates`` are the nodes a policy may keep: by default every submodule doing
    floating-point work of its own (it holds parameters of its own, or its forward, less its
    submodules, runs a matmul-like op: matmul, linear, convolution, attention, einsum), found
    in one reference run; or the modules the given selectors (as
    :func:`~fp32scope.scope_modules` takes them) select. The root cannot be a node.

    A node's *sensitivity* is the error when its own work (its forward, less its candidate
    submodules, which keep theirs) runs fast and every other candidate's own work runs in full
    float32. A kept node is scoped by :func:`~fp32scope.scope_modules`, so its whole forward,
    submodules included, runs in full float32. The search adds candidates in order of
    sensitivity (largest first; on a tie the one with fewer FLOPs, then module order), skipping
    any inside a node kept already, until the policy, applied with scope_modules, meets the
    tolerance; if every candidate kept does not, the root's direct submodules are added as a
    last resort. It then drops nodes (the last added first) while the tolerance stays met,
    until dropping any one of them breaks it (measured): the policy is 1-minimal, and empty
    when every node fast meets the tolerance. When even every node in full float32 does not
    meet it, the result keeps them all, ``met`` is False and ``reason`` says why (the error
    comes from work outside every candidate, or the model is not deterministic). Each run
    reseeds torch's generator (the caller's state is kept), so dropout draws the same masks.

    The model comes back as it was: the same module objects (no wrapper left), parameters,
    buffers, ``.grad`` and training flags unchanged, and so are the process's precision flags,
    autocast state and random generators, also when the model raises (its error propagates).
    Every argument is checked before the model runs. ``progress`` (None: when stderr is a
    terminal) shows a one-line count of runs on stderr.
    """
    started = time.perf_counter()
    root = _check_model(model)
    batches = _check_inputs(inputs)
    fast_precision = _check_fast(fast)
    dtype = _check_autocast_dtype(autocast)
    tol = _check_tolerance(tolerance)
    loss_fn = _check_callable(loss, "loss", "(output) -> scalar tensor")
    metric_fn = _check_callable(metric, "metric", "(output, reference) -> float")
    show = _check_progress(progress)
    names, modules, _ = _aliases(root)
    chosen = None if candidates is None else _select(root, candidates)
    bar = _Progress(show, sys.stderr)
    device_type = _device_type(batches, root)
    runner = _Runner(root, batches, fast_precision, dtype, loss_fn, metric_fn, bar, device_type)
    order = list(modules)  # module order
    try:
        with _left_as_found(root, loss_fn is not None):
            census = _Census(modules)
            runner.measure_reference(census)
            own_flops = census.flops
            if chosen is None:
                chosen = [
                    key
                    for key in order
                    if census.ops.get(key, 0) > 0
                    or any(p.is_floating_point() for p in modules[key].parameters(recurse=False))
                ]
            search = _Search(runner, names, tol)
            fast_error = search.error([], "every node fast")
            sensitivity: dict[int, float] = {}
            if fast_error > tol:
                own = _OwnWork(runner, {k: modules[k] for k in chosen})
                try:
                    for i, key in enumerate(chosen):
                        own.fast_one = key
                        sensitivity[key] = runner.error(f"sensitivity {i + 1}/{len(chosen)}: {names[key][0]}")
                        own.unwind()
                finally:
                    own.remove()
            else:  # nothing to search: not measured
                sensitivity = dict.fromkeys(chosen, math.nan)
            inside = _descendants(modules)
            total_flops = sum(own_flops.values())
            subtree_flops = {k: own_flops.get(k, 0) + sum(own_flops.get(d, 0) for d in inside[k]) for k in modules}
            kept: list[int] = []
            error = fast_error
            reason = None
            if fast_error > tol:
                ranked = sorted(chosen, key=lambda k: (-sensitivity[k], subtree_flops[k], order.index(k)))
                for key in ranked:
                    if any(key in inside[k] for k in kept):
                        continue
                    kept.append(key)
                    error = search.error(kept, f"policy of {len(kept)} node(s)")
                    if error <= tol:
                        break
                if error > tol:  # last resort: the model's body, one direct submodule at a time
                    for slot in _walk(root):
                        key = id(_bare(slot.stored))
                        if "." in slot.name or key in kept or key not in modules:
                            continue
                        kept = [k for k in kept if k not in inside[key]] + [key]
                        error = search.error(kept, f"body, {len(kept)} node(s)")
                        if error <= tol:
                            break
                if error <= tol:
                    changed = True
                    while changed:  # a pass that drops nothing has verified 1-minimality
                        changed = False
                        for key in reversed(list(kept)):
                            rest = [k for k in kept if k != key]
                            if search.error(rest, f"pruning, {len(kept)} node(s)") <= tol:
                                kept = rest
                                changed = True
                    error = search.error(kept, "the advised policy")
                else:
                    again = runner.error("reference again", fast=False)
                    if again > tol / 10:
                        reason = (
                            f"the model is not deterministic: two full float32 runs differ by {again:.3g}, "
                            "more than a tenth of the tolerance"
                        )
                    else:
                        reason = (
                            f"with every node in full float32 the error is still {error:.3g}: it comes from work "
                            "outside every candidate (the root's own forward, or autocast outside the nodes), "
                            "or from a metric the fast setting cannot meet"
                        )
            covered = set(kept) | {d for k in kept for d in inside[k]}
            kept_flops = sum(own_flops.get(k, 0) for k in covered)
            unique_params = {id(p): p.numel() for p in root.parameters()}
            kept_params = {id(p): p.numel() for k in covered for p in modules[k].parameters(recurse=False)}
            nodes = tuple(
                Fp32AdviceNode(
                    names[key][0],
                    type(modules[key]).__name__,
                    sum({id(p): p.numel() for p in modules[key].parameters()}.values()),
                    subtree_flops[key] / total_flops if total_flops else 0.0,
                    sensitivity.get(key, math.nan),
                    key in kept,
                )
                for key in chosen
            )
            runs = runner.runs
    finally:
        bar.close()
    return Fp32Advice(
        policy=search.policy(kept),
        autocast=False if dtype is not None else None,
        error=error,
        fast_error=fast_error,
        tolerance=tol,
        met=error <= tol,
        runs=runs,
        seconds=time.perf_counter() - started,
        fast=fast_precision,
        autocast_dtype=dtype,
        nodes=nodes,
        reason=reason,
        kept_flop_share=kept_flops / total_flops if total_flops else 0.0,
        kept_parameter_share=sum(kept_params.values()) / sum(unique_params.values()) if unique_params else 0.0,
    )


def _descendants(modules: dict[int, torch.nn.Module]) -> dict[int, set[int]]:
    """For each module, the ids of the modules below it (each module once)."""
    out: dict[int, set[int]] = {}
    for key, module in modules.items():
        below = {id(_bare(m)) for m in module.modules()} - {key}
        out[key] = below & set(modules)
    return out
