"""A scoped node's backward hands each leaf the engine's gradient buffer, as torch does.

Where torch's ``AccumulateGrad`` would steal the gradient (``.grad`` unset, nothing else
holding it, the gradient layout contract kept), the scoped node's parameter gets that very
buffer; where torch copies or adds in place, so does the scoped node. Copies are counted
with a dispatch mode over whole training steps, bare and scoped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp32scope import Fp32ScopedModule, set_process_default, with_fp32_precision
from fp32scope._training import leaf_grads as _leaf_grads
from tests._support.common import FULL, PythonIdentity

_COPIES = {"copy_", "clone", "_to_copy", "copy"}


@pytest.fixture(autouse=True)
def _default() -> None:
    set_process_default(FULL)


class CountCopies(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the copy ops (and their bytes) that run while it is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _COPIES:
            first = out if isinstance(out, torch.Tensor) else args[0]
            self.ops.append((name, first.numel() * first.element_size()))
        return out


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))


def _copies_in_steps(
    module: Callable[[torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter], *, clear: bool
) -> list[tuple[str, int]]:
    x = torch.randn(32, 512)
    torch.autograd.backward(module(x).square().mean())  # warm up (first-call probes, allocator)
    for p in params:
        p.grad = None
    with CountCopies() as mode:
        for _ in range(2):
            torch.autograd.backward(module(x).square().mean())
            if clear:
                for p in params:
                    p.grad = None
    ops: list[tuple[str, int]] = mode.ops
    return ops


@pytest.mark.parametrize("clear", [True, False], ids=["grads-cleared", "grads-accumulated"])
@pytest.mark.parametrize("wrap", ["proxy", "decorated"])
def test_a_training_step_copies_what_the_bare_step_copies(wrap: str, clear: bool) -> None:
    bare = _mlp()
    expected = _copies_in_steps(bare, list(bare.parameters()), clear=clear)
    model = _mlp()
    scoped = Fp32ScopedModule(model, FULL) if wrap == "proxy" else with_fp32_precision(FULL)(model.forward)
    got = _copies_in_steps(scoped, list(model.parameters()), clear=clear)
    assert got == expected
    assert expected == []  # torch steals every gradient here, then adds in place


class _Source(torch.autograd.Function):
    """Identity; its backward makes the gradient and notes where its buffer lives."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, made: list[int], row_major: bool) -> torch.Tensor:
        ctx.made = made
        ctx.row_major = row_major
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = grad * 2
        if ctx.row_major:  # strides unlike a transposed leaf's: the layout contract breaks
            out = out.contiguous()
        ctx.made.append(out.data_ptr())
        return out, None, None


def _stolen(scoped: bool, how: str) -> tuple[bool, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    made: list[int] = []
    kept: list[torch.Tensor] = []
    if how == "hook keeps it":
        weight.register_hook(kept.append)  # type: ignore[no-untyped-call]
    elif how == "hook observes it":
        weight.register_hook(lambda g: None)  # type: ignore[no-untyped-call]
    elif how.startswith("transposed"):
        weight = torch.nn.Parameter(torch.randn(4, 4).t())  # a dense leaf that is not contiguous

    def node(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x @ _Source.apply(weight, made, how == "transposed, gradient row-major")  # type: ignore[no-untyped-call]
        return out

    fn = with_fp32_precision(FULL)(node) if scoped else node
    torch.autograd.backward(fn(torch.randn(3, 4)).pow(2).sum())
    assert weight.grad is not None
    return weight.grad.data_ptr() == made[-1], weight.grad


@pytest.mark.parametrize(
    "how", ["alone", "hook observes it", "hook keeps it", "transposed", "transposed, gradient row-major"]
)
def test_the_leaf_gets_the_engines_buffer_exactly_where_torch_steals_it(how: str) -> None:
    bare_stole, bare_grad = _stolen(scoped=False, how=how)
    scoped_stole, scoped_grad = _stolen(scoped=True, how=how)
    torch.testing.assert_close(scoped_grad, bare_grad)
    if how in {"alone", "hook observes it", "transposed"}:
        assert bare_stole  # the control: torch steals here
    if how == "transposed, gradient row-major":
        assert not bare_stole  # the gradient's strides break the layout contract: torch copies
    if how == "hook keeps it":
        assert not bare_stole  # a buffer a hook kept must not become .grad
    if how == "hook observes it":
        # Documented: with a tensor hook of its own the leaf gets torch's copy.
        assert not scoped_stole
        return
    assert scoped_stole == bare_stole


def test_a_stolen_gradient_is_accumulated_into_in_place_on_the_next_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    node = Fp32ScopedModule(model, FULL)
    x = torch.randn(4, 8)
    torch.autograd.backward(node(x).sum())
    assert model.weight.grad is not None
    first = model.weight.grad.clone()
    ptr = model.weight.grad.data_ptr()
    torch.autograd.backward(node(x).sum())
    assert model.weight.grad.data_ptr() == ptr
    torch.testing.assert_close(model.weight.grad, 2 * first)


class CountOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The names of the ops that run while it is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("how", ["grad", "backward-inputs"])
@pytest.mark.parametrize("python_node", [False, True], ids=["torch-nodes-only", "python-node-inside"])
def test_a_backward_that_needs_only_the_input_computes_what_the_bare_one_computes(how: str, python_node: bool) -> None:
    # The parameters' gradients are not asked for: the node's backward leaves them out,
    # as torch's engine does (no matmul for the weight's gradient).
    def block(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        def call(h: torch.Tensor) -> torch.Tensor:
            if python_node:
                h = PythonIdentity.apply(h)  # type: ignore[no-untyped-call]
            return torch.tanh(linear(h))

        return call

    def backward_ops(node: Callable[[torch.Tensor], torch.Tensor], linear: torch.nn.Linear) -> list[str]:
        x = torch.randn(4, 16, requires_grad=True)
        loss = node(x * 2).square().sum()
        with CountOps() as mode:
            if how == "grad":
                torch.autograd.grad(loss, [x])
            else:
                torch.autograd.backward(loss, inputs=[x])
        assert linear.weight.grad is None
        return sorted(mode.names)

    torch.manual_seed(0)
    bare = torch.nn.Linear(16, 16)
    scoped = torch.nn.Linear(16, 16)
    expected = backward_ops(block(bare), bare)
    got = backward_ops(with_fp32_precision(FULL)(block(scoped)), scoped)
    assert got == expected
    assert "mm" in expected  # the input's gradient is a matmul; the weight's would be one more


class _MakeGrad(torch.autograd.Function):
    """Identity; its backward hands on a gradient with the strides it is given."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, strides: tuple[int, ...], made: list[Any], keep: bool) -> torch.Tensor:
        ctx.strides = strides
        ctx.made = made
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = torch.empty_strided(grad.shape, ctx.strides).copy_(grad * 2)
        ctx.made.append(out if ctx.keep else out.data_ptr())  # kept: no longer the engine's alone
        return out, None, None, None


# (leaf shape, leaf strides, gradient strides): dense and contiguous, dense and permuted
# (two and three dimensions), with gaps (not dense), a size-1 dimension with an odd stride,
# a size-2 dimension with a gap; the gradient like the leaf, contiguous, or with a stride 0.
_LAYOUTS = {
    "contiguous": ((4, 4), (4, 1), (4, 1)),
    "contiguous, gradient column-major": ((4, 4), (4, 1), (1, 4)),
    "contiguous, gradient with an odd stride in a size-1 dimension": ((4, 1, 4), (4, 4, 1), (4, 7, 1)),
    "contiguous, gradient with stride 0 in a size-1 dimension": ((4, 1, 4), (4, 4, 1), (4, 0, 1)),
    "transposed": ((4, 4), (1, 4), (1, 4)),
    "transposed, gradient row-major": ((4, 4), (1, 4), (4, 1)),
    "permuted 3-d": ((3, 4, 5), (1, 15, 3), (1, 15, 3)),
    "permuted 3-d, gradient row-major": ((3, 4, 5), (1, 15, 3), (20, 5, 1)),
    "permuted 3-d, gradient permuted otherwise": ((3, 4, 5), (1, 15, 3), (4, 1, 12)),
    "with gaps, gradient row-major": ((4, 4), (8, 1), (4, 1)),
    "with gaps, gradient like the leaf": ((4, 4), (8, 1), (8, 1)),
    "size-2 dimension with a gap, gradient row-major": ((2, 4), (8, 1), (4, 1)),
    "transposed with an odd size-1 stride, gradient like the leaf": ((4, 1, 4), (1, 7, 4), (1, 7, 4)),
    "transposed with an odd size-1 stride, gradient row-major": ((4, 1, 4), (1, 7, 4), (4, 4, 1)),
}


def _steals(
    scoped: bool, layout: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], *, keep: bool = False
) -> tuple[bool, torch.Tensor]:
    shape, leaf_strides, grad_strides = layout
    torch.manual_seed(0)
    leaf = torch.empty_strided(shape, leaf_strides).normal_().requires_grad_()
    made: list[Any] = []
    x = torch.randn(shape)

    def node(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _MakeGrad.apply(leaf, grad_strides, made, keep) * x  # type: ignore[no-untyped-call]
        return out

    fn = with_fp32_precision(FULL)(node) if scoped else node
    torch.autograd.backward(fn(x).sum())
    assert leaf.grad is not None
    made_ptr = made[-1].data_ptr() if keep else made[-1]
    return leaf.grad.data_ptr() == made_ptr, leaf.grad


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_the_leaf_gets_the_engines_buffer_exactly_where_torch_steals_it_for_each_layout(layout: str) -> None:
    # torch's own AccumulateGrad is the oracle: it steals a gradient whose strides obey
    # the layout contract with the leaf (utils::obeys_layout_contract).
    bare_stole, bare_grad = _steals(scoped=False, layout=_LAYOUTS[layout])
    scoped_stole, scoped_grad = _steals(scoped=True, layout=_LAYOUTS[layout])
    torch.testing.assert_close(scoped_grad, bare_grad)
    assert scoped_grad.stride() == bare_grad.stride()
    assert scoped_stole == bare_stole


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_gradient_something_else_holds_is_copied_as_torch_copies_it(layout: str) -> None:
    # No hook on the leaf: only the reference counts tell that the gradient is shared.
    bare_stole, bare_grad = _steals(scoped=False, layout=_LAYOUTS[layout], keep=True)
    scoped_stole, scoped_grad = _steals(scoped=True, layout=_LAYOUTS[layout], keep=True)
    torch.testing.assert_close(scoped_grad, bare_grad)
    assert not bare_stole  # the control: torch copies a gradient held elsewhere
    assert not scoped_stole


def test_the_counts_measured_afresh_steal_exactly_where_torch_steals(monkeypatch: pytest.MonkeyPatch) -> None:
    # The counts an unshared gradient shows in the accumulating hook are measured once per
    # process; measured again here (in this test's process state), they must still tell
    # torch's stolen gradients from its copied ones.
    monkeypatch.setattr(_leaf_grads, "_unshared", [])
    for layout in ("contiguous", "transposed", "with gaps, gradient like the leaf"):
        for keep in (False, True):
            bare_stole, _ = _steals(scoped=False, layout=_LAYOUTS[layout], keep=keep)
            scoped_stole, _ = _steals(scoped=True, layout=_LAYOUTS[layout], keep=keep)
            assert (layout, keep, scoped_stole) == (layout, keep, bare_stole)
    assert _leaf_grads._unshared != [()]  # measured, and stealing is on with this torch
