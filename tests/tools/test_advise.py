"""``fp32scope.advise``: the policies it finds are measured to meet the target and be 1-minimal.

Every model has a control: its error with every node fast, measured here, exceeds the
tolerance. The properties of a policy (it meets the tolerance, dropping any one node breaks
it) are measured here too, with scope_modules and this file's own error, not advise's.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from typing import Any

import pytest
import torch

import fp32scope
from fp32scope import Fp32Precision, unscope_modules
from tests._support import advise_models as models
from tests._support.advise_checks import assert_meets_and_is_minimal, measured
from tests._support.common import FULL, ROOT
from tests._support.hf import gpt2_unavailable

KEPT = {"matmul": "highest", "cudnn_allow_tf32": False}
BF16 = torch.bfloat16


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
    # a(x) - b(x) cancels to 1e-4 of either term: "medium" in either one alone is a large
    # relative error. How large depends on the CPU ("medium" is a bf16 product 2.4e-3 off on
    # one with AMX, 5e-7 off on others, or exact), and with it whether the small c must be
    # kept too: what must be kept is derived from this CPU's measurements, not one CPU's set.
    model, batch = models.Cancellation(), models.cancellation_batch()
    medium = Fp32Precision("medium", True)
    tolerance = 1e-3
    control = measured(model, [batch], {}, fast=medium, dtype=None)
    if control <= tolerance:
        pytest.skip(f"'medium' changes nothing that matters on this CPU (error {control:.2g}): no bf16 matmul path")
    names = ["a", "b", "c"]
    # Each node's own effect: it alone at "medium", the others kept in full float32.
    alone = {n: measured(model, [batch], {o: KEPT for o in names if o != n}, fast=medium, dtype=None) for n in names}
    for term in ("a", "b"):  # the premise: either term alone at "medium" breaks the tolerance
        if alone[term] <= tolerance:
            pytest.skip(f"'medium' in {term} alone is within the tolerance on this CPU (error {alone[term]:.2g})")
    advice = fp32scope.advise(model, batch, fast="medium", tolerance=tolerance)
    assert advice.fast == medium or advice.fast.matmul == "medium"
    assert advice.autocast is None
    assert advice.met
    assert {"a", "b"} <= set(advice.policy)  # both terms of the cancellation
    rows = {n.name: n for n in advice.nodes}
    assert list(rows) == names
    for name in names:  # the sensitivities the search ranks by are these measurements
        assert rows[name].sensitivity == pytest.approx(alone[name], rel=1e-6)
    # Every node whose own effect breaks what the search meets is kept (c too where
    # "medium" is bf16) ...
    target = advice.tolerance / advice.margin
    assert {n for n in names if alone[n] > target} <= set(advice.policy)
    # ... and no node that is not needed: the policy meets the target and is 1-minimal.
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
    assert advice.runs == 3  # the reference twice and every node fast: no sensitivity is needed
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
    assert seen == [(torch.Tensor, torch.Tensor)] * 2  # the reference again (its noise), every node fast
    assert advice.noise == 0.0


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


# -- the cost of the search -----------------------------------------------------------------

BOUNDED = {
    "router": (models.NearTieMoE, models.near_tie_batch, models.ROUTER_TOLERANCE / 4),
    "block": (models.Block, models.block_batch, 1e-3),
    "nested": (models.Nested, models.near_tie_batch, 1e-2),
    "two layers": (models.TwoLayer, models.two_layer_batch, 1e-6),
}


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_the_search_stays_near_one_run_per_candidate(name: str) -> None:
    build, batch, tolerance = BOUNDED[name]
    model = build()
    assert measured(model, [batch()], {}, fast=fp32scope.current_fp32_precision(), dtype=BF16) > tolerance  # control
    advice = fp32scope.advise(model, batch(), autocast=BF16, tolerance=tolerance)
    candidates, kept = len(advice.nodes), len(advice.policy)
    assert kept > 0  # the control: a search happened
    assert advice.runs <= candidates + 2 * kept + math.log2(candidates) + 4


def test_the_benchmark_prints_runs_and_seconds_within_the_bound() -> None:
    reason = gpt2_unavailable()  # the benchmark's model is transformers' GPT-2
    if reason is not None:
        pytest.skip(reason)
    done = subprocess.run(  # noqa: S603  (this interpreter, the repository's own script)
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_advise.py"),
            *("--layers", "1", "--width", "32", "--heads", "2", "--vocabulary", "64", "--length", "16"),
            *("--batches", "1", "--held-out", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr  # 1: more runs than the bound
    assert re.search(r"^runs \d+ \(bound [\d.]+\), seconds [\d.]+", done.stdout, re.MULTILINE), done.stdout
