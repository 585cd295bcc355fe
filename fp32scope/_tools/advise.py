"""``advise``: measure which submodules need full float32, and propose the smallest policy that does.

The model runs a few times on the caller's batches: once in full float32 (the reference), once
at the fast precision (every node fast), once per candidate node with only that node's own
work fast, then under candidate policies applied through :func:`~fp32scope.scope_modules`
itself, until a policy meets the tolerance and no node of it can be dropped.

Nothing is left behind: the module tree, parameters, buffers, gradients, the training flag,
the float32 precision flags, the autocast state and the random number generators are as they
were when :func:`advise` returns or raises.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple, TextIO

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp32scope._flags import torch_flags
from fp32scope._flags.precision import Fp32Precision, check_matmul
from fp32scope._flags.process import current_fp32_precision
from fp32scope._tools.doctor import load_model
from fp32scope._tools.targets import TargetError, call_factory, resolve
from fp32scope._wrappers.policy import _bare, _Policy, _walk, scope_modules, scoped_modules, unscope_modules

__all__ = ["Fp32Advice", "Fp32AdviceNode", "advise"]

#: The precision every kept node gets, as JSON holds it: full float32 for matmuls and cuDNN.
FULL_FLOAT32: dict[str, Any] = {"matmul": "highest", "cudnn_allow_tf32": False}

# aten ops whose precision the float32 flags or autocast change: torch's FLOP counter's
# formulas, plus the matmul-like ops it has none for (counted, with no FLOPs, or a formula
# borrowed from the same op on another backend).
_MATMUL_LIKE = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "convolution",
        "_convolution",
        "convolution_overrideable",
        "cudnn_convolution",
        "mkldnn_convolution",
        "_slow_conv2d_forward",
        "_scaled_mm",
        "_grouped_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "flex_attention",
    }
)
_BORROWED_FORMULA = {"_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention"}


class Fp32AdviceNode(NamedTuple):
    """One candidate node of :func:`advise`: what it is, what it costs, and how sensitive it is."""

    #: Qualified name, as ``model.named_modules()`` gives it.
    name: str
    #: The module's class name.
    type: str
    #: Parameters held by the node and its submodules (each tensor once).
    parameters: int
    #: Share of the model's forward FLOPs (torch's FLOP counter) run by the node and its submodules.
    flop_share: float
    #: The error with only this node's own work fast and every other candidate's in full float32
    #: (nan where not measured: every node fast met the tolerance).
    sensitivity: float
    #: Whether the advised policy keeps it in full float32.
    kept: bool


@dataclasses.dataclass(frozen=True)
class Fp32Advice:
    """What :func:`advise` found: the policy, the errors measured with and without it, and each node.

    ``policy`` is ``{qualified name: {"matmul": "highest", "cudnn_allow_tf32": False}}``, a
    mapping :func:`~fp32scope.scope_modules` takes as it is or after a round trip through
    JSON; ``autocast`` is what to pass to it with the policy (False when the model runs under
    ``torch.autocast``: the kept nodes then run without it; else None).
    """

    #: {qualified name: full float32}, JSON-ready; empty when every node may run fast.
    policy: dict[str, dict[str, Any]]
    #: The ``autocast`` argument of :func:`~fp32scope.scope_modules` for this policy.
    autocast: bool | None
    #: The error with the policy applied (through scope_modules), the largest over the batches.
    error: float
    #: The error with every node at the fast precision (no policy).
    fast_error: float
    #: The tolerance the policy was searched for.
    tolerance: float
    #: Whether ``error <= tolerance``.
    met: bool
    #: How many times the model ran (one call per batch, each setting).
    runs: int
    #: Seconds :func:`advise` took.
    seconds: float
    #: The fast precision the model was measured at, and the autocast dtype (None: none).
    fast: Fp32Precision
    autocast_dtype: torch.dtype | None
    #: Every candidate node, in module order.
    nodes: tuple[Fp32AdviceNode, ...]
    #: Why the tolerance is not met (None when it is).
    reason: str | None = None

    #: Share of the model's forward FLOPs that the policy runs in full float32.
    kept_flop_share: float = 0.0
    #: Share of the model's parameters held by the nodes the policy keeps (and their submodules).
    kept_parameter_share: float = 0.0

    @property
    def kept(self) -> tuple[str, ...]:
        """The names of the nodes the policy keeps in full float32."""
        return tuple(self.policy)

    def apply(self, model: torch.nn.Module) -> dict[str, Fp32Precision]:
        """Scope ``model`` with the policy: ``scope_modules(model, policy, autocast=...)``."""
        return scope_modules(model, self.policy, autocast=self.autocast)

    def table(self) -> str:
        """The nodes as a plain text table, then the errors and the share kept in full float32.

        The ``kept`` column says ``yes`` for a node of the policy and ``inside`` for one that
        runs in full float32 because a node of the policy encloses it.
        """
        header = ("node", "class", "params", "FLOPs", "sensitivity", "kept")
        rows = [
            (
                n.name,
                n.type,
                str(n.parameters),
                f"{n.flop_share:.1%}",
                "-" if math.isnan(n.sensitivity) else f"{n.sensitivity:.3g}",
                "yes" if n.kept else "inside" if any(n.name.startswith(f"{k}.") for k in self.policy) else "",
            )
            for n in self.nodes
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        fast = f"matmul {self.fast.matmul!r}" + (
            f" under autocast {str(self.autocast_dtype).removeprefix('torch.')}" if self.autocast_dtype else ""
        )
        lines += [
            "",
            f"fast ({fast}) error: {self.fast_error:.3g}; tolerance {self.tolerance:.3g}",
            (
                f"advised error: {self.error:.3g} with {len(self.policy)} node(s) in full float32 "
                f"({self.kept_flop_share:.1%} of FLOPs, {self.kept_parameter_share:.1%} of parameters); "
                f"{'met' if self.met else 'NOT met'} ({self.runs} runs, {self.seconds:.1f} s)"
            ),
        ]
        if self.reason is not None:
            lines.append(f"why: {self.reason}")
        return "\n".join(lines)

    def plot(self, path: str | Any) -> None:
        """Save a bar chart of each node's sensitivity (log scale) with the tolerance line to ``path``.

        Needs matplotlib: ``pip install fp32scope[plot]``.
        """
        try:
            import matplotlib as mpl

            mpl.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError as error:
            msg = "Fp32Advice.plot needs matplotlib: pip install fp32scope[plot]"
            raise ImportError(msg) from error
        floor = self.tolerance * 1e-3
        finite = [n.sensitivity for n in self.nodes if math.isfinite(n.sensitivity)]
        top = max([1.0, *finite])
        # Not measured (nan): at the floor; an infinite error: at the top of the chart.
        values = [
            floor if math.isnan(n.sensitivity) else top if math.isinf(n.sensitivity) else max(n.sensitivity, floor)
            for n in self.nodes
        ]
        colors = ["tab:red" if n.kept else "tab:blue" for n in self.nodes]
        fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(self.nodes) + 2), 4.5))
        try:
            ax.bar(range(len(values)), values, color=colors)
            ax.set_yscale("log")
            ax.axhline(self.tolerance, color="black", linestyle="--", linewidth=1, label="tolerance")
            ax.set_xticks(range(len(values)))
            ax.set_xticklabels([n.name for n in self.nodes], rotation=75, ha="right", fontsize=7)
            ax.set_ylabel("error with only this node fast")
            ax.set_title(
                f"fast error {self.fast_error:.2g}, advised {self.error:.2g} "
                f"({len(self.policy)} kept, red; tolerance {self.tolerance:.2g})",
                fontsize=9,
            )
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(path)
        finally:
            plt.close(fig)


# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
Fp32Advice.__module__ = "fp32scope"
Fp32AdviceNode.__module__ = "fp32scope"


# -- arguments ------------------------------------------------------------------------------

Batch = tuple[tuple[Any, ...], dict[str, Any]]


def _check_model(model: object) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        msg = f"model must be a torch.nn.Module; got {model!r} of type {type(model).__name__}."
        raise TypeError(msg)
    root = _bare(model)
    if scoped_modules(root):
        msg = (
            f"model has scoped nodes already ({', '.join(scoped_modules(root))}); advise measures a bare "
            "model: call fp32scope.unscope_modules(model) first."
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


def _check_inputs(inputs: object) -> list[Batch]:
    if isinstance(inputs, list):
        if not inputs:
            msg = "inputs is an empty list; give one batch or a list of at least one."
            raise ValueError(msg)
        return [_one_batch(b, f"inputs[{i}]") for i, b in enumerate(inputs)]
    return [_one_batch(inputs, "inputs")]


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


# -- running the model ----------------------------------------------------------------------


def _device_type(batches: list[Batch], root: torch.nn.Module) -> str:
    for args, kwargs in batches:
        for value in [*args, *kwargs.values()]:
            if isinstance(value, torch.Tensor):
                return value.device.type
    for p in root.parameters():
        return p.device.type
    return "cpu"


def _floats(value: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every floating-point tensor in ``value`` (tensors, tuples, lists, dicts), in order."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            out.append(value.detach())
    elif isinstance(value, (list, tuple)):
        for v in value:
            _floats(v, out)
    elif isinstance(value, Mapping):
        for v in value.values():
            _floats(v, out)
    return out


def relative_error(tensors: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """``||y - y_ref|| / ||y_ref||`` in float64 over all the tensors together; inf where they do not match."""
    if len(tensors) != len(reference) or any(a.shape != b.shape for a, b in zip(tensors, reference, strict=True)):
        return math.inf
    diff = 0.0
    norm = 0.0
    for a, b in zip(tensors, reference, strict=True):
        ref = b.to(torch.complex128 if b.is_complex() else torch.float64)
        diff += float(torch.linalg.vector_norm(a.to(ref.dtype) - ref).item()) ** 2
        norm += float(torch.linalg.vector_norm(ref).item()) ** 2
    if not (math.isfinite(diff) and math.isfinite(norm)):
        return math.inf
    if norm == 0.0:
        return math.sqrt(diff)  # nothing to be relative to: the absolute error
    return math.sqrt(diff / norm)


class _Outcome(NamedTuple):
    output: Any
    floats: list[torch.Tensor]
    grads: list[torch.Tensor]


class _Progress:
    def __init__(self, enabled: bool, stream: TextIO) -> None:
        self.enabled = enabled
        self.stream = stream
        self.shown = False

    def show(self, runs: int, what: str) -> None:
        if self.enabled:
            self.stream.write(f"\rfp32scope advise: {runs} runs, {what}"[:100].ljust(100))
            self.stream.flush()
            self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


class _OwnWork:
    """Forward hooks that run each candidate's own work fast or in full float32, whatever encloses it.

    A candidate's own work is its forward less its candidate submodules (which set their own).
    """

    def __init__(self, runner: _Runner, modules: dict[int, torch.nn.Module]) -> None:
        self.runner = runner
        self.fast_one: int | None = None
        self.stack: list[tuple[torch_flags.Token, ExitStack]] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for key, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(key), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def _pre(self, key: int) -> Callable[..., Any]:
        def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            fast = key == self.fast_one
            runner = self.runner
            if fast:
                token = torch_flags.apply(runner.fast.matmul, runner.fast.cudnn_allow_tf32)
            else:
                token = torch_flags.apply("highest", False)
            stack = ExitStack()
            self.stack.append((token, stack))
            if runner.dtype is not None:
                stack.enter_context(torch.autocast(runner.device_type, runner.dtype, enabled=fast))
                if not fast:
                    return _to_float32(args), _to_float32(kwargs)
            return None

        return hook

    def _post(self, module: torch.nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
        # The fast node's low-precision outputs go back into full float32 work, as its
        # arguments would at the entry of a full node.
        inner_fast = self.fast_one is not None and id(module) == self.fast_one
        enclosed = len(self.stack) > 1
        self.unwind(1)
        if inner_fast and enclosed and self.runner.dtype is not None:
            return _to_float32(output)
        return None

    def unwind(self, count: int | None = None) -> None:
        while self.stack and (count is None or count > 0):
            token, stack = self.stack.pop()
            stack.close()
            torch_flags.restore(token)
            if count is not None:
                count -= 1

    def remove(self) -> None:
        self.unwind()
        for handle in self.handles:
            handle.remove()


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype is not torch.float64:
            return value.to(torch.float32)
        return value
    if isinstance(value, list):
        return [_to_float32(v) for v in value]
    if isinstance(value, tuple):
        items = [_to_float32(v) for v in value]
        make = getattr(type(value), "_make", None)
        return make(items) if make is not None else tuple(items)
    if isinstance(value, dict):
        return {k: _to_float32(v) for k, v in value.items()}
    return value


class _Census(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's class is untyped
    """Counts matmul-like ops and their FLOPs per innermost module (forward hooks keep the stack)."""

    def __init__(self, modules: dict[int, torch.nn.Module]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        from torch.utils.flop_counter import flop_registry

        self.formulas = {packet.__name__: formula for packet, formula in flop_registry.items()}
        self.stack: list[int] = [0]  # 0: the root's own work
        self.ops: dict[int, int] = {}
        self.flops: dict[int, int] = {}
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for key, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(self._push(key)))
            self.handles.append(module.register_forward_hook(self._pop, always_call=True))

    def _push(self, key: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.stack.append(key)

        return hook

    def _pop(self, *_: Any) -> None:
        if len(self.stack) > 1:
            self.stack.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _MATMUL_LIKE:
            key = self.stack[-1]
            self.ops[key] = self.ops.get(key, 0) + 1
            formula = self.formulas.get(_BORROWED_FORMULA.get(name, name))
            if name == "_grouped_mm" and formula is None:
                formula = _grouped_mm_flops
            if formula is not None:
                try:
                    count = int(formula(*args, **kwargs, out_val=out))
                except Exception:  # noqa: BLE001  (a formula that does not fit this variant: no FLOPs)
                    count = 0
                self.flops[key] = self.flops.get(key, 0) + count
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _grouped_mm_flops(a: torch.Tensor, *_: Any, out_val: torch.Tensor, **__: Any) -> int:
    # Each output element is a dot product of length K (the last dimension of the first operand).
    return 2 * out_val.numel() * a.shape[-1]


class _Runner:
    """Runs the model on every batch at a setting, and measures the error against the reference."""

    def __init__(  # noqa: PLR0913, PLR0917  (advise's checked arguments, kept together)
        self,
        root: torch.nn.Module,
        batches: list[Batch],
        fast: Fp32Precision,
        dtype: torch.dtype | None,
        loss: Callable[[Any], torch.Tensor] | None,
        metric: Callable[[Any, Any], float] | None,
        progress: _Progress,
        device_type: str,
    ) -> None:
        self.root = root
        self.batches = batches
        self.fast = fast
        self.dtype = dtype
        self.loss = loss
        self.metric = metric
        self.progress = progress
        self.device_type = device_type
        self.params = [p for p in root.parameters() if p.requires_grad] if loss is not None else []
        self.runs = 0
        self.reference: list[_Outcome] = []

    def _run(self, batch: Batch, *, fast: bool) -> _Outcome:
        args, kwargs = batch
        with ExitStack() as stack:
            token = (
                torch_flags.apply(self.fast.matmul, self.fast.cudnn_allow_tf32)
                if fast
                else torch_flags.apply("highest", False)
            )
            stack.callback(torch_flags.restore, token)
            # The caller's own autocast, if any, is not part of either setting.
            for device_type in dict.fromkeys(("cpu", self.device_type)):
                stack.enter_context(torch.autocast(device_type, enabled=False))
            if fast and self.dtype is not None:
                stack.enter_context(torch.autocast(self.device_type, self.dtype))
            if self.loss is None:
                stack.enter_context(torch.no_grad())
            torch.manual_seed(0)  # the same dropout masks in every run (the caller's RNG state is kept)
            for p in self.params:
                p.grad = None
            self.runs += 1
            output = self.root(*args, **kwargs)
            grads: list[torch.Tensor] = []
            if self.loss is not None:
                value = self.loss(output)
                value.backward()  # type: ignore[no-untyped-call]
                grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in self.params]
                for p in self.params:
                    p.grad = None
            return _Outcome(output if self.metric is not None else None, _floats(output, []), grads)

    def measure_reference(self, census: _Census) -> None:
        """Run every batch in full float32; the first one counts the ops of each module too."""
        self.progress.show(self.runs, "reference (full float32)")
        for i, batch in enumerate(self.batches):
            if i == 0:
                try:
                    with census:
                        self.reference.append(self._run(batch, fast=False))
                finally:
                    census.remove()
            else:
                self.reference.append(self._run(batch, fast=False))

    def error(self, what: str, *, fast: bool = True) -> float:
        """The largest error over the batches of a run at the fast setting (or the reference's)."""
        self.progress.show(self.runs, what)
        worst = 0.0
        for batch, ref in zip(self.batches, self.reference, strict=True):
            out = self._run(batch, fast=fast)
            if self.metric is not None:
                err = float(self.metric(out.output, ref.output))
            else:
                err = relative_error(out.floats, ref.floats)
            if self.loss is not None:
                err = max(err, relative_error(out.grads, ref.grads))
            if math.isnan(err):
                err = math.inf
            worst = max(worst, err)
        return worst


@contextmanager
def _left_as_found(root: torch.nn.Module, loss_given: bool) -> Iterator[None]:
    """Put back the module tree, gradients, training flags, precision flags, autocast and RNG state."""
    tree = [(m, dict(m._modules)) for m in root.modules()]
    training = [(m, m.training) for m in root.modules()]
    grads = [(p, p.grad) for p in root.parameters()] if loss_given else []
    raw = torch_flags.save_raw_state()
    autocast = [
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if _autocast_known(d)
    ]
    cache = torch.is_autocast_cache_enabled()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for module, modules in tree:
            for key, child in modules.items():
                if module._modules.get(key) is not child:
                    module._modules[key] = child
        for module, mode in training:
            module.training = mode
        for p, grad in grads:
            p.grad = grad
        torch_flags.restore_raw_state(raw)
        for d, enabled, dtype in autocast:
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)
        torch.set_autocast_cache_enabled(cache)


def _autocast_known(device_type: str) -> bool:
    try:
        torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):
        return False
    return True


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


# -- python -m fp32scope advise ---------------------------------------------------------------

DESCRIPTION = """\
Find which nodes of a model need full float32: run the model on the given batches in full
float32 (the reference), at the fast setting (--fast, --autocast), and under candidate
policies, and print each node's sensitivity and a 1-minimal policy that keeps the error
within --tolerance."""

EPILOG = """\
MODULE:ATTR targets: the model is a torch.nn.Module, or a function or class returning one
when called without arguments; the inputs are a batch (a tuple of positional arguments, a
dict of keyword arguments or a tensor), a list of batches, or a function returning one;
the loss is a callable (output) -> scalar tensor, taken as it is.

--output FILE.json writes the policy, which fp32scope.scope_modules loads as it is (with
autocast=False when --autocast is given).

Exit status: 0 when the policy meets the tolerance (an empty policy included), 1 when
it does not, 2 for a bad option or a target that cannot be loaded."""

_AUTOCAST_WORDS = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def add_arguments(parser: Any) -> None:
    """Add the ``advise`` command's arguments to ``parser``."""
    parser.add_argument("model", metavar="MODULE:ATTR", help="the model, or a factory of one")
    parser.add_argument(
        "--inputs", metavar="MODULE:ATTR", required=True, help="a batch, a list of batches, or a factory of one"
    )
    parser.add_argument("--fast", metavar="WORD", help="the fast matmul precision (default: the process's)")
    parser.add_argument("--autocast", metavar="bf16|fp16", help="run the model under torch.autocast with this dtype")
    parser.add_argument("--tolerance", metavar="T", default="1e-3", help="the largest error allowed (default 1e-3)")
    parser.add_argument("--loss", metavar="MODULE:ATTR", help="a loss (output) -> scalar: gradients count too")
    parser.add_argument("--output", metavar="FILE.json", help="write the policy as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="save the sensitivity chart (needs matplotlib)")


def _load(target: str, what: str, *, call: bool) -> Any:
    obj, attribute = resolve(target, example="engine.data:batches")
    if call and callable(obj) and not isinstance(obj, (torch.Tensor, tuple, list, Mapping)):
        obj = call_factory(obj, attribute)
    if not call and not callable(obj):
        msg = f"{what} {attribute} is not callable; got an object of type {type(obj).__name__}"
        raise TargetError(msg)
    return obj


def run(args: Any) -> int:  # noqa: C901, PLR0911  (one check per option, each its own exit)
    """Run ``advise`` for the command line; 0 when the tolerance is met, 1 when not, 2 for a bad argument."""
    import json

    def refuse(option: str, reason: str) -> int:
        print(f"fp32scope advise: {option}: {reason}", file=sys.stderr)
        return 2

    try:
        model = load_model(args.model)
    except TargetError as error:
        return refuse(args.model, str(error))
    try:
        inputs = _load(args.inputs, "--inputs", call=True)
        _check_inputs(inputs)
    except (TargetError, TypeError, ValueError) as error:
        return refuse(f"--inputs {args.inputs}", str(error))
    loss = None
    if args.loss is not None:
        try:
            loss = _load(args.loss, "--loss", call=False)
        except TargetError as error:
            return refuse(f"--loss {args.loss}", str(error))
    try:
        fast = _check_fast(args.fast)
    except (TypeError, ValueError) as error:
        return refuse(f"--fast {args.fast}", str(error))
    dtype = None
    if args.autocast is not None:
        dtype = _AUTOCAST_WORDS.get(args.autocast.lower())
        if dtype is None:
            return refuse(f"--autocast {args.autocast}", "expected bf16 or fp16")
    try:
        tolerance = _check_tolerance(float(args.tolerance))
    except ValueError as error:
        return refuse(f"--tolerance {args.tolerance}", str(error) if "tolerance" in str(error) else "not a number")
    if args.plot is not None:
        try:
            import matplotlib as mpl  # noqa: F401
        except ImportError:
            return refuse(f"--plot {args.plot}", "needs matplotlib: pip install fp32scope[plot]")
    advice = advise(model, inputs, fast=fast, autocast=dtype, tolerance=tolerance, loss=loss)
    print(advice.table())
    print()
    print("policy:")
    print(json.dumps(advice.policy, indent=2))
    if args.output is not None:
        with open(args.output, "w", encoding="utf-8") as f:  # noqa: PTH123  (a path the user gave)
            json.dump(advice.policy, f, indent=2)
            f.write("\n")
        hint = ", autocast=False" if advice.autocast is False else ""
        print(f"wrote {args.output}: fp32scope.scope_modules(model, json.load(f){hint})")
    if args.plot is not None:
        advice.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0 if advice.met else 1
