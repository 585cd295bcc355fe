"""Compiled where its user compiles: a scoped node runs compiled, in its precision, whatever its class.

The table of issue 12, through a recording backend (``aot_autograd`` whose forward and
backward compilers note the matmul precision current while each graph compiles): a parent
``a: Linear -> child -> b: Linear`` compiled as a whole, and a wrapper handed to
``torch.compile`` itself, for a user-defined child, ``nn.Linear``, ``nn.Sequential``,
``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and a decorated function, in
no_grad and grad mode. Each case also checks that repeated calls never recompile, that
Dynamo failed no frame (``counters["frames"]``: total == ok), and that no graph-break
reason points into the package except the wrappers' own, deliberate one. Runs on every
tested release (2.4.1 to 2.14.1).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
import torch._dynamo

from fp32scope import (
    Fp32EagerFallbackWarning,
    Fp32ScopedModule,
    _compat,
    fp32_precision_scope,
    set_process_default,
    with_fp32_precision,
)
from fp32scope._flags import eager_fallback as _eager_fallback
from fp32scope._wrappers import trampoline as _trampoline
from tests._support.common import DEFAULT, FULL
from tests._support.compiled import (
    WIDTH,
    Recording,
    check_dynamo_never_failed_in_the_package,
    run,
)

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]


class UserChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(self.linear(x))
        return out


def _function() -> Callable[[torch.Tensor], torch.Tensor]:
    weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH)

    def project(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight).relu()

    project.weight = weight  # type: ignore[attr-defined]  # keeps the parameter reachable
    return project


CHILDREN: dict[str, Callable[[], Any]] = {
    "user-module": UserChild,
    "nn.Linear": lambda: torch.nn.Linear(WIDTH, WIDTH),
    "nn.Sequential": lambda: torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()),
    "nn.MultiheadAttention": lambda: torch.nn.MultiheadAttention(WIDTH, 2, batch_first=True),
    "nn.TransformerEncoderLayer": lambda: torch.nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True),
    "function": _function,
}
THE_TABLE = ["user-module", "nn.Linear", "nn.Sequential"]
MORE = ["nn.MultiheadAttention", "nn.TransformerEncoderLayer", "function"]


def scoped(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The child of ``kind``, wrapped with FULL, called with one tensor."""
    torch.manual_seed(0)
    child = CHILDREN[kind]()
    if kind == "function":
        return cast("Callable[[torch.Tensor], torch.Tensor]", with_fp32_precision(FULL, in_graph=False)(child))
    node = Fp32ScopedModule(child, FULL, in_graph=False)
    if kind == "nn.MultiheadAttention":
        return lambda x: node(x, x, x, need_weights=False)[0]
    return cast("Callable[[torch.Tensor], torch.Tensor]", node)


class Parent(torch.nn.Module):
    def __init__(self, child: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a = torch.nn.Linear(WIDTH, WIDTH)
        self.child = child
        self.b = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.child(self.a(x)))
        return out


# The table's columns in both modes; the other children in grad mode (forward and backward).
PARENT_CASES = [(kind, grad) for kind in THE_TABLE for grad in (False, True)] + [(kind, True) for kind in MORE]


@pytest.mark.parametrize(
    ("kind", "grad"), PARENT_CASES, ids=[f"{k}-{'grad' if g else 'no_grad'}" for k, g in PARENT_CASES]
)
def test_compiling_the_parent_compiles_the_child_in_its_precision(kind: str, grad: bool) -> None:
    set_process_default(DEFAULT)
    parent = Parent(scoped(kind))
    recording = Recording()
    run(torch.compile(parent, backend=recording.backend()), parent, grad=grad)
    # a, the child, b: three graphs; only the child's compiled under the node's precision.
    assert sorted(recording.forward) == ["high", "high", "highest"], recording.forward
    assert recording.forward[1] == "highest"
    assert sorted(recording.backward) == (["high", "high", "highest"] if grad else [])
    check_dynamo_never_failed_in_the_package()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("kind", [*THE_TABLE, "function"])
def test_compiling_the_wrapper_compiles_what_it_wraps(kind: str, grad: bool) -> None:
    set_process_default(DEFAULT)
    node = scoped(kind)
    recording = Recording()
    run(torch.compile(node, backend=recording.backend()), node, grad=grad)
    assert recording.forward == ["highest"]
    assert recording.backward == (["highest"] if grad else [])
    check_dynamo_never_failed_in_the_package()


def test_the_control_unwrapped_children_are_compiled_into_the_parents_graph() -> None:
    # The recording can tell: without the wrapper, one graph under the default.
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    parent = Parent(torch.nn.Linear(WIDTH, WIDTH))
    recording = Recording()
    run(torch.compile(parent, backend=recording.backend()), parent, grad=False)
    assert recording.forward == ["high"]


def test_more_scoped_nodes_than_dynamos_cache_limit_are_all_compiled() -> None:
    # Each wrapper's trampoline has a code object of its own: with one shared code object
    # the ninth node on would hit Dynamo's cache size limit (8) and run eagerly, silently.
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    nodes = [Fp32ScopedModule(torch.nn.Linear(WIDTH, WIDTH), FULL, in_graph=False) for _ in range(12)]
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), *cast("list[torch.nn.Module]", nodes))
    recording = Recording()
    run(torch.compile(model, backend=recording.backend()), model, grad=False)
    assert recording.forward.count("highest") == 12, recording.forward
    check_dynamo_never_failed_in_the_package()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_an_already_compiled_child_is_not_compiled_twice(grad: bool) -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    inner, outer = Recording(), Recording()
    child = torch.compile(torch.nn.Linear(WIDTH, WIDTH), backend=inner.backend())
    parent = Parent(cast("Callable[[torch.Tensor], torch.Tensor]", Fp32ScopedModule(child, FULL, in_graph=False)))
    run(torch.compile(parent, backend=outer.backend()), parent, grad=grad)
    assert inner.forward == ["highest"]  # its own compile, in the scope (the eager run above too)
    assert inner.backward == (["highest"] if grad else [])
    assert outer.forward == ["high", "high"]  # a and b only
    assert sorted(outer.backward) == (["high", "high"] if grad else [])
    check_dynamo_never_failed_in_the_package()


def test_a_child_compiled_in_place_is_not_compiled_twice() -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    inner, outer = Recording(), Recording()
    # (A user-defined module: module.compile() of a torch.nn built-in compiles nothing, as
    # Dynamo starts no frame in torch's files, with or without fp32scope.)
    child = UserChild()
    node = Fp32ScopedModule(child, FULL, in_graph=False)
    child.compile(backend=inner.backend())  # after wrapping: found at call time
    parent = Parent(cast("Callable[[torch.Tensor], torch.Tensor]", node))
    run(torch.compile(parent, backend=outer.backend()), parent, grad=False)
    assert inner.forward == ["highest"]
    assert outer.forward == ["high", "high"]
    check_dynamo_never_failed_in_the_package()


def test_children_called_in_a_loop_of_the_parent_are_still_compiled() -> None:
    # A graph break inside a loop may make Dynamo run the looping frame eagerly; the
    # children are compiled all the same, each in its precision.
    set_process_default(DEFAULT)
    torch.manual_seed(0)

    class Looping(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nodes = torch.nn.ModuleList(
                cast(
                    "list[torch.nn.Module]",
                    [Fp32ScopedModule(torch.nn.Linear(WIDTH, WIDTH), FULL, in_graph=False) for _ in range(3)],
                )
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for node in self.nodes:
                x = torch.tanh(node(x))
            return x

    model = Looping()
    recording = Recording()
    run(torch.compile(model, backend=recording.backend()), model, grad=False)
    assert recording.forward.count("highest") == 3, recording.forward


def test_an_inductor_compiled_parent_compiles_a_torch_nn_child_in_its_precision() -> None:
    set_process_default(DEFAULT)
    from torch._inductor.compile_fx import compile_fx

    seen: list[str] = []

    def recording_inductor(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        seen.append(torch.get_float32_matmul_precision())
        return compile_fx(gm, inputs)

    parent = Parent(scoped("nn.Linear"))
    run(torch.compile(parent, backend=recording_inductor), parent, grad=False, calls=2)
    assert seen == ["high", "highest", "high"]


def _trampoline_frames() -> list[str]:
    frame = sys._getframe(1)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back  # type: ignore[assignment]
    return [name for name in names if name.startswith("fp32scope_compiled_call")]


def test_eager_calls_never_go_through_a_trampoline() -> None:
    seen: list[list[str]] = []

    class Spy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(_trampoline_frames())
            return x

    node = Fp32ScopedModule(Spy(), FULL, in_graph=False)
    assert _trampoline.active_callback() in (None, False)
    node(torch.ones(1))
    with torch.no_grad():
        node(torch.ones(1))
    with_fp32_precision(FULL, in_graph=False)(Spy())(torch.ones(1))
    assert seen == [[], [], []]


def test_a_compiled_caller_reaches_the_node_through_its_own_trampoline() -> None:
    # The control for the test above: under a compiled caller the spy's forward (a graph
    # break: torch.compiler.disable) runs from inside the node's trampoline frame.
    seen: list[list[str]] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(_trampoline_frames())
        return x

    spy = torch.compiler.disable(spy)  # type: ignore[no-untyped-call]

    class Spy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = spy(x)
            return out

    first, second = Fp32ScopedModule(Spy(), FULL, in_graph=False), Fp32ScopedModule(Spy(), FULL, in_graph=False)

    def caller(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = second(first(x + 1))
        return out

    with torch.no_grad():
        torch.compile(caller, backend="eager")(torch.ones(1))
    assert len(seen) == 2
    assert all(len(names) == 1 for names in seen), seen
    assert seen[0] != seen[1]  # one code object per wrapper


# -- a scope inside compiled code: the fallback to eager is warned ------------------------


@pytest.fixture
def fresh_warnings() -> Iterator[None]:
    _eager_fallback._warned.clear()
    yield
    _eager_fallback._warned.clear()


def scope_inside(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    with fp32_precision_scope(FULL):
        z = y @ y
    return z.cos()


class Graphs:
    """A backend keeping the graphs it compiles."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
        self.graphs.append(gm)
        return gm.forward


@pytest.mark.usefixtures("fresh_warnings")
def test_a_scope_inside_a_compiled_function_warns_once_that_it_runs_eagerly() -> None:
    torch.set_float32_matmul_precision("high")
    graphs = Graphs()
    compiled = torch.compile(scope_inside, backend=graphs)
    x = torch.eye(2)
    with pytest.warns(Fp32EagerFallbackWarning) as caught:
        out = compiled(x)
    torch.testing.assert_close(out, scope_inside(x))
    assert len(caught) == 1
    warning = caught[0]
    lineno = scope_inside.__code__.co_firstlineno + 2  # the ``with`` line
    assert (warning.filename, warning.lineno) == (__file__, lineno)
    message = str(warning.message)
    assert f"{__file__}:{lineno}" in message
    assert "scope_inside() runs eagerly" in message
    assert "with_fp32_precision(precision)(torch.compile(fn))" in message
    # It did run eagerly: torch 2.8 and later run all of the function eagerly; 2.4 (whose
    # scope refuses where it is made) compiles the part before the scope, never the matmul.
    targets = [str(node.target) for gm in graphs.graphs for node in gm.graph.nodes]
    assert not any("matmul" in target for target in targets), targets
    assert len(graphs.graphs) == (0 if _compat.DYNAMO_TRACES_SCOPES_MADE_INSIDE else 1)
    # Once per code location: calls and new compiles of the same code stay silent.
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp32EagerFallbackWarning)
        torch.compile(scope_inside, backend="eager")(x)
        compiled(x)
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.usefixtures("fresh_warnings")
def test_a_scope_in_a_fullgraph_region_errors_without_the_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp32EagerFallbackWarning)
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch.compile(scope_inside, backend="eager", fullgraph=True)(torch.eye(2))


@pytest.mark.usefixtures("fresh_warnings")
def test_wrappers_in_a_compiled_function_do_not_warn() -> None:
    node = Fp32ScopedModule(torch.nn.Linear(2, 2), FULL, in_graph=False)

    def caller(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = node(x.sin())
        return out.cos()

    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp32EagerFallbackWarning)
        torch.compile(caller, backend="eager")(torch.eye(2))
