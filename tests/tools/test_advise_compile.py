"""``advise(..., compile=..., reference="eager")``: find the nodes whose compiled results drift, keep them eager.

The model (``advise_compiled.RopeNet``, bf16) is two pointwise blocks between three linears.
Its control, measured here: compiled whole with Inductor, it drifts from the same model run
eagerly (skipped, with the figure, on a CPU where it does not). What the advised policy
promises is measured here too, with this file's own compiles and error, not advise's:
scoped with it and compiled whole, the model is within the tolerance of eager; without any
one of its nodes, it is not. Inductor compiles C++ on the CPU: one advise run with Inductor
is shared by the tests of its result (a module-scoped fixture); the plumbing tests use
Dynamo's ``eager`` backend or ``aot_eager``, which compile no code.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp32scope
from fp32scope import Fp32Precision, scope_modules, unscope_modules
from tests._support import advise_compiled as compiled
from tests._support import advise_models as models
from tests._support.advise_checks import Snapshot
from tests._support.advise_compiled import compiled_error
from tests._support.common import ROOT

TOLERANCE = 1e-3
BF16 = torch.bfloat16
REGION = {"matmul": "highest", "cudnn_allow_tf32": False, "eager": True}


class _Counted:
    """torch.compile, counting what it compiles: the model whole, or one node alone."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.whole = 0
        self.alone: list[str] = []
        real = torch.compile

        @functools.wraps(real)  # its signature is torch.compile's: advise checks compile= against it
        def counted(module: Any, **options: Any) -> Any:
            if module is self.root:
                self.whole += 1
            else:  # a candidate's own forward, compiled as the module's forward
                self.alone.append(type(module.__self__).__name__)
            return real(module, **options)

        self.compile = counted


class Found:
    def __init__(self) -> None:
        self.model = compiled.rope_net()
        self.batches = compiled.rope_batches()
        self.held_out = compiled.rope_held_out()
        self.control = compiled_error(self.model, self.batches + self.held_out, {})
        snapshot = Snapshot(self.model)
        counted = _Counted(self.model)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "compile", counted.compile)
            self.advice = fp32scope.advise(
                self.model, self.batches, held_out=self.held_out, compile=True, reference="eager", tolerance=TOLERANCE
            )
        self.counted = counted
        snapshot.assert_unchanged()  # the model as found: module objects, tensors, modes, flags, RNG
        assert not any("forward" in m.__dict__ for m in self.model.modules())  # each forward its class's again


@pytest.fixture(scope="module")
def found() -> Iterator[Found]:
    torch.compiler.reset()
    result = Found()
    if result.control <= TOLERANCE:
        pytest.skip(f"this CPU's Inductor does not drift: compiled whole, RopeNet is {result.control:.3g} from eager")
    yield result
    torch.compiler.reset()


@pytest.mark.compile
def test_the_control_the_plain_compile_drifts_from_eager(found: Found) -> None:
    assert found.control > TOLERANCE
    assert math.isclose(found.advice.fast_error, compiled_error(found.model, found.batches, {}))


@pytest.mark.compile
def test_the_pointwise_blocks_are_candidates_and_the_advised_policy_keeps_them_eager(found: Found) -> None:
    advice = found.advice
    assert [n.name for n in advice.nodes] == ["before", "rope", "middle", "sinusoid", "after"]
    assert {n.name: n.parameters for n in advice.nodes}["rope"] == 0
    assert advice.policy == {"rope": "eager", "sinusoid": "eager"}
    assert advice.autocast is None
    assert advice.reference == "eager"
    assert advice.compile == {}
    assert advice.met


@pytest.mark.compile
def test_scoped_so_the_compiled_model_is_within_the_tolerance_of_eager_in_one_graph(found: Found) -> None:
    every = found.batches + found.held_out
    assert compiled_error(found.model, every, found.advice.policy, fullgraph=True) <= TOLERANCE


@pytest.mark.compile
def test_the_policy_is_1_minimal(found: Found) -> None:
    policy = found.advice.policy
    target = TOLERANCE / found.advice.margin
    for name in policy:
        rest = {k: v for k, v in policy.items() if k != name}
        assert compiled_error(found.model, found.batches, rest) > target, f"{name} can be dropped"


@pytest.mark.compile
def test_the_drifting_nodes_rank_first_and_the_linears_do_not_drift_alone(found: Found) -> None:
    rows = {n.name: n for n in found.advice.nodes}
    assert rows["rope"].sensitivity > TOLERANCE
    assert rows["sinusoid"].sensitivity > TOLERANCE
    assert all(rows[name].sensitivity < TOLERANCE for name in ("before", "middle", "after"))


@pytest.mark.compile
def test_compiles_are_counted_and_within_the_bound(found: Found) -> None:
    advice, counted = found.advice, found.counted
    assert advice.compiles == counted.whole
    assert advice.node_compiles == len(counted.alone) == len(advice.nodes)
    assert sorted(counted.alone) == sorted(n.type for n in advice.nodes)
    n, k = len(advice.nodes), len(advice.policy)
    assert advice.compiles <= 2 * math.log2(n) + k + 4
    assert 0 < advice.compile_seconds <= advice.seconds
    assert f"{advice.compiles} whole-model compile(s), {advice.node_compiles} node compile(s)" in advice.table()


@pytest.mark.compile
def test_the_json_round_trip_and_scope_modules_take_the_eager_policy(found: Found) -> None:
    advice = found.advice
    text = advice.to_json()
    assert json.loads(text)["policy"] == {"rope": "eager", "sinusoid": "eager"}
    again = fp32scope.Fp32Advice.from_json(text)
    assert again == advice
    model = compiled.rope_net()
    assert scope_modules(model, json.loads(text)["policy"]) == {"rope": Fp32Precision(), "sinusoid": Fp32Precision()}
    assert unscope_modules(model) == ["rope", "sinusoid"]
    assert again.apply(model) == {"rope": Fp32Precision(), "sinusoid": Fp32Precision()}
    assert all(isinstance(m, fp32scope.Fp32ScopedModule) for m in (model.rope, model.sinusoid))
    unscope_modules(model)


@pytest.mark.compile
def test_the_howto_shows_this_advice(found: Found) -> None:
    # The how-to's figures are one CPU's; its nodes, what is kept, the policy and the compiles are this run's.
    page = (ROOT / "docs" / "howto" / "find_fp32_nodes.rst").read_text()
    start = page.index("    node      class     params  FLOPs  sensitivity  kept")
    shown = page[start : page.index("\n\n", page.index("compiled (torch.compile", start))].splitlines()
    table = found.advice.table().splitlines()

    def cells(lines: list[str]) -> list[list[str]]:
        rows = [line.split() for line in lines[2 : 2 + len(found.advice.nodes)]]
        return [[*row[:3], row[-1] if row[-1] == "yes" else ""] for row in rows]

    assert cells([line.strip() for line in shown]) == cells(table)
    seconds = r",? [0-9.]+ s in compiled runs| \([0-9]+ runs, [0-9.]+ s\)"  # the machine's
    block = re.sub(seconds, "", " ".join(" ".join(shown).split()))
    for prefix in ("advised: ", "advised error: ", "reference: ", "compiled (torch.compile "):
        line = next(line for line in table if line.startswith(prefix))
        assert re.sub(seconds, "", line) in block
    assert '``{"rope": "eager", "sinusoid": "eager"}``' in page
    assert found.advice.policy == {"rope": "eager", "sinusoid": "eager"}
    assert found.advice.met


@pytest.mark.compile
def test_dynamo_is_reset_when_advise_returns() -> None:
    calls: list[int] = []

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def backend(graph: torch.fx.GraphModule, _inputs: Any) -> Any:
        calls.append(1)
        return graph.forward

    fast = torch.compile(double, backend=backend)
    fast(torch.ones(3))
    fast(torch.ones(3))
    assert calls == [1]  # the control: compiled once, then cached
    fp32scope.advise(models.NearTieMoE(), models.near_tie_batch(), autocast=BF16, compile={"backend": "eager"})
    fast(torch.ones(3))
    assert calls == [1, 1]  # compiled again: advise left nothing compiled behind, the caller's code neither


def _diffusers_imports() -> str | None:
    # diffusers 0.42 does not import on torch 2.4 (it uses torch.accelerator): why not, or None.
    try:
        import diffusers  # noqa: F401
    except Exception as error:
        return f"diffusers does not import with this torch: {type(error).__name__}: {error}"
    return None


@pytest.mark.compile
def test_flux_time_text_embed_drifts_in_its_time_proj_which_is_kept_eager() -> None:
    reason = _diffusers_imports()
    if reason is not None:
        pytest.skip(reason)
    tolerance = 1e-4
    model, batches, held_out = compiled.flux_time_text_embed(), compiled.flux_batches(), compiled.flux_held_out()
    control = compiled_error(model, batches + held_out, {})
    if control <= tolerance:
        pytest.skip(f"this CPU's Inductor does not drift: compiled whole, time_text_embed is {control:.3g} from eager")
    advice = fp32scope.advise(model, batches, held_out=held_out, compile=True, reference="eager", tolerance=tolerance)
    assert advice.policy == {"time_proj": "eager"}  # the sinusoid: no parameter, no matmul
    assert advice.kept_flop_share == 0  # the linears stay compiled
    assert advice.met
    assert compiled_error(model, batches + held_out, advice.policy) <= tolerance
    n, k = len(advice.nodes), len(advice.policy)
    assert advice.compiles <= 2 * math.log2(n) + k + 4
    # The how-to's table is this run's, its figures aside (one CPU's).
    page = (ROOT / "docs" / "howto" / "find_fp32_nodes.rst").read_text()
    start = page.index("    node                        class      params   FLOPs  sensitivity  kept")
    shown = [line.split() for line in page[start:].splitlines()[2 : 2 + n]]
    rows = [line.split() for line in advice.table().splitlines()[2 : 2 + n]]
    assert [[*r[:3], r[-1] == "yes"] for r in shown] == [[*r[:3], r[-1] == "yes"] for r in rows]


@pytest.mark.compile
def test_the_full_float32_reference_keeps_full_float32_regions_of_the_compiled_model() -> None:
    # The model is bf16, so full float32 flags change none of its math: the full float32
    # reference is eager, and the drifting blocks are the nodes to keep, as regions.
    model, batches = compiled.rope_net(), compiled.rope_batches()
    control = compiled_error(model, batches, {})
    if control <= TOLERANCE:
        pytest.skip(f"this CPU's Inductor does not drift: compiled whole, RopeNet is {control:.3g} from eager")
    advice = fp32scope.advise(model, batches, compile=True, tolerance=TOLERANCE)
    assert advice.policy == {"rope": REGION, "sinusoid": REGION}
    assert advice.reference == "float32"
    assert advice.met
    assert advice.fast.matmul == "highest"  # the fast setting is full float32: not refused, the compile differs
    assert compiled_error(model, batches, advice.policy) <= TOLERANCE


# -- without code generation: Dynamo's eager backend, AOTAutograd's aot_eager; none at all --------


@pytest.mark.compile
def test_with_compile_every_module_doing_floating_point_work_is_a_candidate() -> None:
    model = models.Block()
    advice = fp32scope.advise(
        model, models.block_batch(), autocast=BF16, compile={"backend": "eager"}, reference="eager"
    )
    # The ReLU does pointwise work of its own (not a candidate without compile=); mlp, a
    # Sequential, none. Dynamo's eager backend runs the graph as eager does: nothing drifts.
    assert [n.name for n in advice.nodes] == ["attn", "attn.q", "attn.k", "attn.v", "mlp.0", "mlp.1", "head"]
    assert advice.fast_error == 0
    assert advice.policy == {}
    assert advice.compile == {"backend": "eager"}
    assert advice.compiles == 1  # every node compiled; the empty policy is that run, cached
    assert advice.node_compiles == 0  # nothing to search: no sensitivity measured


@pytest.mark.compile
def test_with_compile_and_autocast_the_old_question_is_asked_of_the_compiled_model() -> None:
    model, batches = models.NearTieMoE(), models.near_tie_batches()
    advice = fp32scope.advise(
        model, batches, autocast=BF16, tolerance=models.ROUTER_TOLERANCE, compile={"backend": "aot_eager"}
    )
    assert advice.policy == {"router": REGION}
    assert advice.autocast is False
    assert advice.met
    scoped = scope_modules(model, advice.policy, autocast=False)
    assert scoped == {"router": Fp32Precision("highest", cudnn_allow_tf32=False)}
    unscope_modules(model)


def _cos_off(x: torch.Tensor) -> torch.Tensor:
    return torch.cos(x) * 1.01


def _off_cosine(graph: torch.fx.GraphModule, _inputs: Any) -> Any:
    """A backend whose cosine is 1% off: a compiler's drift, without generating code."""
    for node in graph.graph.nodes:
        if (node.op, node.target) in {("call_method", "cos"), ("call_function", torch.cos)}:
            node.op, node.target = "call_function", _cos_off
    graph.recompile()
    return graph.forward


class _WideRope(compiled.Rope):
    width = compiled.WIDTH


class _ReadsItsChild(torch.nn.Module):
    """Reads an attribute of its child, the RoPE block, in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.before = torch.nn.Linear(compiled.WIDTH, compiled.WIDTH)
        self.rope = _WideRope()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.rope(self.before(x)[..., : self.rope.width])
        return out


@pytest.mark.compile
def test_a_candidate_compiled_alone_stays_itself_in_the_model() -> None:
    # Its parent reads its attributes while it is measured alone, and the policy keeps it eager.
    model, batch = _ReadsItsChild(), torch.randn(4, compiled.WIDTH)
    advice = fp32scope.advise(model, batch, compile={"backend": _off_cosine}, reference="eager")
    assert advice.fast_error > TOLERANCE  # the control: the backend's cosine drifts
    assert advice.policy == {"rope": "eager"}
    assert advice.node_compiles == 2
    assert advice.met
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reference": "eager"}, ValueError, "reference='eager' compares the compiled model"),
        ({"reference": "float64"}, ValueError, "reference must be 'float32'"),
        ({"reference": 32}, TypeError, "reference must be 'float32'"),
        ({"compile": "inductor"}, TypeError, "compile must be False"),
        ({"compile": {"fullgraf": True}}, ValueError, r"compile\['fullgraf'\] is not an argument of torch.compile"),
        ({"compile": {1: True}}, TypeError, "keys must be torch.compile's keyword names"),
    ],
)
def test_refusals_come_before_any_run(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    model = models.Raises()  # any run raises: a refusal must come first
    with pytest.raises(error, match=match):
        fp32scope.advise(model, models.near_tie_batch(), autocast=BF16, **kwargs)


@pytest.mark.compile
def test_a_full_float32_fast_setting_is_refused_without_compile_only() -> None:
    model, batch = compiled.rope_net(), compiled.rope_batch()
    with pytest.raises(ValueError, match="the fast setting is the reference itself"):
        fp32scope.advise(model, batch, fast="highest")
    advice = fp32scope.advise(model, batch, fast="highest", compile={"backend": "eager"})
    assert advice.policy == {}
    assert advice.met


# -- the advice itself, without a model ----------------------------------------------------------

_RULES = st.sampled_from(["eager", REGION, {"matmul": "highest", "cudnn_allow_tf32": False}])
_OPTIONS = st.dictionaries(
    st.sampled_from(["fullgraph", "dynamic", "backend", "mode"]),
    st.one_of(st.booleans(), st.none(), st.sampled_from(["inductor", "aot_eager", "max-autotune"])),
)


def _advice(policy: dict[str, Any], options: dict[str, Any] | None, reference: str) -> fp32scope.Fp32Advice:
    return fp32scope.Fp32Advice(
        policy=policy,
        autocast=None,
        error=0.0,
        fast_error=0.5,
        tolerance=1e-3,
        met=True,
        runs=9,
        seconds=1.5,
        fast=Fp32Precision("highest", cudnn_allow_tf32=False),
        autocast_dtype=BF16,
        nodes=tuple(fp32scope.Fp32AdviceNode(name, "Rope", 0, 0.0, 0.2, True) for name in policy),
        reference=reference,
        compile=options,
        compiles=6,
        node_compiles=5,
        compile_seconds=1.25,
    )


@settings(max_examples=40, deadline=None)
@given(
    policy=st.dictionaries(st.sampled_from(["rope", "sinusoid", "blocks.0.mlp"]), _RULES, min_size=1),
    options=st.one_of(st.none(), _OPTIONS),
    reference=st.sampled_from(["eager", "float32"]),
)
def test_an_advice_with_compile_goes_through_json_unchanged(
    policy: dict[str, Any], options: dict[str, Any] | None, reference: str
) -> None:
    advice = _advice(policy, options, reference)
    text = advice.to_json()
    assert fp32scope.Fp32Advice.from_json(text) == advice
    assert json.loads(text)["policy"] == policy


def test_a_backend_json_cannot_hold_is_written_as_its_repr() -> None:
    def my_backend(graph: Any, _inputs: Any) -> Any:
        return graph

    document = json.loads(_advice({"rope": "eager"}, {"backend": my_backend}, "eager").to_json())
    assert document["compile"] == {"backend": repr(my_backend)}


def test_an_advice_written_before_compile_reads_as_eager_runs_against_full_float32() -> None:
    document = json.loads(_advice({"rope": REGION}, {"fullgraph": True}, "eager").to_json())
    for key in ("reference", "compile", "compiles", "node_compiles", "compile_seconds"):
        del document[key]
    advice = fp32scope.Fp32Advice.from_json(json.dumps(document))
    assert (advice.reference, advice.compile, advice.compiles, advice.node_compiles) == ("float32", None, 0, 0)
    assert advice.compile_seconds == 0.0
    assert "compiled (" not in advice.table()


def test_the_table_and_the_chart_say_compiled() -> None:
    advice = _advice({"rope": "eager"}, {"fullgraph": True}, "eager")
    table = advice.table()
    assert "reference: the model run eagerly at the fast setting" in table
    assert "fast (matmul 'highest' under autocast bfloat16, compiled) error: 0.5" in table
    assert "noise (two eager runs)" in table
    assert "advised: 1 node(s) kept eager" in table
    assert "compiled (torch.compile fullgraph=True): 6 whole-model compile(s), 5 node compile(s), 1.2 s" in table
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figure = advice._figure()
    try:
        assert figure.axes[0].get_xlabel() == "error with only this node compiled"
    finally:
        plt.close(figure)
