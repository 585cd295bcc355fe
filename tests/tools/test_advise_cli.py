"""``python -m fp32scope advise``: options, files written, exit statuses."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fp32scope
from fp32scope import scope_modules, unscope_modules
from fp32scope.__main__ import main
from tests._support import advise_compiled as compiled
from tests._support import advise_models as models
from tests._support.advise_checks import measured
from tests._support.advise_compiled import compiled_error
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
    ([f"{TARGET}:NearTieMoE", "--run", f"{TARGET}:WIDTH"], "--run"),
    ([f"{TARGET}:NearTieMoE", "--held-out", f"{TARGET}:WIDTH"], "--held-out"),
    ([f"{TARGET}:NearTieMoE", "--margin", "0.9"], "--margin 0.9: margin must be a finite number >= 1"),
    ([f"{TARGET}:NearTieMoE", "--margin", "wide"], "--margin wide: not a number"),
    # What advise refuses, and what the model or the loss raises: exit 2 too, not 1 ("not met").
    ([f"{TARGET}:Raises"], "RuntimeError: the model's forward fails"),
    ([f"{TARGET}:scoped_model"], "ValueError: model has scoped nodes already (router)"),
    ([f"{TARGET}:meta_model"], "ValueError: model has tensors on the meta device"),
    ([f"{TARGET}:NearTieMoE", "--loss", f"{TARGET}:failing_loss"], "ValueError: the loss fails"),
    # compile= and the reference, checked before the model is built.
    ([f"{TARGET}:Raises", "--reference", "eager"], "--reference eager: reference='eager' compares the compiled"),
    ([f"{TARGET}:Raises", "--compile", "--reference", "fp64"], "--reference fp64: reference must be 'float32'"),
    ([f"{TARGET}:Raises", "--compile-option", "fullgraph"], "--compile-option fullgraph: expected KEY=VALUE"),
    (
        [f"{TARGET}:Raises", "--compile-option", "fullgraf=true"],
        "--compile-option fullgraf=true: compile['fullgraf'] is not an argument of torch.compile",
    ),
]


@pytest.mark.parametrize(("args", "named"), CLI_REFUSALS, ids=[" ".join(a) for a, _ in CLI_REFUSALS])
def test_cli_exits_2_naming_a_bad_target_or_option(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if "--inputs" not in args:
        args = [args[0], "--inputs", f"{TARGET}:near_tie_batch", *args[1:]]
    if "--autocast" not in args:
        args = [*args, "--autocast", "bf16"]
    assert main(["advise", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("fp32scope advise: ")
    assert named in lines[0]


def test_cli_shows_the_traceback_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["advise", f"{TARGET}:Raises", "--inputs", f"{TARGET}:near_tie_batch", "--autocast", "bf16"]
    assert main(args) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main([*args, "--traceback"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "in forward" in err  # the model's own frame
    assert err.strip().splitlines()[-1] == "fp32scope advise: RuntimeError: the model's forward fails"


@pytest.mark.parametrize("option", ["--output", "--report", "--plot"])
@pytest.mark.parametrize("problem", ["missing folder", "a directory"])
def test_cli_checks_every_output_path_before_building_the_model(
    option: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if option == "--plot":
        pytest.importorskip("matplotlib")
    path = tmp_path / "nowhere" / "out.json" if problem == "missing folder" else tmp_path
    models.BUILT.clear()
    args = [f"{TARGET}:counted_model", "--inputs", f"{TARGET}:near_tie_batch", "--autocast", "bf16"]
    assert main(["advise", *args, option, str(path)]) == 2
    assert models.BUILT == []  # refused before the model was built
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fp32scope advise: {option} {path}: ")
    assert ("does not exist" if problem == "missing folder" else "is a directory") in err
    # The control: the same command with a writable path builds the model and exits 0.
    assert main(["advise", *args, "--tolerance", "2e-2", option, str(tmp_path / "out")]) == 0
    assert models.BUILT == ["counted_model"]


def test_cli_held_out_margin_run_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "advice.json"
    args = [f"{TARGET}:NearTieMoE", "--inputs", f"{TARGET}:near_tie_batches", "--autocast", "bf16"]
    args += ["--held-out", f"{TARGET}:held_out_batches", "--margin", "2", "--run", f"{TARGET}:sample"]
    args += ["--tolerance", "2e-2", "--report", str(report)]
    assert main(["advise", *args]) == 0
    printed = capsys.readouterr().out
    assert "on 3 held-out batch(es)" in printed
    assert "(margin 2)" in printed
    advice = fp32scope.Fp32Advice.from_json(report.read_text())
    assert advice.margin == 2.0
    assert len(advice.batch_errors["held_out"]) == 3
    assert advice.met
    assert advice.policy == {"router": KEPT}
    policy = json.loads(report.read_text())["policy"]
    model = models.NearTieMoE()
    fast = fp32scope.current_fp32_precision()
    held_out = models.held_out_batches()
    # Measured here through the sampling loop, as --run ran it: the held-out errors are the report's.
    assert measured(model, held_out, policy, fast=fast, dtype=BF16, call=models.sample) == pytest.approx(
        advice.held_out_error, rel=1e-6
    )


def test_cli_held_out_miss_exits_1_naming_the_batch(capsys: pytest.CaptureFixture[str]) -> None:
    args = [f"{TARGET}:NearTieMoE", "--inputs", f"{TARGET}:quiet_batch", "--autocast", "bf16"]
    args += ["--held-out", f"{TARGET}:held_out_batches", "--tolerance", "2e-2"]
    assert main(["advise", *args]) == 1
    assert "why: the policy misses the tolerance 0.02 on 3 of 3 held-out batch(es) (held-out batch 0: " in (
        capsys.readouterr().out
    )


# -- --compile, --compile-option, --reference ----------------------------------------------------

COMPILED = "tests._support.advise_compiled"


@pytest.mark.compile
def test_cli_compile_reference_eager_keeps_the_drifting_blocks_eager(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, report = tmp_path / "policy.json", tmp_path / "advice.json"
    args = [f"{COMPILED}:rope_net", "--inputs", f"{COMPILED}:rope_batch", "--compile", "--reference", "eager"]
    args += ["--output", str(out), "--report", str(report)]
    control = compiled_error(compiled.rope_net(), [compiled.rope_batch()], {})
    if control <= 1e-3:
        pytest.skip(f"this CPU's Inductor does not drift: compiled whole, RopeNet is {control:.3g} from eager")
    assert main(["advise", *args]) == 0
    printed = capsys.readouterr().out
    assert "reference: the model run eagerly at the fast setting" in printed
    assert "compiled (torch.compile defaults): " in printed
    assert json.loads(out.read_text()) == {"rope": "eager", "sinusoid": "eager"}
    advice = fp32scope.Fp32Advice.from_json(report.read_text())
    assert advice.reference == "eager"
    assert advice.compile == {}
    assert compiled_error(compiled.rope_net(), [compiled.rope_batch()], advice.policy) <= 1e-3


@pytest.mark.compile
def test_cli_compile_options_reach_torch_compile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[bool, dict[str, Any]]] = []
    real = torch.compile

    @functools.wraps(real)  # its signature is torch.compile's: advise checks the options against it
    def counted(module: torch.nn.Module, **options: Any) -> Any:
        seen.append((isinstance(module, torch.nn.Module), options))  # the model whole, or a node's forward
        return real(module, **options)

    monkeypatch.setattr(torch, "compile", counted)
    report = tmp_path / "advice.json"
    args = [f"{TARGET}:NearTieMoE", "--inputs", f"{TARGET}:near_tie_batches", "--autocast", "bf16"]
    args += ["--tolerance", "2e-2", "--compile-option", "backend=aot_eager", "--compile-option", "fullgraph=true"]
    assert main(["advise", *args, "--report", str(report)]) == 0
    assert "compiled (torch.compile backend='aot_eager', fullgraph=True): " in capsys.readouterr().out
    # Whole-model compiles get every option; a node compiled alone may break its graph.
    whole = [options for is_model, options in seen if is_model]
    alone = [options for is_model, options in seen if not is_model]
    assert whole
    assert all(options == {"backend": "aot_eager", "fullgraph": True} for options in whole)
    assert alone
    assert all(options == {"backend": "aot_eager"} for options in alone)
    advice = fp32scope.Fp32Advice.from_json(report.read_text())
    assert advice.compile == {"backend": "aot_eager", "fullgraph": True}
    assert advice.policy == {"router": {**KEPT, "eager": True}}  # the full float32 reference: eager regions
