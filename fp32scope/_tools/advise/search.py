"""The search: :func:`~fp32scope.advise` measures each node, then grows and prunes a policy."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fp32scope._flags.precision import Fp32Precision
from fp32scope._tools.advise.arguments import (
    _aliases,
    _check_autocast_dtype,
    _check_callable,
    _check_compile,
    _check_fast,
    _check_held_out,
    _check_inputs,
    _check_margin,
    _check_model,
    _check_not_the_reference,
    _check_progress,
    _check_reference,
    _check_tolerance,
    _select,
)
from fp32scope._tools.advise.compiled import kept_rule, sensitivities
from fp32scope._tools.advise.measure import (
    _Census,
    _device_type,
    _left_as_found,
    _OwnWork,
    _Progress,
    _Runner,
    _State,
)
from fp32scope._tools.advise.report import Fp32Advice, Fp32AdviceNode
from fp32scope._wrappers.policy import _bare, _walk, scope_modules, unscope_modules

__all__ = ["advise"]

#: A tolerance must be at least this many times the reference's own noise (two full float32 runs).
NOISE_FACTOR = 10


class _Search:
    """Each policy's error on each batch, measured once (through scope_modules) and cached."""

    def __init__(self, runner: _Runner, names: dict[int, list[str]], target: float, calibration: range) -> None:
        self.runner = runner
        self.names = names
        self.target = target
        self.calibration = calibration
        self.cache: dict[tuple[frozenset[int], int], float] = {}

    def policy(self, kept: Sequence[int]) -> dict[str, Any]:
        """The policy keeping ``kept`` (every name of a shared module), in module order."""
        chosen = set(kept)
        rule = kept_rule(self.runner)
        return {
            name: rule if isinstance(rule, str) else dict(rule)
            for key in self.names
            if key in chosen
            for name in self.names[key]
        }

    @property
    def autocast(self) -> bool | None:
        """scope_modules' ``autocast`` for a policy: False for full float32 nodes of a model under autocast."""
        runner = self.runner
        return False if runner.dtype is not None and not runner.reference_fast else None

    def errors(self, kept: Sequence[int], what: str, which: range | None = None) -> list[float]:
        """The error of each batch of ``which`` (default: the calibration batches) with ``kept`` kept."""
        key = frozenset(kept)
        which = self.calibration if which is None else which
        missing = [i for i in which if (key, i) not in self.cache]
        if missing:
            runner = self.runner
            if kept:
                scope_modules(runner.root, self.policy(kept), autocast=self.autocast)
            try:
                # With compile=, the policy's model compiled whole, afresh: a new policy, a new compile.
                model = runner.compiled(runner.root, whole=True) if runner.compile is not None else None
                for i, err in zip(missing, runner.errors(what, missing, model=model), strict=True):
                    self.cache[key, i] = err
            finally:
                if kept:
                    unscope_modules(runner.root)  # the model had no scoped node before (checked): all ours
        return [self.cache[key, i] for i in which]

    def error(self, kept: Sequence[int], what: str) -> float:
        """The largest error over the calibration batches."""
        return max(self.errors(kept, what))

    def meets(self, kept: Sequence[int], what: str) -> bool:
        return self.error(kept, what) <= self.target


def advise(  # noqa: PLR0913, PLR0915  (one public entry point: check, measure, search)
    model: torch.nn.Module,
    inputs: Any,
    *,
    fast: Fp32Precision | str | None = None,
    autocast: torch.dtype | None = None,
    tolerance: float = 1e-3,
    margin: float = 1.5,
    held_out: Any = None,
    loss: Callable[[Any], torch.Tensor] | None = None,
    run: Callable[..., Any] | None = None,
    candidates: Sequence[Any] | None = None,
    metric: Callable[[Any, Any], float] | None = None,
    progress: bool | None = None,
    compile: bool | Mapping[str, Any] = False,  # noqa: A002  (torch.compile's own name, as the issue asks)
    reference: str = "float32",
) -> Fp32Advice:
    """Find the submodules that must run in full float32 for ``model`` to stay within ``tolerance``.

    ``model`` runs on ``inputs`` (the *calibration* batches): one batch or a list of
    batches, a batch being a tuple of positional arguments, a dict of keyword arguments or
    a single tensor. ``held_out`` (the same forms; None: none) are batches the search never
    sees: the advised policy is measured on them too, and ``met`` covers them. The
    *reference* is the model in full float32 (matmul ``"highest"``, cuDNN TF32 off, no
    autocast); the *fast* setting is how it runs without a policy: at ``fast`` (an
    :class:`~fp32scope.Fp32Precision` or a matmul precision; default the process's
    precision at the call, and a field left None is the process's) and, when ``autocast``
    is a dtype (``torch.bfloat16``, ``torch.float16``), under ``torch.autocast(<the inputs'
    device type>, autocast)``. A fast setting equal to the reference is refused.

    ``run`` (``run(model, *args, **kwargs)``, the batch unpacked as the model would be
    called) replaces the model's call in every run, the reference's included: a sampling
    loop, ``generate`` or any pipeline that calls the model several times is measured as a
    whole, and the error is taken on what ``run`` returns. The model it is given is
    ``model`` itself, scoped in place.

    The *error* of a run is the relative L2 error ``||y - y_ref|| / ||y_ref||`` in float64
    over every floating-point tensor of the output taken together (tensors, tuples, lists,
    dicts, Hugging Face ``ModelOutput``); ``metric(output, reference)`` replaces it. With
    ``loss`` (``loss(output)`` a scalar), every run also does the backward, outside
    autocast as torch's mixed precision recipe does (the loss itself is computed under it),
    and the error is the larger of that and the same relative error over all parameter
    gradients together.

    The reference runs twice first; ``advice.noise`` is how far the two differ (the
    largest over the batches). A ``tolerance`` under ten times that noise is refused
    (ValueError): the search would chase the model's own nondeterminism.

    ``candidates`` are the nodes a policy may keep: by default every submodule doing
    floating-point work of its own (it holds parameters of its own, or its forward, less its
    submodules, runs a matmul-like op: matmul, linear, convolution, attention, einsum), found
    in one reference run; or the modules the given selectors (as
    :func:`~fp32scope.scope_modules` takes them) select. The root cannot be a node.

    A node's *sensitivity* is the error when its own work (its forward, less its candidate
    submodules, which keep theirs, and with a loss the backward of that work) runs fast and
    every other candidate's own work runs in full float32. A kept node is scoped by
    :func:`~fp32scope.scope_modules`, so its whole forward, submodules included, runs in
    full float32. The search ranks candidates by sensitivity (largest first; on a tie the
    one with fewer FLOPs, then module order), finds by bisection the shortest prefix of that
    ranking whose policy (applied with scope_modules, a node inside another kept one left
    out) meets ``tolerance / margin`` on the calibration batches, then drops nodes (the
    lowest ranked first) while that holds, until dropping any one of them breaks it
    (measured): the policy is 1-minimal on the calibration batches, and empty when every
    node fast meets ``tolerance / margin``. If every candidate kept does not, the root's
    direct submodules are added as a last resort. ``margin`` (>= 1; 1 is no margin) leaves
    headroom for data the search did not see. The policy is then measured on the held-out
    batches; ``met`` is True when every batch, calibration and held-out, is within
    ``tolerance``, and otherwise ``reason`` says which batch missed and by how much.
    Each run reseeds torch's generator (the caller's state is kept), so dropout draws the
    same masks.

    The model comes back as it was: the same module objects (no wrapper left), parameters,
    buffers (BatchNorm's running statistics and ``num_batches_tracked`` included: every
    buffer is written back after every run), ``.grad`` and training flags, and so are the
    process's precision flags, autocast state and random generators, also when the model
    raises (its error propagates). A parameter the model writes is put back from a copy
    advise keeps on the CPU; attributes the model sets on itself are not tracked. Every
    argument is checked before the model runs. ``progress`` (None: when stderr is a
    terminal) shows a one-line count of runs on stderr.

    ``compile`` (True: torch.compile's defaults, Inductor; or a mapping of torch.compile's
    keyword arguments, ``{"fullgraph": True, "mode": ..., "backend": ...}``) makes every fast
    run the model compiled whole with those arguments; a fast setting equal to full float32
    is then not refused (the compile is the difference). ``reference`` says what the errors
    are measured against: ``"float32"`` (the default; the model in full float32, eagerly) or
    ``"eager"`` (needs ``compile``: the same model run eagerly at the fast setting, precision
    and autocast as given, so that only the compile differs). With ``compile``:

    * candidates (by default) are also the submodules whose forward, less their submodules,
      does floating-point work of its own of any kind (pointwise, reductions, dtype casts;
      not only matmuls): a rotary embedding or a timestep sinusoid has no parameters and no
      matmul, and is what a compiler fuses;
    * a node's sensitivity is the error of the model run eagerly at the reference's setting
      with only that node compiled (alone, with those arguments less ``fullgraph``, at the
      fast setting), its candidate submodules kept eager inside it: one compile per
      candidate, of the node only;
    * every policy is measured on the model scoped with it and compiled whole, afresh
      (``torch.compiler.reset()`` first: nothing compiled under another policy is reused), a
      policy once over its batches; a kept node is ``"eager"`` (``reference="eager"``: it
      runs as eager runs it, one opaque region of the compiled graph) or a full float32
      in-graph region (``{"matmul": "highest", "cudnn_allow_tf32": False, "in_graph":
      True}``);
    * whole-model compiles: one with every node compiled, one per bisection step (at most
      ``ceil(log2(n + 1))`` for ``n`` candidates; every candidate kept is measured only when
      the bisection reaches it), one per pruning check (one per node of the grown policy,
      and a pass more for each pass that drops a node) and one for the held-out batches;
      ``advice.compiles``, ``advice.node_compiles`` and ``advice.compile_seconds`` (seconds
      in runs of compiled code, compiles included) report them.

    Dynamo is reset before each compile and once more when advise returns: code the caller
    compiled before is compiled again at its next call.
    """
    started = time.perf_counter()
    root = _check_model(model)
    calibration_batches = _check_inputs(inputs)
    held_out_batches = _check_held_out(held_out)
    fast_precision = _check_fast(fast)
    dtype = _check_autocast_dtype(autocast)
    tol = _check_tolerance(tolerance)
    margin_value = _check_margin(margin)
    loss_fn = _check_callable(loss, "loss", "(output) -> scalar tensor")
    call = _check_callable(run, "run", "run(model, *args, **kwargs) -> output")
    metric_fn = _check_callable(metric, "metric", "(output, reference) -> float")
    show = _check_progress(progress)
    compile_options = _check_compile(compile)
    eager_reference = _check_reference(reference, compile_options)
    batches = calibration_batches + held_out_batches
    device_type = _device_type(batches, root)
    if compile_options is None:  # with compile=, the compile is the difference
        _check_not_the_reference(fast_precision, dtype, device_type)
    names, modules, _ = _aliases(root)
    chosen = None if candidates is None else _select(root, candidates)
    bar = _Progress(show, sys.stderr)
    state = _State(root)
    runner = _Runner(root, batches, fast_precision, dtype, loss_fn, metric_fn, call, bar, device_type, state)
    runner.reference_fast = eager_reference
    runner.compile = compile_options
    calibration = range(len(calibration_batches))
    held = range(len(calibration_batches), len(batches))
    target = tol / margin_value
    order = list(modules)  # module order
    try:
        with _left_as_found(root, state, loss_fn is not None), _compiled_left_behind(compile_options):
            census = _Census(modules)
            runner.measure_reference(census)
            noise = max(runner.errors("reference again", range(len(batches)), fast=eager_reference))
            if tol < NOISE_FACTOR * noise:
                runs_of = "eager" if eager_reference else "full float32"
                msg = (
                    f"tolerance {tol:.3g} is under {NOISE_FACTOR} times the model's own noise: two {runs_of} "
                    f"runs of the same batches differ by {noise:.3g}. Make the runs repeatable (seed the "
                    "model's own generators, or pass run= a function that does; drop the nondeterminism: "
                    "torch.use_deterministic_algorithms(True), dropout in eval mode), or give a tolerance of "
                    f"at least {NOISE_FACTOR * noise:.3g}."
                )
                raise ValueError(msg)
            own_flops = census.flops
            if chosen is None:
                # With compile=, pointwise work counts too: it is what a compiler fuses.
                chosen = [
                    key
                    for key in order
                    if census.ops.get(key, 0) > 0
                    or (compile_options is not None and census.float_ops.get(key, 0) > 0)
                    or any(p.is_floating_point() for p in modules[key].parameters(recurse=False))
                ]
            search = _Search(runner, names, target, calibration)
            fast_error = search.error([], "every node compiled" if compile_options is not None else "every node fast")
            sensitivity: dict[int, float] = {}
            inside = _descendants(modules)
            if fast_error > target and compile_options is not None:
                sensitivity = sensitivities(runner, chosen, modules, names, inside, calibration)
            elif fast_error > target:
                own = _OwnWork(runner, {k: modules[k] for k in chosen})
                try:
                    for i, key in enumerate(chosen):
                        own.fast_one = key
                        what = f"sensitivity {i + 1}/{len(chosen)}: {names[key][0]}"
                        sensitivity[key] = max(runner.errors(what, calibration))
                        own.unwind()
                finally:
                    own.remove()
            else:  # nothing to search: not measured
                sensitivity = dict.fromkeys(chosen, math.nan)
            total_flops = sum(own_flops.values())
            subtree_flops = {k: own_flops.get(k, 0) + sum(own_flops.get(d, 0) for d in inside[k]) for k in modules}
            kept: list[int] = []
            if fast_error > target:
                ranked = sorted(chosen, key=lambda k: (-sensitivity[k], subtree_flops[k], order.index(k)))
                kept = _grow(search, ranked, inside, root, modules)
                if search.meets(kept, "the grown policy"):
                    kept = _prune(search, kept, "pruning")
            error = search.error(kept, "the advised policy")
            held_errors = search.errors(kept, "held-out batches", held) if held else []
            runs = runner.runs
            calibration_errors = search.errors(kept, "the advised policy")
            reason = _reason(tol, margin_value, calibration_errors, held_errors, noise)
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
    finally:
        bar.close()
    return Fp32Advice(
        policy=search.policy(kept),
        autocast=search.autocast,
        error=error,
        fast_error=fast_error,
        tolerance=tol,
        met=reason is None,
        runs=runs,
        seconds=time.perf_counter() - started,
        fast=fast_precision,
        autocast_dtype=dtype,
        nodes=nodes,
        reason=reason,
        kept_flop_share=kept_flops / total_flops if total_flops else 0.0,
        kept_parameter_share=sum(kept_params.values()) / sum(unique_params.values()) if unique_params else 0.0,
        margin=margin_value,
        noise=noise,
        held_out_error=max(held_errors) if held_errors else None,
        batch_errors={"calibration": tuple(calibration_errors), "held_out": tuple(held_errors)},
        reference="eager" if eager_reference else "float32",
        compile=compile_options,
        compiles=runner.compiles,
        node_compiles=runner.node_compiles,
        compile_seconds=runner.compile_seconds,
    )


@contextmanager
def _compiled_left_behind(compile_options: dict[str, Any] | None) -> Iterator[None]:
    """With compile=, Dynamo reset at the end too: no code compiled around advise's scopes stays cached."""
    try:
        yield
    finally:
        if compile_options is not None:
            torch.compiler.reset()


def _prefix(ranked: list[int], n: int, inside: dict[int, set[int]]) -> list[int]:
    """The first ``n`` ranked nodes, less those inside another of them."""
    first = ranked[:n]
    return [k for k in first if not any(k in inside[j] for j in first if j != k)]


def _grow(
    search: _Search,
    ranked: list[int],
    inside: dict[int, set[int]],
    root: torch.nn.Module,
    modules: dict[int, torch.nn.Module],
) -> list[int]:
    """The shortest prefix of ``ranked`` that meets the target, found by bisection (or the body added)."""
    # The full prefix is assumed to meet the target and measured only when the bisection
    # reaches it: a policy that meets it with fewer nodes spares that compile.
    low, high = 0, len(ranked)  # the prefix of `low` nodes misses (none: every node fast), of `high` meets
    while high - low > 1:
        middle = (low + high) // 2
        if search.meets(_prefix(ranked, middle, inside), f"bisection, {middle} node(s)"):
            high = middle
        else:
            low = middle
    if high < len(ranked):
        return _prefix(ranked, high, inside)
    everything = _prefix(ranked, len(ranked), inside)
    if search.meets(everything, f"every candidate kept, {len(everything)} node(s)"):
        return everything
    kept = everything  # last resort: the model's body, one direct submodule at a time
    for slot in _walk(root):
        key = id(_bare(slot.stored))
        if "." in slot.name or key in kept or key not in modules:
            continue
        kept = [k for k in kept if k not in inside[key]] + [key]
        if search.meets(kept, f"body, {len(kept)} node(s)"):
            break
    return kept


def _prune(search: _Search, kept: list[int], what: str) -> list[int]:
    """Drop nodes, the last ranked first, while the target holds, until no single one can go (measured)."""
    changed = True
    while changed:  # a pass that drops nothing has verified 1-minimality (each check cached)
        changed = False
        for key in reversed(list(kept)):
            rest = [k for k in kept if k != key]
            if search.meets(rest, f"{what}, {len(kept)} node(s)"):
                kept = rest
                changed = True
    return kept


def _reason(
    tolerance: float, margin: float, calibration: list[float], held_out: list[float], noise: float
) -> str | None:
    """Why the policy misses the tolerance on some batch (None: every batch is within it)."""
    target = tolerance / margin
    missed = [(i, e) for i, e in enumerate(calibration) if e > tolerance]
    if missed:  # the search met no target: every candidate and the body were kept
        where = ", ".join(f"calibration batch {i}: {e:.3g}" for i, e in missed[:3])
        return (
            f"with every candidate and the model's body in full float32 the error is still above the "
            f"tolerance {tolerance:.3g} ({where}): it comes from work outside every candidate (the root's "
            "own forward, autocast outside the nodes, the loss or run=), or from a metric the fast setting "
            f"cannot meet (two full float32 runs differ by {noise:.3g})"
        )
    missed = [(i, e) for i, e in enumerate(held_out) if e > tolerance]
    if missed:
        shown = 5
        worst = max(missed, key=lambda m: m[1])
        where = ", ".join(f"held-out batch {i}: {e:.3g}" for i, e in missed[:shown])
        more = f" and {len(missed) - shown} more" if len(missed) > shown else ""
        return (
            f"the policy misses the tolerance {tolerance:.3g} on {len(missed)} of {len(held_out)} held-out "
            f"batch(es) ({where}{more}; worst: batch {worst[0]}), though it meets {target:.3g} "
            f"(tolerance / margin {margin:g}) on the calibration batches: calibrate on more batches like "
            "those, or raise the margin"
        )
    return None


def _descendants(modules: dict[int, torch.nn.Module]) -> dict[int, set[int]]:
    """For each module, the ids of the modules below it (each module once)."""
    out: dict[int, set[int]] = {}
    for key, module in modules.items():
        below = {id(_bare(m)) for m in module.modules()} - {key}
        out[key] = below & set(modules)
    return out
