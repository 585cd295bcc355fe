"""Running the model for :func:`~fp32scope.advise`: the reference, the fast setting, each node's own work.

Also what every run leaves behind: nothing (:class:`_State` after every run, and
:func:`_left_as_found` around the whole of advise).
"""

from __future__ import annotations

import math
import time
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
# The backward ops of the same work: their FLOPs count for the node whose forward made them.
_BACKWARD = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_backward",
        "_efficient_attention_backward",
        "flex_attention_backward",
    }
)
# aten ops that make floating-point tensors without arithmetic on floating-point values: they
# allocate, fill, copy, join or index. Every other op with a floating-point result (views
# aside) is floating-point work a compiler may fuse, reorder or keep in another precision.
_NO_ARITHMETIC = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "zeros",
        "zeros_like",
        "new_zeros",
        "ones",
        "ones_like",
        "new_ones",
        "full",
        "full_like",
        "new_full",
        "fill",
        "fill_",
        "zero_",
        "scalar_tensor",
        "lift_fresh",
        "lift_fresh_copy",
        "detach",
        "alias",
        "clone",
        "copy",
        "copy_",
        "cat",
        "stack",
        "index",
        "index_select",
        "gather",
        "embedding",
        "_unsafe_view",
        "constant_pad_nd",
    }
)
#: The key of an autograd node's metadata that says which candidate's forward made it (0: none).
_TAG = "fp32scope.advise.node"


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


# -- which node's forward made each autograd node ---------------------------------------------


def _grad_fns(value: Any, out: list[Any]) -> list[Any]:
    """The autograd nodes that made the tensors in ``value`` (tensors, tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            out.append(value.grad_fn)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _grad_fns(v, out)
    elif isinstance(value, Mapping):
        for v in value.values():
            _grad_fns(v, out)
    return out


def _tag(value: Any, key: int) -> list[Any]:
    """Tag every untagged autograd node behind ``value`` with ``key``; the nodes tagged now.

    Called at a node's entry with the enclosing key (what came before is not the node's)
    and at its exit with its own: inner nodes exit first, so each autograd node is tagged
    with the innermost candidate whose forward made it, and visited once.
    """
    tagged = []
    stack = _grad_fns(value, [])
    while stack:
        node = stack.pop()
        if node is None or _TAG in node.metadata:
            continue
        node.metadata[_TAG] = key
        tagged.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return tagged


# -- each candidate's own work, fast or not ----------------------------------------------------


class _OwnWork:
    """Hooks that run each candidate's own work fast or in full float32, whatever encloses it.

    A candidate's own work is its forward less its candidate submodules (which set their
    own), and, with a loss, the backward of that forward: each autograd node it made runs
    at the same setting (autograd node hooks, the backward itself outside autocast).
    """

    def __init__(self, runner: _Runner, modules: dict[int, torch.nn.Module]) -> None:
        self.runner = runner
        self.fast_one: int | None = None
        self.stack: list[tuple[int, torch_flags.Token, ExitStack]] = []
        self.tokens: list[torch_flags.Token] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for key, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(key), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(key), with_kwargs=True, always_call=True))

    def _apply(self, fast: bool) -> torch_flags.Token:
        runner = self.runner
        if fast:
            return torch_flags.apply(runner.fast.matmul, runner.fast.cudnn_allow_tf32)
        return torch_flags.apply("highest", False)

    def _pre(self, key: int) -> Callable[..., Any]:
        def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            fast = key == self.fast_one
            runner = self.runner
            if torch.is_grad_enabled():
                self._hook_backward(_tag((args, kwargs), self.stack[-1][0] if self.stack else 0))
            token = self._apply(fast)
            stack = ExitStack()
            self.stack.append((key, token, stack))
            if runner.dtype is not None:
                stack.enter_context(torch.autocast(runner.device_type, runner.dtype, enabled=fast))
                if not fast:
                    return _to_float32(args), _to_float32(kwargs)
            return None

        return hook

    def _post(self, key: int) -> Callable[..., Any]:
        def hook(_module: torch.nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
            # The fast node's low-precision outputs go back into full float32 work, as its
            # arguments would at the entry of a full node.
            enclosed = len(self.stack) > 1
            if torch.is_grad_enabled():
                self._hook_backward(_tag(output, key))
            self.unwind(1)
            if key == self.fast_one and enclosed and self.runner.dtype is not None:
                return _to_float32(output)
            return None

        return hook

    def _hook_backward(self, nodes: list[Any]) -> None:
        for node in nodes:
            key = node.metadata[_TAG]
            if key == 0:
                continue  # the root's own work: the run's setting, as in the forward
            fast = key == self.fast_one
            node.register_prehook(lambda _grads, fast=fast: self.tokens.append(self._apply(fast)))
            node.register_hook(lambda _inputs, _outputs: torch_flags.restore(self.tokens.pop()))

    def unwind(self, count: int | None = None) -> None:
        while self.stack and (count is None or count > 0):
            _, token, stack = self.stack.pop()
            stack.close()
            torch_flags.restore(token)
            if count is not None:
                count -= 1

    def remove(self) -> None:
        self.unwind()
        while self.tokens:  # a backward that raised between a node's hooks
            torch_flags.restore(self.tokens.pop())
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


# -- what each node does and costs ---------------------------------------------------------------


class _Census(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's class is untyped
    """Counts matmul-like ops and their FLOPs per innermost module, its backward's included.

    Forward hooks keep the stack of modules; a backward op counts for the module whose
    forward made the autograd node that runs it (tagged as the forward went). ``float_ops``
    counts, per innermost module, every forward op doing floating-point arithmetic (a
    floating-point result, not a view, not an op that only allocates, copies, joins or
    indexes: see ``_NO_ARITHMETIC``): the work a compiler may fuse or reorder.
    """

    def __init__(self, modules: dict[int, torch.nn.Module]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        from torch.utils.flop_counter import flop_registry

        self.formulas = {packet.__name__: formula for packet, formula in flop_registry.items()}
        self.formulas["_scaled_dot_product_flash_attention_for_cpu_backward"] = _sdpa_cpu_backward_flops
        self.formulas["_grouped_mm"] = self.formulas.get("_grouped_mm", _grouped_mm_flops)
        self.stack: list[int] = [0]  # 0: the root's own work
        self.ops: dict[int, int] = {}
        self.float_ops: dict[int, int] = {}
        self.flops: dict[int, int] = {}
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for key, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(self._push(key), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._pop(key), always_call=True))

    def _push(self, key: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if torch.is_grad_enabled():
                _tag((args, kwargs), self.stack[-1])
            self.stack.append(key)

        return hook

    def _pop(self, key: int) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                _tag(output, key)
            if len(self.stack) > 1:
                self.stack.pop()

        return hook

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        node: Any = torch._C._current_autograd_node()  # None in the forward
        if node is None and _float_work(func, name, out):
            key = self.stack[-1]
            self.float_ops[key] = self.float_ops.get(key, 0) + 1
        if node is None and name in _MATMUL_LIKE:
            key = self.stack[-1]
            self.ops[key] = self.ops.get(key, 0) + 1
        elif node is not None and name in _BACKWARD:
            key = node.metadata.get(_TAG, 0)
        else:
            return out
        formula = self.formulas.get(_BORROWED_FORMULA.get(name, name))
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


def _float_work(func: Any, name: str, out: Any) -> bool:
    """Whether an op does floating-point arithmetic: a floating-point result, not a view, not a copy."""
    if name in _NO_ARITHMETIC or not _floats(out, []):
        return False
    returns = func._schema.returns
    # A view (its result aliases an input without writing it) computes nothing.
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _grouped_mm_flops(a: torch.Tensor, *_: Any, out_val: torch.Tensor, **__: Any) -> int:
    # Each output element is a dot product of length K (the last dimension of the first operand).
    return 2 * out_val.numel() * a.shape[-1]


def _sdpa_cpu_backward_flops(
    _grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any
) -> int:
    # Four products of the forward's size: dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q.
    *batch, length_q, depth = query.shape
    length_k, depth_v = key.shape[-2], value.shape[-1]
    heads = math.prod(batch)
    return 2 * heads * length_q * length_k * (2 * depth_v + 2 * depth)


# -- the model's state, put back after every run -------------------------------------------------


class _State:
    """Every module's parameters, buffers and training flags, as found; :meth:`put_back` restores them.

    Buffers are copied (on their device) and written back after every run: a kernel may
    write one without a trace (BatchNorm's running statistics move no version counter).
    Parameters are copied to the CPU and written back only when their version counter
    moved (a write in Python, or an op that declares it).
    """

    def __init__(self, root: torch.nn.Module) -> None:
        self.modules = list(root.modules())
        self.training = [m.training for m in self.modules]
        self.slots = [(m, dict(m._parameters), dict(m._buffers)) for m in self.modules]
        with torch.no_grad():
            self.buffers = [(b, b.detach().clone()) for m in self.modules for b in m._buffers.values() if b is not None]
            self.params = [
                (p, p._version, p.detach().to("cpu", copy=True), p.requires_grad)
                for p in {id(p): p for p in root.parameters()}.values()
            ]

    def put_back(self) -> None:
        """The tensors, their values and the training flags as found (gradients are the runner's)."""
        for module, mode in zip(self.modules, self.training, strict=True):
            module.training = mode
        for module, parameters, buffers in self.slots:
            slots: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
                (module._parameters, parameters),
                (module._buffers, buffers),
            )
            for live, found in slots:
                # By identity: a tensor's == compares values.
                if live.keys() != found.keys() or any(live[k] is not v for k, v in found.items()):
                    live.clear()
                    live.update(found)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
            for i, (p, version, saved, requires_grad) in enumerate(self.params):
                if p._version != version:
                    p.copy_(saved)
                    self.params[i] = (p, p._version, saved, requires_grad)
                if p.requires_grad != requires_grad:
                    p.requires_grad_(requires_grad)


# -- running the model ---------------------------------------------------------------------------


class _Runner:
    """Runs the model on each batch at a setting, and measures the error against the reference."""

    def __init__(  # noqa: PLR0913, PLR0917  (advise's checked arguments, kept together)
        self,
        root: torch.nn.Module,
        batches: list[Batch],
        fast: Fp32Precision,
        dtype: torch.dtype | None,
        loss: Callable[[Any], torch.Tensor] | None,
        metric: Callable[[Any, Any], float] | None,
        call: Callable[..., Any] | None,
        progress: _Progress,
        device_type: str,
        state: _State,
    ) -> None:
        self.root = root
        self.batches = batches
        self.fast = fast
        self.dtype = dtype
        self.loss = loss
        self.metric = metric
        self.call = call
        self.progress = progress
        self.device_type = device_type
        self.state = state
        self.params = [p for p in root.parameters() if p.requires_grad] if loss is not None else []
        self.runs = 0
        self.reference: list[_Outcome] = []
        #: Whether the reference runs at the fast setting (``reference="eager"``) or in full float32.
        self.reference_fast = False
        #: torch.compile's keyword arguments for the fast runs (None: the fast runs are eager).
        self.compile: dict[str, Any] | None = None
        #: Whole-model compiles (one per policy measured), node compiles (one per candidate alone),
        #: and the seconds spent in runs of compiled code, the compiles included.
        self.compiles = 0
        self.node_compiles = 0
        self.compile_seconds = 0.0

    def compiled(self, module: Callable[..., Any], *, whole: bool) -> Callable[..., Any]:
        """``module`` (the model, or one candidate's forward) compiled afresh (Dynamo reset first)."""
        options = dict(self.compile or {})
        if not whole:
            options.pop("fullgraph", None)  # a node alone may break its graph: only its numerics matter
        torch.compiler.reset()
        if whole:
            self.compiles += 1
        else:
            self.node_compiles += 1
        compiled: Callable[..., Any] = torch.compile(module, **options)
        return compiled

    def _run(self, batch: Batch, *, fast: bool, model: Callable[..., Any] | None = None) -> _Outcome:
        args, kwargs = batch
        model = self.root if model is None else model
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
            stack.callback(self.state.put_back)  # after every run, also one that raised
            if self.loss is None:
                stack.enter_context(torch.no_grad())
            torch.manual_seed(0)  # the same dropout masks in every run (the caller's RNG state is kept)
            for p in self.params:
                p.grad = None
            self.runs += 1
            with ExitStack() as forward:
                if fast and self.dtype is not None:
                    forward.enter_context(torch.autocast(self.device_type, self.dtype))
                output = model(*args, **kwargs) if self.call is None else self.call(model, *args, **kwargs)
                value = self.loss(output) if self.loss is not None else None
            grads: list[torch.Tensor] = []
            if value is not None:
                # Outside autocast, as torch's automatic mixed precision recipe runs it.
                value.backward()  # type: ignore[no-untyped-call]
                grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in self.params]
                for p in self.params:
                    p.grad = None
            return _Outcome(output if self.metric is not None else None, _floats(output, []), grads)

    def measure_reference(self, census: _Census) -> None:
        """Run every batch as the reference; the first one counts the ops of each module too."""
        fast = self.reference_fast
        self.progress.show(self.runs, "reference (eager)" if fast else "reference (full float32)")
        for i, batch in enumerate(self.batches):
            if i == 0:
                try:
                    with census:
                        self.reference.append(self._run(batch, fast=fast))
                finally:
                    census.remove()
            else:
                self.reference.append(self._run(batch, fast=fast))

    def error(self, index: int, *, fast: bool = True, model: Callable[..., Any] | None = None) -> float:
        """The error of one run of batch ``index`` at the fast setting (or the reference's), of ``model``."""
        ref = self.reference[index]
        if model is None:
            out = self._run(self.batches[index], fast=fast)
        else:
            started = time.perf_counter()
            try:
                out = self._run(self.batches[index], fast=fast, model=model)
            finally:
                self.compile_seconds += time.perf_counter() - started
        if self.metric is not None:
            err = float(self.metric(out.output, ref.output))
        else:
            err = relative_error(out.floats, ref.floats)
        if self.loss is not None:
            err = max(err, relative_error(out.grads, ref.grads))
        return math.inf if math.isnan(err) else err

    def errors(
        self, what: str, which: range | list[int], *, fast: bool = True, model: Callable[..., Any] | None = None
    ) -> list[float]:
        """The error of each batch of ``which`` (``model``: what to call instead of the model)."""
        self.progress.show(self.runs, what)
        return [self.error(i, fast=fast, model=model) for i in which]


@contextmanager
def _left_as_found(root: torch.nn.Module, state: _State, loss_given: bool) -> Iterator[None]:
    """Put back the module tree, tensors, gradients, training flags, precision flags, autocast and RNG."""
    tree = [(m, dict(m._modules)) for m in root.modules()]
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
        state.put_back()
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
