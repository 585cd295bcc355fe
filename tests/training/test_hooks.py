"""Hooks inside and around a scoped node's backward fire as they do without fp32scope.

Each test trains the same little model twice, the node bare and the node wrapped, records
every hook call torch makes on the node's parameters (tensor hooks with the gradient they
get, post-accumulate-grad hooks with the ``.grad`` they see, AccumulateGrad node hooks with
``.grad`` at that moment) and a reader inside the node's subgraph that looks at ``.grad``
right after the parameters' gradients are computed (as FSDP's post-backward does), and
compares the two logs: same calls, in the same order for each parameter, with the same
values. (The order in which two parameters' hooks interleave is the engine's, not a contract.)

A subgraph of torch's own nodes hands its leaves' gradients back to the caller's engine,
which accumulates them; one with a Python node in it (the reader, FSDP's post-backward, a
custom Function) has them accumulated inside the nested engine. Both are run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch

from fp32scope import Fp32ScopedModule, set_process_default, with_fp32_precision
from fp32scope._training import leaf_grads as _leaf_grads
from tests._support.common import FULL, PythonIdentity

# The same numerics on both sides: the comparison is about hooks, not precision.
SAME = FULL

Log = list[tuple[Any, ...]]


@pytest.fixture(autouse=True)
def _default() -> None:
    set_process_default(SAME)


def _value(t: torch.Tensor | None) -> Any:
    return None if t is None else t.detach().clone()


class _ReadGradAfter(torch.autograd.Function):
    """Identity; its backward reads the parameters' .grad (FSDP's post-backward does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: Log, params: list[torch.nn.Parameter]) -> torch.Tensor:
        ctx.log = log
        ctx.params = params
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.log.append(("reader", [_value(p.grad) for p in ctx.params]))
        return grad, None, None


class Block(torch.nn.Module):
    def __init__(self, log: Log, *, reader: bool = True) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.log = log
        self.reader = reader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The reader sits on the block's input: its backward runs after the linear's
        # parameters got their gradients (AccumulateGrad runs first in torch's engine).
        if self.reader:
            x = _ReadGradAfter.apply(x, self.log, list(self.linear.parameters()))  # type: ignore[no-untyped-call]
        return torch.tanh(self.linear(x))


def _instrument(block: Block, log: Log, *, modifying: bool) -> list[Any]:
    handles = []
    for name, p in block.linear.named_parameters():

        def tensor_hook(g: torch.Tensor, name: str = name) -> torch.Tensor | None:
            log.append(("tensor", name, _value(g)))
            return g * 2 if modifying else None

        def post_acc(t: torch.Tensor, name: str = name) -> None:
            log.append(("post-acc", name, _value(t.grad)))

        handles.append(p.register_hook(tensor_hook))  # type: ignore[no-untyped-call]
        handles.append(p.register_post_accumulate_grad_hook(post_acc))  # type: ignore[no-untyped-call]
        view = p.view_as(p).grad_fn
        assert view is not None
        acc = view.next_functions[0][0]
        assert acc is not None

        def node_hook(*_: Any, name: str = name, p: torch.Tensor = p) -> None:
            log.append(("acc-node", name, _value(p.grad)))

        handles.append(acc.register_hook(node_hook))
    return handles


def _run(
    wrap: Callable[[Block], Callable[[torch.Tensor], torch.Tensor]], how: str, *, modifying: bool, reader: bool = True
) -> Log:
    torch.manual_seed(0)
    log: Log = []
    block = Block(log, reader=reader)
    pre = torch.nn.Linear(8, 8)
    handles = _instrument(block, log, modifying=modifying)
    node = wrap(block)
    x = torch.randn(4, 8, requires_grad=True)
    for step in range(2):  # a second step: accumulation onto an existing .grad
        log.append(("step", step))
        loss = node(pre(x)).pow(2).sum()
        if how == "backward":
            torch.autograd.backward(loss)
            log.append(("grads", [_value(p.grad) for p in (*block.parameters(), *pre.parameters(), x)]))
        elif how == "grad":
            grads = torch.autograd.grad(loss, [*block.linear.parameters(), x])
            log.append(("grads", [_value(g) for g in grads]))
        elif how == "grad-create-graph":  # the gradient computation recorded too
            grads = torch.autograd.grad(loss, [*block.linear.parameters(), x], create_graph=True)
            log.append(("grads", [_value(g) for g in grads]))
        elif how == "grad-input-only":
            (gx,) = torch.autograd.grad(loss, [x])
            log.append(("grads", [_value(gx), *(_value(p.grad) for p in block.parameters())]))
        elif how == "backward-inputs":
            torch.autograd.backward(loss, inputs=[block.linear.weight, x])
            log.append(("grads", [_value(p.grad) for p in (*block.parameters(), *pre.parameters(), x)]))
    for h in handles:
        h.remove()
    return log


def _per_subject(log: Log) -> dict[Any, Log]:
    # Per parameter, per step: the order of its own hooks is torch's contract; how the hooks
    # of two parameters interleave is not (the engine's order among ready nodes).
    split: dict[Any, Log] = {}
    step = None
    for event in log:
        if event[0] == "step":
            step = event[1]
            continue
        subject = event[1] if event[0] in {"tensor", "post-acc", "acc-node"} else event[0]
        split.setdefault((step, subject), []).append(event)
    return split


def _assert_same(got: Log, expected: Log) -> None:
    g, e = _per_subject(got), _per_subject(expected)
    assert {k: [x[0] for x in v] for k, v in g.items()} == {k: [x[0] for x in v] for k, v in e.items()}
    for key, events in e.items():
        for mine, theirs in zip(g[key], events, strict=True):
            torch.testing.assert_close(mine[-1], theirs[-1], msg=f"{key}: {mine[0]} differs")


WRAPS: dict[str, Callable[[Block], Callable[[torch.Tensor], torch.Tensor]]] = {
    "proxy": lambda b: Fp32ScopedModule(b, FULL),
    "decorated": lambda b: with_fp32_precision(FULL)(b.forward),
    # A scoped node inside another: the inner boundary runs inside the outer one's backward.
    "nested": lambda b: Fp32ScopedModule(torch.nn.Sequential(cast("torch.nn.Module", Fp32ScopedModule(b, FULL))), FULL),
}


@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("how", ["backward", "grad", "grad-create-graph", "grad-input-only", "backward-inputs"])
@pytest.mark.parametrize("modifying", [False, True], ids=["observing", "modifying"])
@pytest.mark.parametrize("reader", [True, False], ids=["python-node-inside", "torch-nodes-only"])
def test_every_hook_fires_once_with_what_it_sees_unwrapped(wrap: str, how: str, modifying: bool, reader: bool) -> None:
    expected = _run(lambda b: b, how, modifying=modifying, reader=reader)
    got = _run(WRAPS[wrap], how, modifying=modifying, reader=reader)
    _assert_same(got, expected)


@pytest.mark.parametrize("wrap", ["proxy", "nested"])
def test_every_hook_fires_once_after_the_engine_is_probed_again(wrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Whether the caller's engine fires post-accumulate-grad hooks for a None gradient is
    # found out once per process, inside the first scoped backward; found out again here.
    monkeypatch.setattr(_leaf_grads, "_outer_fires_post_hooks", [])
    expected = _run(lambda b: b, "backward", modifying=False)
    got = _run(WRAPS[wrap], "backward", modifying=False)
    _assert_same(got, expected)
    assert len(_leaf_grads._outer_fires_post_hooks) == 1


def test_a_reader_inside_the_node_sees_the_gradients_accumulated() -> None:
    # The failure of issue 11 in one process: FSDP's post-backward read .grad as None.
    log = _run(WRAPS["proxy"], "backward", modifying=False)
    readers = [e for e in log if e[0] == "reader"]
    assert len(readers) == 2
    assert all(g is not None for g in readers[0][1])


@pytest.mark.parametrize("python_node", [False, True], ids=["torch-nodes-only", "python-node-inside"])
def test_post_accumulate_grad_hook_fires_once_per_step_with_grad_set(python_node: bool) -> None:
    # With a Python node inside and no tensor hook on the weight, the nested engine hands
    # the weight its gradient buffer itself: the hook still fires once, in the caller's engine.
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    seen: list[torch.Tensor | None] = []
    linear.weight.register_post_accumulate_grad_hook(lambda t: seen.append(_value(t.grad)))  # type: ignore[no-untyped-call]

    def forward(h: torch.Tensor) -> torch.Tensor:
        if python_node:
            h = PythonIdentity.apply(h)  # type: ignore[no-untyped-call]
        out: torch.Tensor = linear(h)
        return out

    node = with_fp32_precision(FULL)(forward)
    x = torch.randn(4, 8, requires_grad=True)
    for step in range(3):
        torch.autograd.backward(node(x * 2).sum())
        assert len(seen) == step + 1
        assert seen[-1] is not None
        torch.testing.assert_close(seen[-1], linear.weight.grad)
        linear.weight.grad = None


@pytest.mark.parametrize("python_node", [False, True], ids=["torch-nodes-only", "python-node-inside"])
def test_a_tied_parameter_gets_both_parts_and_its_accumulation_hooks_fire_once(python_node: bool) -> None:
    # Used inside the scoped node and before it: the gradient is the sum of both uses;
    # post-accumulate-grad hooks fire once with that sum in .grad. Tensor hooks see the sum
    # once, as unwrapped, where the node's subgraph hands its gradients back (torch's nodes
    # only); each part where the nested engine accumulates (a Python node inside).
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 8))
    tokens = torch.randn(4, 8)
    tensor_calls: list[torch.Tensor] = []
    post: list[torch.Tensor | None] = []
    weight.register_hook(lambda g: tensor_calls.append(g.detach().clone()))  # type: ignore[no-untyped-call]
    weight.register_post_accumulate_grad_hook(lambda t: post.append(_value(t.grad)))  # type: ignore[no-untyped-call]

    def head(h: torch.Tensor) -> torch.Tensor:
        if python_node:
            h = PythonIdentity.apply(h)  # type: ignore[no-untyped-call]
        return h @ weight.t()

    def loss_of(node: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return node(torch.tanh(tokens @ weight)).pow(2).sum()

    torch.autograd.backward(loss_of(head))
    expected = weight.grad
    assert expected is not None
    assert len(tensor_calls) == 1
    weight.grad = None
    tensor_calls.clear()
    post.clear()
    torch.autograd.backward(loss_of(with_fp32_precision(FULL)(head)))
    torch.testing.assert_close(weight.grad, expected)
    if not python_node or _leaf_grads.outer_fires_post_accumulate_hooks():
        assert len(post) == 1
        torch.testing.assert_close(post[0], expected)
    else:  # torch 2.4: they fire as each part is accumulated (see the training guide's limits)
        assert len(post) == 2
        torch.testing.assert_close(post[1], expected)
    if python_node:
        assert len(tensor_calls) == 2  # the part inside the node, then the part before it
        torch.testing.assert_close(tensor_calls[0] + tensor_calls[1], expected)
    else:
        assert len(tensor_calls) == 1  # the sum, as unwrapped
        torch.testing.assert_close(tensor_calls[0], expected)


def test_a_hook_removed_after_a_scoped_backward_stays_removed() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    calls: list[int] = []
    handle = linear.weight.register_hook(lambda g: calls.append(1))  # type: ignore[no-untyped-call]
    node = Fp32ScopedModule(linear, FULL)
    x = torch.randn(4, 8, requires_grad=True)
    torch.autograd.backward(node(x * 2).sum())
    assert calls == [1]
    handle.remove()
    torch.autograd.backward(node(x * 2).sum())
    assert calls == [1]


@pytest.mark.parametrize("create_graph", [False, True], ids=["backward", "create-graph"])
def test_a_hook_the_node_puts_on_its_argument_fires_once(create_graph: bool) -> None:
    # Inside a scoped node the argument is the node's own alias of the caller's tensor; a
    # tensor hook the node registers there still sees the argument's gradient, once.
    def run(wrap: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        linear = torch.nn.Linear(8, 8)
        seen: list[torch.Tensor] = []

        def node(h: torch.Tensor) -> torch.Tensor:
            h.register_hook(lambda g: seen.append(g.detach().clone()))  # type: ignore[no-untyped-call]
            # A Python autograd node inside, as the other tests here have: the leaves are then
            # accumulated inside the nested engine (fp32scope._training.leaf_grads).
            h = _ReadGradAfter.apply(h, [], list(linear.parameters()))  # type: ignore[no-untyped-call]
            return torch.tanh(linear(h))

        x = torch.randn(4, 8, requires_grad=True)
        fn = with_fp32_precision(SAME)(node) if wrap else node
        loss = fn(x * 2).pow(2).sum()
        torch.autograd.grad(loss, [x, *linear.parameters()], create_graph=create_graph)
        return seen

    expected = run(wrap=False)
    got = run(wrap=True)
    assert len(expected) == 1
    assert len(got) == 1
    torch.testing.assert_close(got[0], expected[0])


def test_hooks_registered_before_and_after_a_scoped_backward_all_fire() -> None:
    # The scoped backward adds (and removes) a temporary hook under a key from torch's own
    # handle counter: a hook registered afterwards must get a key of its own, not an old one.
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    calls: list[str] = []
    linear.weight.register_hook(lambda g: calls.append("before"))  # type: ignore[no-untyped-call]
    log: Log = []
    block = Block(log)
    block.linear = linear
    node = Fp32ScopedModule(block, SAME)
    x = torch.randn(4, 8, requires_grad=True)
    torch.autograd.backward(node(x * 2).sum())
    assert calls == ["before"]
    linear.weight.register_hook(lambda g: calls.append("after"))  # type: ignore[no-untyped-call]
    calls.clear()
    torch.autograd.backward(node(x * 2).sum())
    assert sorted(calls) == ["after", "before"]
