"""Sharded training with a scoped block trains exactly like the unscoped model (issue 11).

``tests/_support/sharded.py`` trains every configuration in two processes over gloo (one run for
all, shared by the tests here) and compares the full parameters after each step with an
unsharded single-process reference, so that a gradient lost, counted twice or arriving a
step late shows. Each test also checks where the probes ran: the block's forward and
backward in its precision ("highest", cuDNN TF32 off), the rest in the default ("high"),
and the flags back to the default after training, and compares every step with a control
configuration: the same wrapper without fp32scope. Where that control itself does not
match the unsharded reference (FSDP2 on torch 2.8's CPU), the comparison with the control
is the one made; where the wrapper does not run at all (FSDP2 on torch 2.4's CPU build),
its tests skip with the reason, decided by what that torch has (not by the control failing:
a control that errors fails the test, since the harness is then broken). The
``*-region-compiled`` configurations compile the wrapped model whole (``aot_eager``) with the
block an in-graph region (``in_graph=True``, issue 36); the ``*-inductor`` ones with Inductor,
the block compiled inside its region's op (issue 40), against the same wrapper compiled the
same way without fp32scope.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

import pytest

from tests._support import autocast_fsdp2, common, sharded
from tests._support.common import run_harness
from tests._support.releases import TORCH_RELEASE

TOLERANCE = 1e-6  # the reference sums the two ranks' batches in another order: float32 rounding only
FULL = str(common.FULL)
DEFAULT = str(common.DEFAULT)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo over a file store: Linux and macOS")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_harness("tests._support.sharded", tmp_path_factory.mktemp("sharded") / "results.json", "sharded")


def fsdp2_missing_here() -> str | None:
    """Why this torch's FSDP2 cannot train on the CPU, judged by what it has; None when it can.

    FSDP2 first ran on the CPU when its communication context learnt to take a device
    (``FSDPCommContext.lazy_init(device)``); before that (torch 2.4's
    ``torch.distributed._composable.fsdp``, whose ``FSDPCommContext.init()`` takes none) it
    made CUDA streams unconditionally.
    """
    if sharded.fully_shard_api() is None:
        return f"torch {TORCH_RELEASE} has no FSDP2 (fully_shard)"
    homes = ("torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp")  # 2.6+, 2.4-2.5
    for home in (f"{package}._fsdp_param_group" for package in homes):
        try:
            context = getattr(importlib.import_module(home), "FSDPCommContext", None)
        except ImportError:
            continue
        lazy_init = getattr(context, "lazy_init", None) or getattr(context, "init", None)  # init: torch 2.4
        if lazy_init is not None and "device" not in inspect.signature(lazy_init).parameters:
            return f"torch {TORCH_RELEASE}: FSDP2 needs CUDA streams (its FSDPCommContext initialises without a device)"
        if context is not None:
            return None
    return None  # not found where expected: let the control run, and fail if it errors


def _control_trains(results: dict[str, Any], control: str) -> str | None:
    """None when the control trains exactly; else why not (a measured release limitation).

    A control that errors fails the test: the same wrapper without fp32scope must run here,
    else the harness (not fp32scope) is broken; a wrapper this torch cannot run is skipped
    before, by presence (``fsdp2_missing_here``), never because its control failed.
    """
    got = results[control]
    assert "error" not in got, (
        f"the control {control} (the same wrapper without fp32scope) failed: the harness is broken\n{got.get('error')}"
    )
    wrapper = control.split("-", maxsplit=1)[0].upper()
    worst = max(got["diffs"])
    if worst > TOLERANCE:
        return (
            f"torch {TORCH_RELEASE}: {wrapper} does not train exactly on the CPU even without "
            f"fp32scope (largest difference {worst:.2g} from the unsharded reference), so it cannot show a difference"
        )
    return None


def _largest_difference(a: list[dict[str, list[float]]], b: list[dict[str, list[float]]]) -> float:
    return max(abs(x - y) for sa, sb in zip(a, b, strict=True) for k in sa for x, y in zip(sa[k], sb[k], strict=True))


def _check(results: dict[str, Any], name: str, control: str) -> None:
    got = results[name]
    if name.endswith("-inductor"):  # the node compiled inside its op, not run eagerly there
        assert got.get("compiled_inside", 0) >= 1, got.get("error", got.get("compiled_inside"))
    why_not = _control_trains(results, control)
    assert "error" not in got, got.get("error")
    # The same wrapper without fp32scope: step by step, the same parameters.
    against_control = _largest_difference(got["states"], results[control]["states"])
    assert against_control <= TOLERANCE, f"{name}: largest difference from {control}: {against_control}"
    if why_not is None:  # the wrapper trains exactly here: the unsharded reference too
        assert max(got["diffs"]) <= TOLERANCE, f"{name}: differences from the reference per step {got['diffs']}"
    seen = got["seen"]
    for tag in ("block-in", "block-out"):
        assert seen[f"fwd {tag}"] == [FULL], (tag, seen)
        assert seen[f"bwd {tag}"] == [FULL], (tag, seen)
    for tag in ("pre", "post"):
        assert seen[f"fwd {tag}"] == [DEFAULT], (tag, seen)
        assert seen[f"bwd {tag}"] == [DEFAULT], (tag, seen)
    assert got["flags_restored"]


REFUSED_REGION = "fsdp2-region-as-unit-compiled"
CONTROLS = {"fsdp2-control", "fsdp2-control-inductor", "fsdp1-control", "ddp-control", "ddp-control-inductor"}
FSDP2 = [n for n in sharded.CONFIGS if n.startswith("fsdp2-") and n not in {*CONTROLS, REFUSED_REGION}]
FSDP1 = [n for n in sharded.CONFIGS if n.startswith("fsdp1-") and n not in CONTROLS]
DDP = [n for n in sharded.CONFIGS if n.startswith("ddp-") and n not in CONTROLS]


def _control(name: str) -> str:
    """The same wrapper without fp32scope, compiled with Inductor where ``name`` is."""
    return name.split("-", maxsplit=1)[0] + ("-control-inductor" if name.endswith("-inductor") else "-control")


@pytest.mark.parametrize("name", FSDP2)
def test_fsdp2(results: dict[str, Any], name: str) -> None:
    missing = fsdp2_missing_here()
    if missing is not None:
        pytest.skip(missing)
    _check(results, name, _control(name))


def test_an_fsdp2_unit_as_an_in_graph_region_is_refused_naming_what_works(results: dict[str, Any]) -> None:
    # Dynamo traces an FSDP2 unit with its hooks skipped, so a region that is the unit would
    # take the sharded DTensor parameters; the region inside the root's unit trains (above).
    missing = fsdp2_missing_here()
    if missing is not None:
        pytest.skip(missing)
    error = results[REFUSED_REGION].get("error", "")
    assert "Fp32ScopeError" in error, error or results[REFUSED_REGION]
    assert "an FSDP2 unit (fully_shard) or a tensor-parallel module cannot be an in-graph region" in error
    assert "in_graph=False" in error


@pytest.mark.parametrize("name", FSDP1)
def test_fsdp1(results: dict[str, Any], name: str) -> None:
    _check(results, name, "fsdp1-control")


@pytest.mark.parametrize("name", DDP)
def test_ddp(results: dict[str, Any], name: str) -> None:
    assert _control_trains(results, "ddp-control") is None  # DDP trains exactly on every tested torch
    _check(results, name, _control(name))


def test_the_controls_run_unscoped(results: dict[str, Any]) -> None:
    # The harness itself: without fp32scope the block runs in the default, forward and backward.
    controls = ["fsdp1-control", "ddp-control", "ddp-control-inductor"]
    if fsdp2_missing_here() is None:
        controls += ["fsdp2-control", "fsdp2-control-inductor"]
    for control in controls:
        got = results[control]
        assert "error" not in got, f"{control} (no fp32scope) failed, so the harness is broken:\n{got['error']}"
        assert got["seen"]["fwd block-in"] == [DEFAULT]
        assert got["seen"]["bwd block-in"] == [DEFAULT]


def test_fsdp2_example_trains_like_the_unsharded_model(results: dict[str, Any]) -> None:
    missing = fsdp2_missing_here()
    if missing is not None:
        pytest.skip(missing)
    why_not = _control_trains(results, "fsdp2-control")
    if why_not is not None:
        pytest.skip(why_not)
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (the example's import)
    except ImportError:
        pytest.skip(f"torch {TORCH_RELEASE} has FSDP2 only as torch.distributed._composable.fsdp")
    from tests._support.examples import run_example

    out = run_example("fsdp2_training.py")
    for rank in (0, 1):
        assert f"rank {rank}: block backward ran in [{FULL}] (3 steps)" in out
        assert f"rank {rank}: matches the unsharded training at every step: True" in out
        assert f"rank {rank}: flags after training: {DEFAULT}" in out


# -- FSDP2 mixed precision with a float32 node (issue 18) --------------------------------------
#
# ``tests/_support/autocast_fsdp2.py`` trains the root under
# ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` with the
# router wrapped ``Fp32ScopedModule(router, FULL, autocast=False)`` and, as the reference,
# written by hand: a float32 FSDP2 unit of its own whose module enters the scope, turns
# autocast off and casts its input (the script's docstring says why that is the faithful
# equivalent).

MIXED_FLOAT32_UNIT = [n for n in autocast_fsdp2.CONFIGS if n.startswith("own-fp32-")]
INSIDE_FLOAT32 = f"x torch.float32 weight torch.float32 out torch.float32 autocast False {FULL}"
PARAMETER_WARNING = "Fp32ParameterDtypeWarning: Scoped node 'Router' asks for full float32"
HOW_TO = "fully_shard(node, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))"
DTYPE_MISMATCH = "RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    missing = fsdp2_missing_here()
    if missing is not None:
        pytest.skip(missing)
    out = tmp_path_factory.mktemp("mixed") / "results.json"
    found = run_harness("tests._support.autocast_fsdp2", out, "FSDP2 mixed precision")
    for name, ranks in found.items():
        assert len(ranks) == autocast_fsdp2.WORLD, name
        for got in ranks:
            assert "harness-error" not in got, f"{name}: {got.get('harness-error')}"
    return found


@pytest.mark.parametrize("name", MIXED_FLOAT32_UNIT)
def test_fsdp2_mixed_precision_float32_unit_matches_the_hand_written_stack(mixed: dict[str, Any], name: str) -> None:
    # Each rank: outputs, local gradient shards and local parameter shards equal, every step.
    for rank, got in enumerate(mixed[name]):
        assert got["steps"] == [autocast_fsdp2.STEPS] * 2, (rank, got)
        assert got["equal"] == [True] * autocast_fsdp2.STEPS, (rank, got["equal"])
        for stack in ("wrapped", "hand"):
            assert got[stack]["error"] is None, (rank, stack, got[stack]["error"])
            assert set(got[stack]["seen"]) == {INSIDE_FLOAT32}, (rank, stack, got[stack]["seen"])
            assert got[stack]["warnings"] == [], (rank, stack)
            # The model's output, and the node's float32 output.
            assert got[stack]["dtypes"] == ["torch.bfloat16", "torch.float32"], (rank, stack)


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("in-bf16-unit", "its parameter 'lin.weight' is torch.bfloat16 when it runs"),
        ("in-bf16-unit-autocast", "its parameter 'lin.weight' is torch.bfloat16 when it runs"),
        ("own-bf16-unit", "its FSDP2 unit computes with torch.bfloat16 parameters"),
        ("bf16-unit-inside", "FSDP2 unit 'lin' computes with torch.bfloat16 parameters"),
    ],
)
def test_fsdp2_bf16_parameters_of_a_float32_node_warn_once(mixed: dict[str, Any], name: str, source: str) -> None:
    for rank, got in enumerate(mixed[name]):
        wrapped = got["wrapped"]
        assert len(wrapped["warnings"]) == 1, (rank, wrapped["warnings"])
        (message,) = wrapped["warnings"]
        assert message.startswith(PARAMETER_WARNING), message
        assert source in message, message
        assert HOW_TO in message, message
        # What it warns of is what happened: the node computed in bf16, or (autocast=False
        # under autocast) its float32 argument met the bf16 weight.
        if wrapped["error"] is None:
            assert wrapped["seen"], rank
            assert all(" out torch.bfloat16 " in seen for seen in wrapped["seen"]), wrapped["seen"]
        else:
            assert wrapped["error"] == DTYPE_MISMATCH
        assert got["hand"]["warnings"] == []


def test_fsdp2_bf16_parameters_what_each_stack_does(mixed: dict[str, Any]) -> None:
    # Measured, and said in the mixed precision guide. Without autocast the wrapper casts
    # nothing, so the node trains in bf16; the hand-written ``.float()`` meets a bf16 weight.
    for got in mixed["in-bf16-unit"]:
        assert got["steps"] == [autocast_fsdp2.STEPS, 0]
        assert got["wrapped"]["error"] is None
        assert got["hand"]["error"] == DTYPE_MISMATCH
        # The bf16 unit casts its inputs to bf16 too.
        assert set(got["wrapped"]["seen"]) == {
            f"x torch.bfloat16 weight torch.bfloat16 out torch.bfloat16 autocast False {FULL}"
        }
    # Under autocast both cast the input to float32 and fail on the bf16 weight.
    for got in mixed["in-bf16-unit-autocast"]:
        assert got["steps"] == [0, 0]
        assert got["wrapped"]["error"] == got["hand"]["error"] == DTYPE_MISMATCH
