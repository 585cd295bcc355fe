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
a control that errors fails the test, since the harness is then broken).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests._support import common, sharded
from tests._support.common import ROOT
from tests._support.releases import TORCH_RELEASE

TOLERANCE = 1e-6  # the reference sums the two ranks' batches in another order: float32 rounding only
FULL = str(common.FULL)
DEFAULT = str(common.DEFAULT)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo over a file store: Linux and macOS")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("sharded") / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(  # noqa: S603
        [sys.executable, "-m", "tests._support.sharded", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.exists(), f"the sharded run wrote nothing (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    found: dict[str, Any] = json.loads(out.read_text())
    return found


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


FSDP2 = [n for n in sharded.CONFIGS if n.startswith("fsdp2-") and n != "fsdp2-control"]
FSDP1 = [n for n in sharded.CONFIGS if n.startswith("fsdp1-") and n != "fsdp1-control"]
DDP = [n for n in sharded.CONFIGS if n.startswith("ddp-") and n != "ddp-control"]


@pytest.mark.parametrize("name", FSDP2)
def test_fsdp2(results: dict[str, Any], name: str) -> None:
    missing = fsdp2_missing_here()
    if missing is not None:
        pytest.skip(missing)
    _check(results, name, "fsdp2-control")


@pytest.mark.parametrize("name", FSDP1)
def test_fsdp1(results: dict[str, Any], name: str) -> None:
    _check(results, name, "fsdp1-control")


@pytest.mark.parametrize("name", DDP)
def test_ddp(results: dict[str, Any], name: str) -> None:
    assert _control_trains(results, "ddp-control") is None  # DDP trains exactly on every tested torch
    _check(results, name, "ddp-control")


def test_the_controls_run_unscoped(results: dict[str, Any]) -> None:
    # The harness itself: without fp32scope the block runs in the default, forward and backward.
    controls = ["fsdp1-control", "ddp-control"]
    if fsdp2_missing_here() is None:
        controls.append("fsdp2-control")
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
