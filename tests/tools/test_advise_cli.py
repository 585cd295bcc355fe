"""``python -m fp32scope advise``: options, files written, exit statuses."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import fp32scope
from fp32scope import scope_modules, unscope_modules
from fp32scope.__main__ import main
from tests._support import advise_models as models
from tests._support.advise_checks import measured
from tests._support.common import FULL

KEPT = {"matmul": "highest", "cudnn_allow_tf32": False}
BF16 = torch.bfloat16


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
