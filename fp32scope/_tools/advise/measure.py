"""Running the model for :func:`~fp32scope.advise`: the reference, the fast setting, each node's own work.

Also what every run leaves behind: nothing (:func:`left_as_found`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple, TextIO

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp32scope._flags import torch_flags
from fp32scope._flags.precision import Fp32Precision

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


Batch = tuple[tuple[Any, ...], dict[str, Any]]


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
