"""torch.compile on every supported release: what older Dynamo versions do differently.

Each test runs on every release (2.4.1 to 2.14.1); where a release behaves differently the
test says which and checks that behaviour too. The defects these tests pin (issue 7):

1. torch 2.4: a compiled parent recompiled at every call when a child was a scoped proxy
   (a guard read ``training`` from the proxy's own instance dict);
2. torch 2.4 and 2.8: a scope in a ``fullgraph=True`` region failed without the library's
   message;
3. torch <= 2.8: a compile inside a "medium" scope was blamed on the wrapped code, and a
   scope that leaves the matmul field alone let Dynamo's "medium" -> "high" escape (its
   tests are in ``tests/flags/test_legacy_dynamo.py``, which the mutation run selects);
4. torch 2.4: a compiled parent broke on the proxy's ``__wrapped__`` (or, for a torch.nn
   child, traced the child into its own graph, outside the scope).

Also found here: on torch 2.10 a compiled parent crashed at a proxy around a compiled child
(``bool()`` of a compiled module raises there).
"""

from __future__ import annotations

import inspect
import itertools
import sys
import warnings
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from fp32scope import (
    Fp32EagerFallbackWarning,
    Fp32Precision,
    Fp32ScopedModule,
    _compat,
    fp32_precision_scope,
    set_process_default,
    with_fp32_precision,
)
from fp32scope._flags import eager_fallback as _eager_fallback
from fp32scope._flags import torch_flags as _flags
from fp32scope._flags.dynamo_exclude import _REASON
from tests._support.common import COMPILING_MESSAGE, FULL
from tests._support.compiled import forbid_recompiles

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

# (major, minor) of the torch under test: "2.4.1+cu121" -> (2, 4).


# -- a probe that reads the flags when it runs, also inside compiled graphs --------------

SEEN: list[str] = []


def _record_precision(x: torch.Tensor) -> torch.Tensor:
    """Record the matmul precision current when the op runs (custom ops are opaque to Dynamo)."""
    SEEN.append(torch.get_float32_matmul_precision())
    return x.clone()


# torch 2.4 infers the schema from real annotations only (this module's are strings).
_record_precision.__annotations__ = {"x": torch.Tensor, "return": torch.Tensor}
precision_probe = torch.library.custom_op("fp32scope_tests::precision_probe", mutates_args=())(_record_precision)


@precision_probe.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


PROBE_OP = torch.ops.fp32scope_tests.precision_probe.default


class Graphs:
    """A backend that keeps the graphs it is asked to compile and runs them as they are."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        self.graphs.append(gm)
        return gm.forward

    def with_probe(self) -> list[torch.fx.GraphModule]:
        """The graphs that contain the probe op (the child's own graphs)."""
        return [gm for gm in self.graphs if any(node.target in (precision_probe, PROBE_OP) for node in gm.graph.nodes)]


class ProbedChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(precision_probe(x))
        return out


class TorchNnChild(ProbedChild):
    # Dynamo treats a module whose class lives under torch.nn as one of torch's own and,
    # on torch 2.4, put it into the parent's graph as a call_module: the proxy's scope was
    # bypassed. Claiming that module path reproduces it for a child with a probe in it.
    __module__ = "torch.nn.modules.linear"


class Parent(torch.nn.Module):
    def __init__(self, child: torch.nn.Module) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(8, 8)
        self.child = child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.child(self.pre(x))) + 1
        return out


CHILDREN: dict[str, Callable[[], Any]] = {
    "user-child": ProbedChild,
    "torch.nn-child": TorchNnChild,
    # The usual engine node: a compiled module, wrapped, used inside a compiled parent.
    "compiled-child": lambda: torch.compile(ProbedChild(), backend="eager"),
}


def scoped_parent(kind: str) -> Parent:
    torch.manual_seed(0)
    return Parent(cast("torch.nn.Module", Fp32ScopedModule(CHILDREN[kind](), FULL, in_graph=False)))


# -- defect 1: no recompile per call -------------------------------------------------------


@pytest.mark.parametrize("kind", list(CHILDREN))
def test_a_compiled_parent_with_a_scoped_child_compiles_once(kind: str) -> None:
    # torch 2.4 failed here: "KeyError on L['self'].child.training" at every call.
    parent = scoped_parent(kind)
    backend = Graphs()
    compiled = torch.compile(parent, backend=backend)
    x = torch.randn(4, 8)
    set_process_default(Fp32Precision("high", True))
    with torch.no_grad(), forbid_recompiles():
        for _ in range(4):
            compiled(x)
    first = len(backend.graphs)
    with torch.no_grad(), forbid_recompiles():
        compiled(x)
    assert len(backend.graphs) == first


# -- defect 4: the child runs in its scope, as a graph of its own, on every release ---------


@pytest.mark.parametrize("kind", list(CHILDREN))
def test_the_child_of_a_compiled_parent_runs_in_its_scope_on_every_release(kind: str) -> None:
    parent = scoped_parent(kind)
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = parent(x)
        backend = Graphs()
        compiled = torch.compile(parent, backend=backend)
        set_process_default(Fp32Precision("high", True))
        SEEN.clear()
        got = compiled(x)
    torch.testing.assert_close(got, expected)
    # The probe ran inside the child's scope; torch 2.4 ran a torch.nn child inside the
    # parent's graph instead, under the default.
    assert SEEN == ["highest"]
    assert torch.get_float32_matmul_precision() == "high"
    # The parent's graphs never contain the child; the break is at the library's mark.
    assert not any("child" in str(node.target) for gm in backend.graphs for node in gm.graph.nodes)
    breaks = " ".join(counters["graph_break"])
    assert "disable" in breaks, breaks
    # (The library's own reason names ``scoped.__wrapped__`` for torch.export users.)
    assert "__wrapped__" not in breaks.replace(_REASON, ""), breaks


def test_the_child_compiles_once_in_its_scope_while_the_default_changes() -> None:
    parent = scoped_parent("user-child")
    backend = Graphs()
    compiled = torch.compile(parent, backend=backend)
    x = torch.randn(4, 8)
    # Defaults that keep the cuBLAS TF32 flag (all TF32 "on"): Dynamo's guard on it would
    # recompile the parent's own graphs, and rightly so. The child never sees the default.
    cycle = [Fp32Precision("high", True), Fp32Precision("medium", False), Fp32Precision("high", False)]
    set_process_default(cycle[0])
    with torch.no_grad():
        compiled(x)  # the first call compiles
        SEEN.clear()
        with forbid_recompiles():
            for default in itertools.islice(itertools.cycle(cycle), 9):
                set_process_default(default)
                compiled(x)
                assert torch.get_float32_matmul_precision() == default.matmul
        # A default that changes the cuBLAS flag recompiles the parent's parts, not the child.
        for default in (Fp32Precision("highest", True), Fp32Precision("high", True)):
            set_process_default(default)
            compiled(x)
    assert SEEN == ["highest"] * 11
    # The child is a graph of its own (the probe and its linear), compiled once, in its scope.
    child_graphs = backend.with_probe()
    assert len(child_graphs) == 1
    targets = [node.target for node in child_graphs[0].graph.nodes if node.op in ("call_function", "call_module")]
    assert len(targets) == 2, targets  # the probe and the child's linear, nothing of the parent


def test_the_proxys_call_impl_is_its_scoped_call() -> None:
    # torch 2.4's Dynamo calls a module through type(module)._call_impl; on the proxy that
    # is the scoped call (a proxy call is always scoped), eagerly too.
    proxy = Fp32ScopedModule(ProbedChild(), FULL, in_graph=False)
    torch.set_float32_matmul_precision("high")
    SEEN.clear()
    with torch.no_grad():
        proxy._call_impl(torch.randn(2, 8))
    assert SEEN == ["highest"]
    assert torch.get_float32_matmul_precision() == "high"


def test_the_truth_of_a_proxy_is_its_modules_and_never_raises() -> None:
    # torch 2.10: bool(torch.compile(module)) raises TypeError (OptimizedModule.__len__), and
    # Dynamo 2.10 takes bool() of what it calls: the compiled-child case above crashed.
    assert bool(Fp32ScopedModule(torch.compile(torch.nn.Linear(2, 2), backend="eager"), FULL)) is True
    assert bool(Fp32ScopedModule(torch.nn.Linear(2, 2), FULL)) is True
    assert bool(Fp32ScopedModule(torch.nn.Sequential(), FULL)) is False  # a module with a length: len() == 0
    assert bool(Fp32ScopedModule(torch.compile(torch.nn.Sequential(torch.nn.ReLU()), backend="eager"), FULL)) is True


# -- defect 2: the library's message under fullgraph=True ----------------------------------


def scope_made_inside(x: torch.Tensor) -> tuple[torch.Tensor, str]:
    with fp32_precision_scope(FULL):
        return x @ x, torch.get_float32_matmul_precision()


OUTSIDE = fp32_precision_scope(FULL)


def scope_made_outside(x: torch.Tensor) -> tuple[torch.Tensor, str]:
    with OUTSIDE:
        return x @ x, torch.get_float32_matmul_precision()


def test_a_scope_made_in_a_fullgraph_region_fails_with_the_library_message() -> None:
    # torch 2.4 said "BEFORE_WITH UserDefinedObjectVariable(fp32_precision_scope)" and 2.8
    # "Observed exception ... UserDefinedExceptionObjectVariable(Fp32ScopeError)".
    torch.set_float32_matmul_precision("high")
    raw = _flags.save_raw_state()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(scope_made_inside, backend="eager", fullgraph=True)(torch.randn(2, 2))
    assert COMPILING_MESSAGE in str(info.value)
    assert "with_fp32_precision(precision)(torch.compile(fn))" in str(info.value)
    assert _flags.save_raw_state() == raw


def test_a_scope_made_in_a_compiled_region_still_works_eagerly() -> None:
    torch.set_float32_matmul_precision("high")
    _eager_fallback._warned.clear()
    with pytest.warns(Fp32EagerFallbackWarning, match=r"in scope_made_inside\(\), is inside code"):
        out, seen = torch.compile(scope_made_inside, backend="eager")(torch.eye(2))
    assert seen == "highest"
    torch.testing.assert_close(out, torch.eye(2))
    assert torch.get_float32_matmul_precision() == "high"


def test_a_scope_made_outside_and_entered_in_a_fullgraph_region() -> None:
    torch.set_float32_matmul_precision("high")
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(scope_made_outside, backend="eager", fullgraph=True)(torch.randn(2, 2))
    if _compat.DYNAMO_ENTERS_SCOPES_MADE_OUTSIDE:
        # Dynamo enters the scope and so reaches its refusal.
        assert COMPILING_MESSAGE in str(info.value)
    else:
        # Older Dynamo cannot enter a context manager made outside the traced region and
        # says so before any of the library's code runs, naming the opcode of `with` (Python
        # 3.11 made SETUP_WITH into BEFORE_WITH).
        with_opcode = "BEFORE_WITH" if sys.version_info >= (3, 11) else "SETUP_WITH"
        assert with_opcode in str(info.value) or "context manager" in str(info.value)
    _eager_fallback._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", Fp32EagerFallbackWarning)
        out, seen = torch.compile(scope_made_outside, backend="eager")(torch.eye(2))
    # Only a Dynamo that enters the scope reaches the refusal, and so the warning.
    assert any(w.category is Fp32EagerFallbackWarning for w in caught) is _compat.DYNAMO_ENTERS_SCOPES_MADE_OUTSIDE
    torch.testing.assert_close(out, torch.eye(2))
    assert seen == "highest"
    assert torch.get_float32_matmul_precision() == "high"


def test_a_wrapper_in_a_fullgraph_region_names_itself() -> None:
    @with_fp32_precision(FULL, in_graph=False)
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def outer(x: torch.Tensor) -> torch.Tensor:
        return inner(x) + 1

    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(outer, backend="eager", fullgraph=True)(torch.randn(2))
    if "reason" in inspect.signature(torch._dynamo.disable).parameters:
        assert "fp32scope: a scoped call made with in_graph=False changes torch's process-wide float32" in str(
            info.value
        )
    else:
        # torch 2.4's Dynamo reports a disabled function by its name only, without a reason.
        assert "disable() wrapped function <function test_a_wrapper_in_a_fullgraph_region_names_itself" in str(
            info.value
        )
