"""Plain objects a region carries: a config, a dataclass, an object holding tensors (torch >= 2.13).

A node given such an object inside a graph compiled with ``fullgraph=True`` is one op: the
object crosses it as its ``__dict__`` (tensors, constants, containers, nested objects), and
what the node changed on it (a counter, a dict entry, a tensor bound anew, an attribute
added) is set on the caller's object after the op. Its constants are constants of the
graph: changing one compiles again and gives the new result, as plain ``torch.compile``
does. Each check compares with the node's eager twin (``in_graph=False``), fed its own
object, and reads the precision where the node runs (a probe op). An object a region
cannot carry is refused naming the argument and the reason; on a torch whose Dynamo cannot
read an object's ``__dict__`` (before 2.13), every object is, saying so.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from fp32scope import Fp32ScopedModule, Fp32ScopeError, current_fp32_precision, set_process_default
from fp32scope._compat import DYNAMO_READS_OBJECT_DICTS
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL
from tests._support.compiled import forbid_recompiles, parent_graphs, python_frames
from tests._support.hf import gpt2_unavailable
from tests._support.probe import phases, probe

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

WIDTH = 4
carried_here = pytest.mark.skipif(
    not DYNAMO_READS_OBJECT_DICTS, reason="a region carries plain objects on torch >= 2.13 (Dynamo reads __dict__)"
)


@dataclasses.dataclass
class Config:
    """A dataclass config: constants, a tensor, containers, and state the node updates."""

    scale: float
    shift: torch.Tensor
    mode: str = "add"
    calls: int = 0
    sizes: tuple[int, ...] = (1, 2)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Frozen:
    scale: float
    shift: torch.Tensor


class Inner:
    def __init__(self, gain: float) -> None:
        self.gain = gain
        self.bias = torch.full((WIDTH,), 0.25)


class Plain:
    """A plain object holding a nested one, as a user's options object would."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.shift = torch.linspace(-1, 1, WIDTH)
        self.inner = Inner(2.0)
        self.names = ["a", "b"]


class Uses(torch.nn.Module):
    """Reads the object's constants and tensors, and changes it as a stateful config would."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, cfg: Any) -> torch.Tensor:
        y = self.linear(x) * cfg.scale + cfg.shift
        if isinstance(cfg, Config):
            y = y + 1 if cfg.mode == "add" else y * 2
            cfg.calls += 1  # a counter: the caller's value plus one, every call
            cfg.stats["seen"] = cfg.stats.get("seen", 0) + 1
            cfg.last = y.detach().sum()  # type: ignore[attr-defined]  # an attribute added, bound to a tensor
        if isinstance(cfg, Plain):
            y = y * cfg.inner.gain + cfg.inner.bias
            cfg.inner.bias = cfg.inner.bias + 1  # a nested object's tensor bound anew
        out: torch.Tensor = probe(y, "node")
        return out


class Parent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(WIDTH, WIDTH)
        self.node: Any = Uses()

    def forward(self, x: torch.Tensor, cfg: Any) -> torch.Tensor:
        out: torch.Tensor = self.node(self.pre(x), cfg).sum(-1)
        return out


def _twins(*, eager_node: bool = True) -> tuple[Parent, Parent]:
    torch.manual_seed(0)
    eager = Parent()
    region = copy.deepcopy(eager)
    eager.node = Fp32ScopedModule(eager.node, FULL, in_graph=False)
    region.node = Fp32ScopedModule(region.node, FULL, in_graph=True, eager=eager_node)
    return eager, region


def _assert_same_state(got: Any, want: Any, where: str = "object") -> None:
    """The two objects' states are equal: tensors bit for bit, nested objects by their own state."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), where
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_same_state(a, b, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_same_state(got[key], want[key], f"{where}[{key!r}]")
    elif hasattr(want, "__dict__"):
        assert type(got) is type(want), where
        _assert_same_state(vars(got), vars(want), where)
    else:
        assert type(got) is type(want), where
        assert got == want, where


OBJECTS: dict[str, Callable[[], Any]] = {
    "dataclass": lambda: Config(2.0, torch.arange(WIDTH, dtype=torch.float32)),
    "frozen-dataclass": lambda: Frozen(0.5, torch.ones(WIDTH)),
    "plain-nested": lambda: Plain(1.5),
}


@carried_here
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", list(OBJECTS))
def test_an_object_crosses_a_region_in_one_graph_as_in_eager(kind: str, backend: str) -> None:
    set_process_default(DEFAULT)
    eager, region = _twins()
    compiled = torch.compile(region, backend=backend, fullgraph=True)
    mine, theirs = OBJECTS[kind](), OBJECTS[kind]()
    for call in range(3):
        x = torch.randn(3, WIDTH)
        with torch.no_grad():
            got, want = compiled(x, mine), eager(x, theirs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # an eager node: bit for bit
        _assert_same_state(mine, theirs)  # what the node changed on the object, set on the caller's
        assert current_fp32_precision() == DEFAULT, call
    _probe.SEEN.clear()
    x = torch.randn(3, WIDTH)
    compiled(x, mine).sum().backward()
    eager(x, theirs).sum().backward()
    for (name, p), q in zip(region.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    _assert_same_state(mine, theirs)
    assert phases("fwd")["node"] == [FULL, FULL]  # the region's call and its twin's, each in the node's precision
    assert phases("bwd")["node"] == [FULL, FULL]
    assert sum(counters["graph_break"].values()) == 0


@carried_here
def test_a_node_given_an_object_is_compiled_inside_without_a_gradient_and_eager_in_training() -> None:
    # Not eager=True: Inductor compiles the node inside its op where the call holds nothing
    # symbolic and needs no gradient (close to eager, not bit for bit); else it runs eagerly there.
    set_process_default(DEFAULT)
    eager, region = _twins(eager_node=False)
    compiled = torch.compile(region, backend="inductor", fullgraph=True)
    mine, theirs = OBJECTS["plain-nested"](), OBJECTS["plain-nested"]()
    code = Uses.forward.__code__
    for call in range(3):
        x = torch.randn(3, WIDTH)
        with torch.no_grad():
            if call == 0:  # compiling (not profiled: a profiler slows Dynamo and Inductor many times)
                got = compiled(x, mine)
            else:
                with python_frames(code) as frames:
                    got = compiled(x, mine)
                assert frames == [0], call  # warm: the compiled code ran, not the node's Python
            torch.testing.assert_close(got, eager(x, theirs))
        torch.testing.assert_close(mine.inner.bias, theirs.inner.bias)  # rebound inside, set on the caller's
    assert phases("fwd")["node"][-1] == FULL  # the compiled code's probe, in the node's precision
    x = torch.randn(3, WIDTH)
    compiled(x, mine).sum().backward()  # compiles the training graph
    with python_frames(code) as frames:
        compiled(x, mine).sum().backward()
    assert frames[0] >= 1  # training: the node's forward ran, eagerly, in its op
    eager(x, theirs).sum().backward()
    eager(x, theirs).sum().backward()
    for p, q in zip(region.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert sum(counters["graph_break"].values()) == 0


@carried_here
@pytest.mark.parametrize(("field", "values"), [("scale", [2.0, -0.5, 2.0]), ("mode", ["add", "double", "add"])])
def test_a_changed_constant_compiles_again_and_gives_the_new_result_as_plain_torch(
    field: str, values: list[Any]
) -> None:
    set_process_default(DEFAULT)
    eager, region = _twins()
    plain = copy.deepcopy(eager)  # the reference: plain torch.compile of the unscoped model
    plain.node = plain.node.__wrapped__
    compiled, compiled_plain = torch.compile(region, fullgraph=True), torch.compile(plain, fullgraph=True)
    mine, theirs, ref = (OBJECTS["dataclass"]() for _ in range(3))
    x = torch.randn(3, WIDTH)
    results = []
    for value in values:
        for obj in (mine, theirs, ref):
            setattr(obj, field, value)
        with torch.no_grad():
            got, want, plain_out = compiled(x, mine), eager(x, theirs), compiled_plain(x, ref)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got, plain_out)
        results.append(got)
    assert not torch.equal(results[0], results[1])  # the change took effect
    torch.testing.assert_close(results[0], results[2], rtol=0, atol=0)
    with torch.no_grad(), forbid_recompiles():  # no change, no compile
        compiled(x, mine)
    assert sum(counters["graph_break"].values()) == 0


@carried_here
def test_a_counter_the_node_moves_every_call_recompiles_no_more_than_plain_torch() -> None:
    set_process_default(DEFAULT)
    eager, region = _twins()
    plain = copy.deepcopy(eager)
    plain.node = plain.node.__wrapped__
    graphs = []
    for model in (region, plain):
        torch.compiler.reset()
        counters.clear()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        cfg = OBJECTS["dataclass"]()
        with torch.no_grad():
            for _ in range(8):
                compiled(torch.randn(3, WIDTH), cfg)
        assert cfg.calls == 8
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] <= graphs[1], graphs


class NormsByConfig(torch.nn.Module):
    """Reads a Hugging Face config as its own norm would (its epsilon, its sizes)."""

    def forward(self, x: torch.Tensor, config: Any) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        out: torch.Tensor = probe(x * torch.rsqrt(variance + config.rms_norm_eps) * config.hidden_size, "node")
        return out


@carried_here
def test_a_hugging_face_config_crosses_a_region_in_one_graph() -> None:
    reason = gpt2_unavailable()
    if reason is not None:
        pytest.skip(reason.replace("GPT-2", "LlamaConfig"))
    from transformers import LlamaConfig

    set_process_default(DEFAULT)
    config = LlamaConfig(hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=2, vocab_size=16)
    node = Fp32ScopedModule(NormsByConfig(), FULL, in_graph=True, eager=True)
    twin = Fp32ScopedModule(NormsByConfig(), FULL, in_graph=False)
    compiled = torch.compile(lambda x, c: node(x, c) + 1, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, WIDTH)
    torch.testing.assert_close(compiled(x, config), twin(x, config) + 1, rtol=0, atol=0)
    config.rms_norm_eps = 0.5  # a constant of the graph: compiled again, the new result
    torch.testing.assert_close(compiled(x, config), twin(x, config) + 1, rtol=0, atol=0)
    assert phases("fwd")["node"] == [FULL] * 4
    assert sum(counters["graph_break"].values()) == 0


class Branches(torch.nn.Module):
    """Changes its object one way or another depending on an int of it."""

    def forward(self, x: torch.Tensor, cfg: Any) -> torch.Tensor:
        if cfg.n > 4:
            cfg.extra = x * 3
        out: torch.Tensor = probe(x * 2, "node")
        return out


class Counted:
    def __init__(self, n: int) -> None:
        self.n = n


def _branching_run(node: Any, backend: str) -> list[Any]:
    # Calls over values of n that make it symbolic (it changes) and cross the branch both ways.
    compiled = torch.compile(lambda x, cfg: node(x, cfg) + 1, fullgraph=True, backend=backend)
    x = torch.linspace(-1, 1, WIDTH)
    runs = []
    with torch.no_grad():
        for n in (3, 4, 5, 4, 6, 2):
            cfg = Counted(n)
            runs.append((compiled(x, cfg), getattr(cfg, "extra", None)))
    return runs


@carried_here
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_node_branching_on_a_symbolic_int_of_its_object_changes_it_as_plain_torch_does(backend: str) -> None:
    # Each graph's op reads the plan its own call's fake run found, not the last one traced:
    # the same layout (n symbolic) changes the object one way below 5 and another above.
    set_process_default(DEFAULT)
    node = Fp32ScopedModule(Branches(), FULL, in_graph=True)
    got = _branching_run(node, backend)
    assert phases("fwd")["node"] == [FULL] * 6
    graphs = parent_graphs()
    counters.clear()
    plain = _branching_run(Branches(), backend)
    assert graphs == counters["stats"]["unique_graphs"] == 3  # no more graphs than plain torch
    assert [extra is not None for _, extra in got] == [False, False, True, False, True, False]
    for (out, extra), (want, want_extra) in zip(got, plain, strict=True):
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        if want_extra is not None:
            torch.testing.assert_close(extra, want_extra, rtol=0, atol=0)


class Bumps(torch.nn.Module):
    """Updates its object's tensor in place on one branch of an int of it only."""

    def forward(self, x: torch.Tensor, cfg: Any) -> torch.Tensor:
        if cfg.n > 4:
            cfg.t.add_(1)
        return x * 2


class HoldsCount:
    def __init__(self, n: int) -> None:
        self.n = n
        self.t = torch.zeros(WIDTH)


def _bumping_run(node: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    def parent(x: torch.Tensor, cfg: Any) -> torch.Tensor:
        before: torch.Tensor = cfg.t * 2  # read before the call: Inductor may compute it after an op it sees as pure
        out: torch.Tensor = node(x, cfg) + before
        return out

    compiled = torch.compile(parent, fullgraph=True)
    x = torch.ones(WIDTH)
    runs = []
    with torch.no_grad():
        # The branch that updates in place traced last but one: each graph must copy what its
        # own branch updates, not what the last branch traced does.
        for n in (5, 6, 3, 6, 7):
            cfg = HoldsCount(n)
            runs.append((compiled(x, cfg), cfg.t))
    return runs


@carried_here
def test_a_tensor_updated_in_place_on_one_branch_is_updated_on_a_copy_in_that_branchs_graph() -> None:
    got = _bumping_run(Fp32ScopedModule(Bumps(), FULL, in_graph=True))
    torch._dynamo.reset()
    want = _bumping_run(Bumps())
    for (out, t), (plain_out, plain_t) in zip(got, want, strict=True):
        torch.testing.assert_close(out, plain_out, rtol=0, atol=0)
        torch.testing.assert_close(t, plain_t, rtol=0, atol=0)
    assert [float(t[0]) for _, t in got] == [1.0, 1.0, 0.0, 1.0, 1.0]


class Toggles(torch.nn.Module):
    """Changes its object on every other run of its forward: each trace of one call differs."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def forward(self, x: torch.Tensor, cfg: Any) -> torch.Tensor:
        self.runs += 1
        if self.runs % 2:
            cfg.extra = x * 3
        return x * 2


@carried_here
def test_a_node_changing_its_object_differently_when_one_call_is_traced_again_is_refused() -> None:
    # Dynamo's fake run and AOTAutograd's of one call disagree: the graph would write back
    # what the first found while the op hands back what the second did.
    node = Fp32ScopedModule(Toggles(), FULL, in_graph=True)
    compiled = torch.compile(lambda x, cfg: node(x, cfg) + 1, fullgraph=True, backend="aot_eager")
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as raised:
        compiled(torch.ones(WIDTH), Counted(1))
    assert isinstance(raised.value.inner_exception, Fp32ScopeError)
    assert "changed the objects it was given differently when one call of it was traced twice" in str(raised.value)


class Slotted:
    __slots__ = ("tensor",)

    def __init__(self) -> None:
        self.tensor = torch.ones(WIDTH)


def _holding(value: Any) -> Any:
    holder: Any = Plain(1.0)
    holder.extra = value
    return holder


def _nested(depth: int) -> Any:
    obj: Any = Inner(1.0)
    for _ in range(depth):
        outer: Any = Inner(1.0)
        outer.child = obj
        obj = outer
    return obj


REFUSED: dict[str, tuple[Callable[[], Any], str]] = {
    "slots": (Slotted, "keeps its state outside a __dict__"),
    "module": (lambda: _holding(torch.nn.Linear(2, 2)), "holds a Linear in its 'extra' that is a module"),
    "function": (lambda: _holding(torch.relu), "holds a builtin_function_or_method in its 'extra'"),
    "set": (lambda: _holding({1, 2}), "holds a set in its 'extra'"),
    "too-deep": (lambda: _nested(6), "nests objects deeper than 4 levels"),
}


class Reads(torch.nn.Module):
    def forward(self, x: torch.Tensor, cfg: Any) -> torch.Tensor:
        return x * 2


@pytest.mark.parametrize("kind", list(REFUSED))
def test_an_object_a_region_cannot_carry_is_refused_naming_the_argument_and_why(kind: str) -> None:
    set_process_default(DEFAULT)
    make, why = REFUSED[kind]
    obj = make()
    node = Fp32ScopedModule(Reads(), FULL, in_graph=True)
    compiled = torch.compile(lambda x, cfg: node(x, cfg=cfg) + 1, fullgraph=True, backend="aot_eager")
    with pytest.raises(Fp32ScopeError) as caught:
        compiled(torch.ones(WIDTH), obj)
    message = str(caught.value)
    kind_name = type(obj).__name__
    assert f"keyword argument 'cfg' of type {kind_name}, which a region cannot carry" in message
    if DYNAMO_READS_OBJECT_DICTS:
        assert why in message
    else:
        assert "a region carries on torch >= 2.13 only" in message
    assert re.search(r"Pass the object's tensors", message)
    assert current_fp32_precision() == DEFAULT
