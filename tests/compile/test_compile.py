"""torch.compile: no recompiles across process defaults, real CPU numerics, compiled parents.

These run on every supported torch. Where a release differs, the test says so: on torch 2.4
to 2.8 every Dynamo compile turns a "medium" default into "high" (see
fp32scope._flags.dynamo_exclude.dynamo_resets_medium), so the tests that measure under a "medium"
default set it again after the compiling calls, as the docs tell an engine to; and torch
2.4's Dynamo reports a disabled function by name, without the reason the library gives.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch._dynamo.utils import counters

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    current_fp32_precision,
    fp32_precision_scope,
    set_process_default,
    with_fp32_precision,
)
from fp32scope._flags import torch_flags as _flags
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL
from tests._support.compiled import Recording, forbid_recompiles, python_frames
from tests._support.probe import phases, probe

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

CYCLE = ["high", "medium", "highest"]  # "highest" must be in it: Dynamo guards cuBLAS TF32 only


class Counting:
    """A backend wrapper that counts the graphs it is asked to compile."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.graphs += 1
        from torch._dynamo.backends.registry import lookup_backend

        compiled: Callable[..., Any] = lookup_backend(self.backend)(gm, inputs)
        return compiled


def small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_wrapped_compiled_module_never_recompiles_while_the_default_cycles(backend: str) -> None:
    counting = Counting(backend)
    node = Fp32ScopedModule(torch.compile(small(), backend=counting), FULL)
    x = torch.randn(4, 16)
    with torch.no_grad(), forbid_recompiles():
        for default in itertools.islice(itertools.cycle(CYCLE), 20):
            set_process_default(Fp32Precision(default, True))  # type: ignore[arg-type]
            node(x)
            assert torch.get_float32_matmul_precision() == default
    assert counting.graphs == 1


def test_the_same_module_unwrapped_does_recompile() -> None:
    # The control that shows the test above can fail: without the proxy the cycle recompiles.
    compiled = torch.compile(small(), backend="eager")
    x = torch.randn(4, 16)
    with pytest.raises(Exception, match="allow_tf32|GLOBAL_STATE|[Rr]ecompil|limit"), forbid_recompiles():
        for default in CYCLE:
            set_process_default(Fp32Precision(default))  # type: ignore[arg-type]
            compiled(x)


def bf16_effect_visible() -> bool:
    """Whether "medium" changes float32 matmul results on this CPU (oneDNN bf16)."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 256), torch.randn(256, 256)
    with fp32_precision_scope(Fp32Precision("highest")):
        full = a @ b
    with fp32_precision_scope(Fp32Precision("medium")):
        reduced = a @ b
    return not torch.equal(full, reduced)


needs_effect = pytest.mark.skipif(
    not bf16_effect_visible(),
    reason="this CPU gives bit-identical float32 matmuls under 'medium' and 'highest' (no oneDNN bf16 path)",
)


@needs_effect
def test_numerics_a_wrapped_compiled_linear_runs_in_full_fp32_under_a_medium_default() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 512)
    x = torch.randn(64, 512)
    with torch.no_grad():
        torch.set_float32_matmul_precision("highest")
        eager_full = linear(x)
        reference = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
        set_process_default(Fp32Precision("medium", True))
        eager_medium = linear(x)
        wrapped = Fp32ScopedModule(torch.compile(linear), Fp32Precision("highest"))
        twin = torch.nn.Linear(512, 512)
        twin.load_state_dict(linear.state_dict())
        unwrapped = torch.compile(twin)
        # The compiling calls first: on torch <= 2.8 they leave "high" behind (and the
        # unwrapped one's own compiling call runs under it), so the default is set again.
        wrapped(x)
        unwrapped(x)
        set_process_default(Fp32Precision("medium", True))
        out_wrapped = wrapped(x)
        out_unwrapped = unwrapped(x)
    assert torch.get_float32_matmul_precision() == "medium"
    gap = (eager_medium - eager_full).abs().max().item()
    assert gap > 0
    # The wrapped one agrees with eager-under-"highest" far more closely than eager-under-
    # "medium" does; the unwrapped one follows the default.
    assert (out_wrapped - eager_full).abs().max().item() < gap / 100
    assert (out_unwrapped - eager_medium).abs().max().item() < gap / 100
    assert (out_wrapped.double() - reference).abs().max() < (out_unwrapped.double() - reference).abs().max()


class Child(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out


class Parent(torch.nn.Module):
    def __init__(self, child: torch.nn.Module) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(512, 512)
        self.child = child
        self.post = torch.nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.pre(x)
        b = self.child(torch.relu(a))
        return a, b, self.post(b)


def parent_with_scoped_child() -> tuple[Parent, torch.Tensor]:
    torch.manual_seed(0)
    # (typing.cast: a proxy is an nn.Module at run time, not to a type checker)
    return Parent(cast("torch.nn.Module", Fp32ScopedModule(Child(), FULL, in_graph=False))), torch.randn(64, 512)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_parent_breaks_cleanly_at_a_scoped_child(backend: str) -> None:
    parent, x = parent_with_scoped_child()
    set_process_default(Fp32Precision("high", True))
    before = _flags.read_all()
    with torch.no_grad():
        expected = parent(x)
        counting = Counting(backend)
        got = torch.compile(parent, backend=counting)(x)
        again = torch.compile(parent, backend=counting)(x)
    for e, g, a in zip(expected, got, again, strict=True):
        torch.testing.assert_close(g, e)
        torch.testing.assert_close(a, e)
    assert _flags.read_all() == before
    # The parent graph-broke at the child, which compiled as a graph of its own.
    assert counting.graphs >= 2
    breaks = " ".join(counters["graph_break"])
    assert "disable" in breaks or "Skip" in breaks


@needs_effect
def test_compiled_parent_runs_the_child_in_its_scope_and_the_rest_under_the_default() -> None:
    parent, x = parent_with_scoped_child()
    child = cast("torch.nn.Module", parent.child.__wrapped__)
    with torch.no_grad():
        torch.set_float32_matmul_precision("highest")
        a_full = parent.pre(x)
        b_full = child(torch.relu(a_full))
        torch.set_float32_matmul_precision("medium")
        a_medium = parent.pre(x)
        b_from_full_a = child(torch.relu(a_full))
        set_process_default(Fp32Precision("medium", True))
        compiled = torch.compile(parent)
        compiled(x)  # compiles; on torch <= 2.8 that leaves "high" behind: set the default again
        set_process_default(Fp32Precision("medium", True))
        with forbid_recompiles():
            a, b, _ = compiled(x)
        b_expected = Fp32ScopedModule(child, FULL, in_graph=False)(torch.relu(a))
    assert torch.get_float32_matmul_precision() == "medium"
    gap = (a_medium - a_full).abs().max().item()
    assert gap > 0
    assert (a - a_medium).abs().max().item() < gap / 100  # the parent's own part: the default
    assert torch.equal(b, b_expected)  # the child: full fp32 on what it was given
    assert (b_from_full_a - b_full).abs().max().item() > 0  # (the control can tell them apart)


def test_fullgraph_parent_with_a_scoped_child_is_refused_with_the_reason() -> None:
    parent, x = parent_with_scoped_child()
    if "reason" in inspect.signature(torch._dynamo.disable).parameters:
        reason = "fp32scope: a scoped call made with in_graph=False changes torch's process-wide float32"
    else:  # torch 2.4's Dynamo names the disabled function and gives no reason
        reason = r"wrapped function <function Fp32ScopedModule.__call__ \[fp32scope: a graph break \(in_graph=False\)"
    with pytest.raises(RuntimeError, match=reason), torch.no_grad():
        torch.compile(parent, backend="eager", fullgraph=True)(x)


def test_a_decorated_function_inside_a_compiled_function_breaks_cleanly() -> None:
    @with_fp32_precision(FULL, in_graph=False)
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x @ x

    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x + 1) - 1

    x = torch.randn(8, 8)
    torch.set_float32_matmul_precision("high")
    torch.testing.assert_close(torch.compile(outer, backend="eager")(x), outer(x))
    assert torch.get_float32_matmul_precision() == "high"


# torch 2.4 and 2.8 compile the recording hook as a frame of its own and warn that
# list.append is a graph break there (each in its own words); the hook still runs, inside
# the scope.
@pytest.mark.filterwarnings("ignore:Graph break due to unsupported builtin:UserWarning")
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin:UserWarning")
def test_compiling_the_proxy_itself_also_runs_the_module_in_its_scope() -> None:
    # The usual way is Fp32ScopedModule(torch.compile(m)); torch.compile(Fp32ScopedModule(m))
    # must not trace the scope either: the proxy's call stays eager, the module compiles inside.
    seen: list[str] = []

    class Recording(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.register_forward_pre_hook(lambda m, a: seen.append(torch.get_float32_matmul_precision()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.linear(x)
            return out

    module = Recording()
    compiled = torch.compile(Fp32ScopedModule(module, FULL), backend="eager")
    set_process_default(Fp32Precision("high", True))
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
    assert seen[0] == "highest"
    assert torch.get_float32_matmul_precision() == "high"


class _Probed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return probe(torch.relu(self.linear(x)), "node")


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("in_graph", [None, True, False])
@pytest.mark.parametrize("wrapper", ["module", "decorator"])
def test_compiling_the_wrapper_itself_compiles_what_it_wraps(in_graph: bool | None, wrapper: str) -> None:
    # Whatever in_graph says (it is about a compiled parent), torch.compile(wrapper) compiles
    # the wrapped callable as a graph of its own, inside the scope: no Python forward frame
    # once compiled, and the probe in the compiled graph reads the node's precision.
    set_process_default(DEFAULT)
    module = _Probed()
    if wrapper == "module":
        scoped: Callable[..., Any] = cast("Callable[..., Any]", Fp32ScopedModule(module, FULL, in_graph=in_graph))
    else:
        scoped = with_fp32_precision(FULL, in_graph=in_graph)(module.forward)
    compiled = torch.compile(scoped, backend="aot_eager")
    x = torch.randn(2, 8)
    with torch.no_grad():
        compiled(x)
        _probe.SEEN.clear()
        with python_frames(_Probed.forward.__code__) as frames:
            torch.testing.assert_close(compiled(x), module(x))
    assert frames == [1]  # the bare module's own call; none from the compiled one
    assert phases("fwd")["node"] == [FULL, DEFAULT]
    assert current_fp32_precision() == DEFAULT


def test_regional_compilation_compiles_each_block_in_its_precision_with_no_graph_break() -> None:
    # The compiled guide's recipe: each block compiled on its own, the scoped one inside its
    # proxy, the stack itself eager. No graph breaks, and each block's forward and backward
    # graphs compiled under its own precision: the scoped block's in its scope. The blocks
    # share their code, whose cache gets one entry per cuBLAS TF32 setting (Dynamo guards
    # it); on releases that inline nn modules the unscoped blocks share one entry.
    torch.manual_seed(0)
    recording = Recording()

    def block() -> torch.nn.Module:
        compiled = torch.compile(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), backend=recording.backend()
        )
        return cast("torch.nn.Module", compiled)

    blocks = [block(), cast("torch.nn.Module", Fp32ScopedModule(block(), FULL, in_graph=False)), block()]
    stack = torch.nn.Sequential(*blocks)
    set_process_default(DEFAULT)
    x = torch.randn(4, 8, requires_grad=True)
    stack(x).square().sum().backward()
    with forbid_recompiles():
        stack(x).square().sum().backward()
    assert sum(counters["graph_break"].values()) == 0
    for compiled in (recording.forward, recording.backward):
        assert compiled.count("highest") == 1, compiled  # the scoped block, in its scope, once
        assert set(compiled) == {"high", "highest"}, compiled
    assert recording.forward[:2] == ["high", "highest"]  # call order: block 0, then the scoped block 1
    assert torch.get_float32_matmul_precision() == DEFAULT.matmul


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_region_decorator_around_a_graph_break_wrapper_stays_a_region() -> None:
    # The outer wrapper copies the inner one's attributes (functools.update_wrapper), not its
    # Dynamo mark: the compiled caller traces the outer region, no graph break.
    inner = with_fp32_precision(FULL, in_graph=False)(torch.nn.functional.relu)
    outer = with_fp32_precision(FULL)(inner)

    def caller(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = outer(x + 1) * 2
        return out

    x = torch.randn(4)
    torch.testing.assert_close(torch.compile(caller, backend="aot_eager", fullgraph=True)(x), caller(x))
