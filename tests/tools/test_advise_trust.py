"""``fp32scope.advise``'s figures and promises: held-out batches, the margin, run=, the loss, the noise.

Each error advise reports is checked against this file's own measurement (scope_modules and
plain torch, tests/_support/advise_checks.py), on a model with a control.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import fp32scope
from tests._support import advise_models as models
from tests._support.advise_checks import assert_meets_and_is_minimal, each, measured

KEPT = {"matmul": "highest", "cudnn_allow_tf32": False}
BF16 = torch.bfloat16


def fast() -> fp32scope.Fp32Precision:
    return fp32scope.current_fp32_precision()


# -- held-out batches -----------------------------------------------------------------------


def test_a_held_out_miss_is_not_met_and_the_reason_names_the_batch() -> None:
    model, held_out = models.NearTieMoE(), models.held_out_batches()
    calibration = [models.quiet_batch()]
    assert measured(model, calibration, {}, fast=fast(), dtype=BF16) < 2e-2 / 1.5  # the control: nothing flips here
    advice = fp32scope.advise(model, calibration, held_out=held_out, autocast=BF16, tolerance=2e-2)
    assert advice.policy == {}  # every node fast meets the target on the calibration batch
    expected = each(model, held_out, {}, fast=fast(), dtype=BF16)
    assert all(e > 2e-2 for e in expected)  # ... and misses on every held-out one
    assert advice.batch_errors["held_out"] == pytest.approx(expected, rel=1e-6)
    assert advice.batch_errors["calibration"] == pytest.approx([advice.error], rel=1e-12)
    assert advice.held_out_error == max(advice.batch_errors["held_out"])
    assert not advice.met
    assert advice.reason is not None
    assert f"held-out batch 0: {advice.batch_errors['held_out'][0]:.3g}" in advice.reason
    assert "3 of 3 held-out" in advice.reason
    table = advice.table()
    assert f"{advice.held_out_error:.3g} on 3 held-out batch(es)" in table
    assert "NOT met" in table
    assert "errors per held-out batch: " in table


def test_a_policy_that_holds_on_held_out_batches_is_met() -> None:
    model, calibration, held_out = models.NearTieMoE(), models.near_tie_batches(), models.held_out_batches()
    assert measured(model, held_out, {}, fast=fast(), dtype=BF16) > models.ROUTER_TOLERANCE  # the control
    advice = fp32scope.advise(model, calibration, held_out=held_out, autocast=BF16, tolerance=models.ROUTER_TOLERANCE)
    assert advice.policy == {"router": KEPT}
    assert advice.met
    assert advice.reason is None
    assert len(advice.batch_errors["calibration"]) == 2
    expected = each(model, held_out, advice.policy, fast=fast(), dtype=BF16)
    assert advice.batch_errors["held_out"] == pytest.approx(expected, rel=1e-6)
    assert advice.held_out_error is not None
    assert advice.held_out_error <= models.ROUTER_TOLERANCE


def test_without_held_out_batches_held_out_error_is_none() -> None:
    advice = fp32scope.advise(models.NearTieMoE(), models.near_tie_batch(), autocast=BF16, tolerance=10.0)
    assert advice.held_out_error is None
    assert advice.batch_errors == {"calibration": (advice.error,), "held_out": ()}


# -- the margin -----------------------------------------------------------------------------


def test_the_search_meets_tolerance_over_margin_and_is_minimal_there() -> None:
    model, batches = models.NearTieMoE(), models.near_tie_batches()
    tolerance = 5e-3
    assert measured(model, batches, {"router": KEPT}, fast=fast(), dtype=BF16) > tolerance / 2  # the control
    plain = fp32scope.advise(model, batches, autocast=BF16, tolerance=tolerance, margin=1.0)
    wide = fp32scope.advise(model, batches, autocast=BF16, tolerance=tolerance, margin=2)
    assert plain.policy == {"router": KEPT}  # margin 1: the search of fp32scope 0.1
    assert set(wide.policy) > set(plain.policy)
    assert wide.margin == 2.0
    assert wide.error <= tolerance / 2
    assert "searched for 0.0025 (margin 2)" in wide.table()
    assert_meets_and_is_minimal(model, batches, wide, fast=fast(), dtype=BF16)
    assert_meets_and_is_minimal(model, batches, plain, fast=fast(), dtype=BF16)


def test_the_default_margin_is_one_and_a_half() -> None:
    advice = fp32scope.advise(models.NearTieMoE(), models.near_tie_batch(), autocast=BF16, tolerance=10.0)
    assert advice.margin == 1.5


# -- run= -----------------------------------------------------------------------------------


def test_run_replaces_the_call_and_the_error_is_taken_on_what_it_returns() -> None:
    model, batch = models.NearTieMoE(), models.near_tie_batch()
    tolerance = models.ROUTER_TOLERANCE
    assert measured(model, [batch], {}, fast=fast(), dtype=BF16, call=models.sample) > tolerance  # the control
    seen: list[tuple[bool, bool]] = []
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))

    def run(given: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append((given is model, isinstance(given.router, fp32scope.Fp32ScopedModule)))
        return models.sample(given, x)

    advice = fp32scope.advise(model, batch, run=run, autocast=BF16, tolerance=tolerance)
    assert all(same for same, _ in seen)  # the user's own module ...
    assert any(scoped for _, scoped in seen)  # ... scoped in place for a policy
    assert len(seen) == advice.runs  # every run, the reference's included
    assert len(calls) == models.STEPS * advice.runs
    assert advice.policy == {"router": KEPT}
    assert_meets_and_is_minimal(model, [batch], advice, fast=fast(), dtype=BF16, call=models.sample)


# -- with a loss: the backward, its FLOPs ----------------------------------------------------


def test_with_a_loss_the_backward_runs_outside_autocast() -> None:
    # Every node kept must give the reference's gradients exactly: a backward inside autocast
    # would run the kept nodes' gradient matmuls in bf16 (an error near 2e-3).
    model, batch = models.TwoLayer(), models.two_layer_batch()
    assert measured(model, [batch], {}, fast=fast(), dtype=BF16) > 1e-3  # the control
    advice = fp32scope.advise(model, batch, autocast=BF16, tolerance=1e-6, loss=models.mean_square)
    assert advice.met
    assert advice.error == 0.0
    assert set(advice.policy) == {"first", "second"}


@pytest.mark.parametrize(("loss", "first"), [(None, 1 / 5), (models.mean_square, 1 / 7)], ids=["forward", "loss"])
def test_each_node_s_flop_share_counts_its_own_forward_and_backward(loss: Any, first: float) -> None:
    # Forward: 64x64 and 64x256 products, 1:4. Backward: the first needs no input gradient
    # (x needs none) so 2 products to the second's 3: (1 + 1) : (4 + 8) = 1 : 6.
    advice = fp32scope.advise(models.TwoLayer(), models.two_layer_batch(), autocast=BF16, tolerance=10.0, loss=loss)
    shares = {n.name: n.flop_share for n in advice.nodes}
    assert shares["first"] == pytest.approx(first, rel=1e-6)
    assert shares["second"] == pytest.approx(1 - first, rel=1e-6)


# -- the reference's noise ------------------------------------------------------------------


def test_a_tolerance_under_ten_times_the_noise_is_refused_after_the_two_reference_runs() -> None:
    model = models.Noisy()
    with pytest.raises(
        ValueError, match=r"tolerance 0\.1 is under 10 times .* differ by 0\.0\d+\. .*seed the model"
    ) as raised:
        fp32scope.advise(model, models.near_tie_batch(), autocast=BF16, tolerance=0.1)
    assert "give a tolerance of at least" in str(raised.value)
    assert model.calls == 2  # the reference twice, then nothing


def test_the_noise_is_reported_when_the_tolerance_is_far_above_it() -> None:
    model = models.Noisy()
    advice = fp32scope.advise(model, models.near_tie_batch(), autocast=BF16, tolerance=10.0)
    assert 0 < advice.noise < 1.0
    assert math.isfinite(advice.noise)
    assert f"noise (two full float32 runs) {advice.noise:.3g}" in advice.table()


def test_with_a_loss_each_node_s_backward_runs_at_its_node_s_setting_in_the_sensitivity_runs() -> None:
    model = models.Probed()
    fp32scope.advise(
        model,
        models.near_tie_batch(),
        fast="high",
        autocast=BF16,
        tolerance=1e-9,  # below the fast error: the sensitivities are measured
        margin=1.0,
        loss=models.mean_square,
        candidates=["first", "second"],  # each a node whose own work includes its probe
    )
    runs: list[list[tuple[str, str, str]]] = []
    for entry in model.log:
        if entry[0] == "run":
            runs.append([])
        else:
            runs[-1].append(entry)
    # The reference twice (full float32), every node fast, then one run per node with it alone fast.
    assert {p for run in runs[:2] for _, _, p in run} == {"highest"}
    assert {p for _, _, p in runs[2]} == {"high"}
    for run, fast_one in zip(runs[3:5], ["first", "second"], strict=True):
        assert sorted(run) == sorted(
            (name, phase, "high" if name == fast_one else "highest")
            for name in ("first", "second")
            for phase in ("forward", "backward")
        ), run


def test_met_within_the_tolerance_but_not_its_margin_says_so() -> None:
    # OwnWork's root multiplies in its own forward: no policy can remove that error.
    model, batch = models.OwnWork(), models.near_tie_batch()
    floor = measured(model, [batch], {"head": KEPT}, fast=fast(), dtype=BF16)
    assert floor > 0  # the control: the error every policy leaves
    advice = fp32scope.advise(model, batch, autocast=BF16, tolerance=1.2 * floor, margin=2)
    assert advice.met  # every batch within the tolerance ...
    assert advice.reason is None
    assert advice.error > advice.tolerance / advice.margin  # ... but not within its margin, and the table says so
    assert "(within the tolerance, not its margin)" in advice.table()
