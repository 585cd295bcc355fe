"""``fp32scope.advise`` and ``python -m fp32scope advise``: measured policies, and nothing left behind.

Every model has a control: its error with every node fast, measured here, exceeds the
tolerance. The properties of a policy (it meets the tolerance, dropping any one node breaks
it) are measured here too, with scope_modules and this file's own error, not advise's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch

import fp32scope
from fp32scope import Fp32Precision, fp32_precision_scope, scope_modules, unscope_modules
from fp32scope.__main__ import main
from fp32scope._flags import torch_flags as _flags
from tests._support import advise_models as models
from tests._support.common import FULL, BoomError

KEPT = {"matmul": "highest", "cudnn_allow_tf32": False}
BF16 = torch.bfloat16


# -- the test's own measurement -------------------------------------------------------------


def as_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, dict):
        return (), batch
    return tuple(batch), {}


def floats(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [v for v in output.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]  # ModelOutput


def run(model: torch.nn.Module, batch: Any, precision: Fp32Precision, dtype: torch.dtype | None) -> list[torch.Tensor]:
    args, kwargs = as_batch(batch)
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(fp32_precision_scope(precision))
        if dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=dtype))
        return [t.double() for t in floats(model(*args, **kwargs))]


def measured(
    model: torch.nn.Module,
    batches: list[Any],
    policy: dict[str, Any],
    *,
    fast: Fp32Precision,
    dtype: torch.dtype | None,
) -> float:
    """The largest relative L2 error over the batches, with ``policy`` applied through scope_modules."""
    worst = 0.0
    for batch in batches:
        reference = run(model, batch, FULL, None)
        if policy:
            scope_modules(model, policy, autocast=False if dtype is not None else None)
        try:
            output = run(model, batch, fast, dtype)
        finally:
            unscope_modules(model)
        diff = math.sqrt(sum(float((o - r).norm()) ** 2 for o, r in zip(output, reference, strict=True)))
        norm = math.sqrt(sum(float(r.norm()) ** 2 for r in reference))
        worst = max(worst, diff / norm)
    return worst


def assert_meets_and_is_minimal(
    model: torch.nn.Module,
    batches: list[Any],
    advice: fp32scope.Fp32Advice,
    *,
    fast: Fp32Precision,
    dtype: torch.dtype | None,
) -> None:
    tolerance = advice.tolerance / advice.margin  # what the search meets on the calibration batches
    assert measured(model, batches, advice.policy, fast=fast, dtype=dtype) <= tolerance
    for name in advice.policy:
        rest = {k: v for k, v in advice.policy.items() if k != name}
        assert measured(model, batches, rest, fast=fast, dtype=dtype) > tolerance, f"{name} can be dropped"


class Snapshot:
    """Everything advise must leave as it found it: module objects, tensors, grads, modes, flags, RNG."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.modules = [(name, id(m), type(m)) for name, m in model.named_modules()]
        self.children = [(id(m), dict(m._modules)) for m in model.modules()]
        self.tensors = {k: (v, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
        self.grads = [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
        self.training = [m.training for m in model.modules()]
        self.flags = _flags.save_raw_state()
        self.process = fp32scope.current_fp32_precision()
        self.autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        self.rng = torch.get_rng_state()

    def assert_unchanged(self) -> None:
        model = self.model
        assert [(name, id(m), type(m)) for name, m in model.named_modules()] == self.modules
        assert [(id(m), dict(m._modules)) for m in model.modules()] == self.children
        assert not any(isinstance(m, fp32scope.Fp32ScopedModule) for m in model.modules())
        assert fp32scope.scoped_modules(model) == {}
        now = model.state_dict(keep_vars=True)
        assert list(now) == list(self.tensors)
        for key, (tensor, saved) in self.tensors.items():
            assert now[key] is tensor, key
            assert torch.equal(tensor, saved), key
        for p, grad, saved in self.grads:
            assert p.grad is grad
            assert grad is None or (saved is not None and torch.equal(grad, saved))
        assert [m.training for m in model.modules()] == self.training
        assert _flags.save_raw_state() == self.flags
        assert fp32scope.current_fp32_precision() == self.process
        assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == self.autocast
        assert torch.equal(torch.get_rng_state(), self.rng)


def calls_of(model: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


# -- the policies found ---------------------------------------------------------------------


def test_a_near_tie_router_is_the_one_node_kept_under_bf16_autocast() -> None:
    model, batches = models.NearTieMoE(), models.near_tie_batches()
    fast = fp32scope.current_fp32_precision()
    tolerance = models.ROUTER_TOLERANCE
    assert measured(model, batches, {}, fast=fast, dtype=BF16) > tolerance  # the control: bf16 flips choices
    advice = fp32scope.advise(model, batches, autocast=BF16, tolerance=tolerance)
    assert advice.policy == {"router": KEPT}
    assert advice.autocast is False
    assert advice.met
    assert advice.fast_error > tolerance
    assert advice.error <= tolerance
    rows = {n.name: n for n in advice.nodes}
    assert list(rows) == ["router", "experts.0", "experts.1", "experts.2", "experts.3"]
    assert rows["router"].kept
    assert rows["router"].sensitivity > tolerance
    assert all(rows[f"experts.{i}"].sensitivity < tolerance for i in range(4))  # the experts are insensitive
    assert rows["router"].parameters == 128
    assert math.isclose(sum(n.flop_share for n in advice.nodes), 1.0)
    assert_meets_and_is_minimal(model, batches, advice, fast=fast, dtype=BF16)


def test_a_cancellation_under_medium_keeps_both_terms() -> None:
    model, batch = models.Cancellation(), models.cancellation_batch()
    medium = Fp32Precision("medium", True)
    tolerance = 1e-3
    control = measured(model, [batch], {}, fast=medium, dtype=None)
    if control <= tolerance:
        pytest.skip(f"'medium' changes nothing that matters on this CPU (error {control:.2g}): no bf16 matmul path")
    advice = fp32scope.advise(model, batch, fast="medium", tolerance=tolerance)
    assert advice.fast == medium or advice.fast.matmul == "medium"
    assert advice.autocast is None
    assert set(advice.policy) == {"a", "b"}
    assert advice.met
    assert_meets_and_is_minimal(model, [batch], advice, fast=advice.fast, dtype=None)


def test_a_tiny_mixtral_under_bf16_autocast_keeps_a_fifth_of_its_parameters_at_most() -> None:
    model, batch = models.tiny_mixtral(), models.mixtral_batch()
    fast = fp32scope.current_fp32_precision()
    tolerance = 1e-3
    assert measured(model, [batch], {}, fast=fast, dtype=BF16) > tolerance  # the control
    advice = fp32scope.advise(model, batch, autocast=BF16, tolerance=tolerance)
    assert advice.met
    assert advice.policy
    assert "lm_head" in advice.policy
    names = {n.name for n in advice.nodes}
    # An attention holds no parameter of its own (its projections are children) but runs sdpa.
    assert {"model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.0.mlp.gate"} <= names
    assert "model.layers.0" not in names  # a decoder layer only calls its children
    modules = dict(model.named_modules())
    kept = {id(p): p.numel() for name in advice.policy for p in modules[name].parameters()}
    total = sum(p.numel() for p in model.parameters())
    assert sum(kept.values()) / total < 0.2
    assert math.isclose(advice.kept_parameter_share, sum(kept.values()) / total)
    assert_meets_and_is_minimal(model, [batch], advice, fast=fast, dtype=BF16)


def test_a_node_kept_first_is_pruned_once_its_parent_is_kept() -> None:
    model, batch = models.Nested(), models.near_tie_batch()
    fast = fp32scope.current_fp32_precision()
    assert measured(model, [batch], {}, fast=fast, dtype=BF16) > 1e-2  # the control
    # The router alone is not enough: outer's own difference of products needs float32 too.
    assert measured(model, [batch], {"outer.router": KEPT}, fast=fast, dtype=BF16) > 1e-2
    advice = fp32scope.advise(model, batch, autocast=BF16, tolerance=1e-2)
    rows = {n.name: n for n in advice.nodes}
    assert rows["outer.router"].sensitivity > rows["outer"].sensitivity  # so the search keeps the router first
    assert advice.policy == {"outer": KEPT}  # ... and drops it once outer, which encloses it, is kept
    assert not rows["outer.router"].kept
    assert [line.split()[-1] for line in advice.table().splitlines()[2:4]] == ["yes", "inside"]
    assert_meets_and_is_minimal(model, [batch], advice, fast=fast, dtype=BF16)


def test_candidates_are_the_modules_doing_floating_point_work_of_their_own() -> None:
    model, batch = models.Block(), models.block_batch()
    fast = fp32scope.current_fp32_precision()
    assert measured(model, [batch], {}, fast=fast, dtype=BF16) > 1e-3  # the control
    advice = fp32scope.advise(model, batch, autocast=BF16, tolerance=1e-3)
    # attn holds no parameter but multiplies Q, K and V itself; mlp and the ReLU do nothing of their own.
    assert [n.name for n in advice.nodes] == ["attn", "attn.q", "attn.k", "attn.v", "mlp.0", "head"]
    assert advice.nodes[0].parameters == 3 * (32 * 32 + 32)
    assert advice.met
    assert_meets_and_is_minimal(model, [batch], advice, fast=fast, dtype=BF16)


def test_candidates_may_be_selectors() -> None:
    model, batch = models.NearTieMoE(), models.near_tie_batch()
    assert measured(model, [batch], {}, fast=fp32scope.current_fp32_precision(), dtype=BF16) > 2e-2  # control
    advice = fp32scope.advise(
        model, batch, autocast=BF16, tolerance=models.ROUTER_TOLERANCE, candidates=[r"re:experts\.[01]", "router"]
    )
    assert [n.name for n in advice.nodes] == ["router", "experts.0", "experts.1"]
    assert advice.policy == {"router": KEPT}


def test_an_empty_policy_when_every_node_fast_meets_the_tolerance() -> None:
    model, batch = models.NearTieMoE(), models.near_tie_batch()
    assert measured(model, [batch], {}, fast=fp32scope.current_fp32_precision(), dtype=BF16) > 2e-2  # control
    advice = fp32scope.advise(model, batch, autocast=BF16, tolerance=10.0)
    assert advice.policy == {}
    assert advice.met
    assert advice.error == advice.fast_error
    assert advice.runs == 2  # the reference and every node fast: no sensitivity is needed
    assert all(math.isnan(n.sensitivity) for n in advice.nodes)  # not measured
    assert "-" in advice.table().splitlines()[2].split()
    assert advice.apply(model) == {}


def test_the_advice_is_deterministic_and_applies_itself() -> None:
    model, batch = models.NearTieMoE(), models.near_tie_batch()
    assert measured(model, [batch], {}, fast=fp32scope.current_fp32_precision(), dtype=BF16) > 2e-2  # control
    first = fp32scope.advise(model, batch, autocast=BF16, tolerance=models.ROUTER_TOLERANCE)
    second = fp32scope.advise(model, batch, autocast=BF16, tolerance=models.ROUTER_TOLERANCE)
    assert first.policy == second.policy
    assert first.nodes == second.nodes
    assert first.runs == second.runs
    assert json.loads(json.dumps(first.policy)) == first.policy
    try:
        assert first.apply(model) == {"router": FULL}
    finally:
        unscope_modules(model)


def test_with_a_loss_the_gradients_count_too() -> None:
    model, batch = models.NearTieMoE(), models.near_tie_batch()
    assert measured(model, [batch], {}, fast=fp32scope.current_fp32_precision(), dtype=BF16) > 2e-2  # control
    plain = fp32scope.advise(model, batch, autocast=BF16, tolerance=10.0)
    with_loss = fp32scope.advise(model, batch, autocast=BF16, tolerance=10.0, loss=models.near_tie_loss)
    assert with_loss.fast_error >= plain.fast_error
    assert with_loss.fast_error > 0.0


def test_a_metric_replaces_the_error() -> None:
    model, batch = models.NearTieMoE(), models.near_tie_batch()
    assert measured(model, [batch], {}, fast=fp32scope.current_fp32_precision(), dtype=BF16) > 2e-2  # control
    seen: list[tuple[type, type]] = []

    def never_wrong(output: Any, reference: Any) -> float:
        seen.append((type(output), type(reference)))
        return 0.0

    advice = fp32scope.advise(model, batch, autocast=BF16, metric=never_wrong)
    assert advice.policy == {}
    assert advice.fast_error == 0.0
    assert seen == [(torch.Tensor, torch.Tensor)]


def test_not_met_when_the_error_comes_from_outside_every_candidate() -> None:
    model, batch = models.OwnWork(), models.near_tie_batch()
    assert measured(model, [batch], {}, fast=fp32scope.current_fp32_precision(), dtype=BF16) > 1e-4  # control
    advice = fp32scope.advise(model, batch, autocast=BF16, tolerance=1e-4)
    assert not advice.met
    assert advice.error > 1e-4
    assert advice.reason is not None
    assert "outside every candidate" in advice.reason
    assert "NOT met" in advice.table()
    assert advice.reason in advice.table()


def test_not_met_when_the_model_is_not_deterministic() -> None:
    model, batch = models.Noisy(), models.near_tie_batch()
    advice = fp32scope.advise(model, batch, autocast=BF16, tolerance=1e-4)
    assert advice.fast_error > 1e-4  # the control
    assert not advice.met
    assert advice.reason is not None
    assert "not deterministic" in advice.reason


# -- nothing left behind --------------------------------------------------------------------


@pytest.fixture
def used_model() -> torch.nn.Module:
    """The router model with gradients set, mixed training flags, a "high" default and an RNG state."""
    model = models.NearTieMoE()
    model.train()
    model.experts[1].eval()
    models.near_tie_loss(model(models.near_tie_batch())).backward()  # type: ignore[no-untyped-call]
    fp32scope.set_process_default(Fp32Precision("high", True))  # the conftest fixture puts the flags back
    return model


def test_the_model_and_the_process_come_back_as_they_were(used_model: torch.nn.Module) -> None:
    snapshot = Snapshot(used_model)
    advice = fp32scope.advise(
        used_model,
        models.near_tie_batches(),
        autocast=BF16,
        tolerance=models.ROUTER_TOLERANCE,
        loss=models.near_tie_loss,
    )
    assert advice.fast == Fp32Precision("high", True)  # the process default at the call
    assert advice.policy  # the search scoped and unscoped the model
    snapshot.assert_unchanged()


def test_the_callers_autocast_is_left_on_and_kept_out_of_the_runs() -> None:
    model, batch = models.NearTieMoE(), models.near_tie_batch()
    outside = fp32scope.advise(model, batch, tolerance=1e-3)
    assert outside.fast_error == 0.0  # the control: no autocast, "highest": exact
    with torch.autocast("cpu", dtype=torch.float16):
        snapshot = Snapshot(model)
        inside = fp32scope.advise(model, batch, tolerance=1e-3)
        snapshot.assert_unchanged()
    assert inside.fast_error == 0.0
    assert inside.policy == {}


@pytest.mark.parametrize("fail_at", [1, 5, 8], ids=["reference", "sensitivity", "policy"])
def test_an_error_in_the_model_propagates_and_leaves_nothing_behind(used_model: torch.nn.Module, fail_at: int) -> None:
    # One batch: run 1 is the reference, 2 every node fast, 3 to 7 one per candidate, 8 the first policy.
    calls = calls_of(used_model)
    snapshot = Snapshot(used_model)

    def boom(*_: Any) -> None:
        if len(calls) == fail_at:
            msg = f"the model fails at call {fail_at}"
            raise BoomError(msg)

    used_model.register_forward_pre_hook(boom)
    with pytest.raises(BoomError, match=f"call {fail_at}") as raised:
        fp32scope.advise(
            used_model,
            models.near_tie_batch(),
            autocast=BF16,
            tolerance=models.ROUTER_TOLERANCE,
            loss=models.near_tie_loss,
        )
    assert raised.traceback[-1].name == "boom"  # the model's own frame, not a re-raise
    snapshot.assert_unchanged()


BAD_ARGUMENTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"model": lambda x: x}, TypeError, r"torch\.nn\.Module"),
    ({"inputs": 3}, TypeError, r"inputs"),
    ({"inputs": []}, ValueError, r"inputs"),
    ({"fast": "fastest"}, ValueError, r"fast.*'fastest'"),
    ({"fast": 3}, TypeError, r"fast"),
    ({"autocast": "bf16"}, TypeError, r"autocast"),
    ({"autocast": torch.float32}, ValueError, r"autocast"),
    ({"tolerance": 0.0}, ValueError, r"tolerance"),
    ({"tolerance": -1e-3}, ValueError, r"tolerance"),
    ({"tolerance": math.nan}, ValueError, r"tolerance"),
    ({"tolerance": "1e-3"}, TypeError, r"tolerance"),
    ({"loss": 3}, TypeError, r"loss"),
    ({"metric": "l2"}, TypeError, r"metric"),
    ({"candidates": ["nope"]}, ValueError, r"'nope'"),
    ({"candidates": [3]}, TypeError, r"selector"),
    ({"candidates": "router"}, TypeError, r"candidates"),
    ({"progress": "yes"}, TypeError, r"progress"),
]


def _argument_id(bad: dict[str, Any]) -> str:
    # The same on every pytest-xdist worker: a function's repr holds its address.
    return ",".join(f"{k}={'<function>' if callable(v) else repr(v)}" for k, v in bad.items())


@pytest.mark.parametrize(("bad", "error", "match"), BAD_ARGUMENTS, ids=[_argument_id(b) for b, _, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_before_the_model_runs(bad: dict[str, Any], error: type, match: str) -> None:
    model = models.NearTieMoE()
    calls = calls_of(model)
    arguments: dict[str, Any] = {"model": model, "inputs": models.near_tie_batch(), **bad}
    with pytest.raises(error, match=match):
        fp32scope.advise(arguments.pop("model"), arguments.pop("inputs"), **arguments)
    assert calls == []


def test_a_model_scoped_already_is_refused() -> None:
    model = models.NearTieMoE()
    calls = calls_of(model)
    scope_modules(model, {"router": "highest"})
    with pytest.raises(ValueError, match="unscope_modules"):
        fp32scope.advise(model, models.near_tie_batch())
    assert calls == []


# -- output: table, plot, progress ----------------------------------------------------------


def test_the_table_names_every_node_and_both_errors() -> None:
    advice = fp32scope.advise(models.NearTieMoE(), models.near_tie_batch(), autocast=BF16, tolerance=2e-2)
    assert advice.fast_error > 2e-2  # the control
    table = advice.table()
    for node in advice.nodes:
        assert node.name in table
    assert f"error: {advice.fast_error:.3g}" in table
    assert f"advised error: {advice.error:.3g}" in table
    assert f"{advice.kept_flop_share:.1%} of FLOPs" in table


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    advice = fp32scope.advise(models.NearTieMoE(), models.near_tie_batch(), autocast=BF16, tolerance=2e-2)
    assert advice.fast_error > 2e-2  # the control
    advice.plot(tmp_path / "advice.png")
    assert (tmp_path / "advice.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    advice = fp32scope.advise(models.NearTieMoE(), models.near_tie_batch(), autocast=BF16, tolerance=10.0)
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match=r"pip install fp32scope\[plot\]"):
        advice.plot(tmp_path / "advice.png")


@pytest.mark.parametrize("progress", [True, False])
def test_progress_is_a_line_on_stderr_when_asked(progress: bool, capsys: pytest.CaptureFixture[str]) -> None:
    fp32scope.advise(models.NearTieMoE(), models.near_tie_batch(), autocast=BF16, tolerance=10.0, progress=progress)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert ("\rfp32scope advise: " in captured.err) is progress


# -- the command line -----------------------------------------------------------------------

TARGET = "tests._support.advise_models"


def test_cli_writes_a_policy_that_scope_modules_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "policy.json", tmp_path / "advice.png"
    args = [f"{TARGET}:NearTieMoE", "--inputs", f"{TARGET}:near_tie_batches", "--autocast", "bf16"]
    args += ["--tolerance", "2e-2", "--output", str(out)]
    plots = importlib.util.find_spec("matplotlib") is not None
    if plots:
        args += ["--plot", str(png)]
    assert main(["advise", *args]) == 0
    printed = capsys.readouterr().out
    assert "router" in printed
    assert '"router"' in printed  # the policy, as JSON
    policy = json.loads(out.read_text())
    assert policy == {"router": KEPT}
    model = models.NearTieMoE()
    batches = models.near_tie_batches()
    fast = fp32scope.current_fp32_precision()
    assert measured(model, batches, {}, fast=fast, dtype=BF16) > 2e-2  # the control
    assert scope_modules(model, policy, autocast=False) == {"router": FULL}  # the round trip
    unscope_modules(model)
    assert measured(model, batches, policy, fast=fast, dtype=BF16) <= 2e-2
    assert not plots or png.read_bytes()[:4] == b"\x89PNG"


def test_cli_exits_0_with_an_empty_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "policy.json"
    args = [f"{TARGET}:NearTieMoE", "--inputs", f"{TARGET}:near_tie_batch", "--autocast", "bf16", "--tolerance", "10"]
    assert main(["advise", *args, "--output", str(out)]) == 0
    assert json.loads(out.read_text()) == {}
    assert "met" in capsys.readouterr().out


def test_cli_exits_1_when_the_tolerance_is_not_met(capsys: pytest.CaptureFixture[str]) -> None:
    args = [f"{TARGET}:OwnWork", "--inputs", f"{TARGET}:near_tie_batch", "--autocast", "bf16", "--tolerance", "1e-4"]
    assert main(["advise", *args]) == 1
    assert "NOT met" in capsys.readouterr().out


CLI_REFUSALS = [
    (["nowhere_module_x:model"], "nowhere_module_x:model"),
    ([f"{TARGET}:missing"], "missing"),
    ([f"{TARGET}:NearTieMoE", "--inputs", f"{TARGET}:nothing"], "--inputs"),
    ([f"{TARGET}:NearTieMoE", "--inputs", f"{TARGET}:WIDTH"], "--inputs"),
    ([f"{TARGET}:NearTieMoE", "--fast", "fastest"], "--fast fastest"),
    ([f"{TARGET}:NearTieMoE", "--autocast", "fp8"], "--autocast fp8"),
    ([f"{TARGET}:NearTieMoE", "--tolerance", "-1"], "--tolerance -1"),
    ([f"{TARGET}:NearTieMoE", "--tolerance", "small"], "--tolerance small"),
    ([f"{TARGET}:NearTieMoE", "--loss", f"{TARGET}:WIDTH"], "--loss"),
]


@pytest.mark.parametrize(("args", "named"), CLI_REFUSALS, ids=[" ".join(a) for a, _ in CLI_REFUSALS])
def test_cli_exits_2_naming_a_bad_target_or_option(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if "--inputs" not in args:
        args = [args[0], "--inputs", f"{TARGET}:near_tie_batch", *args[1:]]
    assert main(["advise", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("fp32scope advise: ")
    assert named in lines[0]
