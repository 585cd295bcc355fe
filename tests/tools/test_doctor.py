"""``python -m fp32scope doctor``: mixed states reached with real torch writes, in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fp32scope.__main__ import main
from fp32scope._flags import torch_flags as _flags
from fp32scope._flags.dynamo_exclude import dynamo_resets_medium
from tests._support.common import ROOT

MATMUL = _flags.LEGACY_MATMUL
CUBLAS = _flags.LEGACY_CUBLAS
CUDNN = _flags.LEGACY_CUDNN

needs_new_api = pytest.mark.skipif(
    not _flags.HAS_NEW_API,
    reason=(
        f"torch {torch.__version__} has only the legacy API (the per-backend fp32_precision API came in "
        "torch 2.9): the two APIs cannot disagree, so there is no mixed state to diagnose"
    ),
)


def doctor(setup: str, *args: str) -> tuple[int, str]:
    """Run ``setup`` in a fresh interpreter, then the doctor's main; its exit status and stdout."""
    code = (
        textwrap.dedent(setup)
        + f"\nfrom fp32scope.__main__ import main\nraise SystemExit(main(['doctor', *{args!r}]))\n"
    )
    # The command is this interpreter running code built here from the tests' literals.
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, done.stdout


def doctor_json(setup: str) -> tuple[int, dict[str, Any]]:
    status, out = doctor(setup, "--json")
    data: dict[str, Any] = json.loads(out)
    return status, data


def test_fresh_process_is_consistent() -> None:
    status, data = doctor_json("")
    assert status == 0
    assert data["consistent"] is True
    assert data["problems"] == []
    assert data["fix"] is None
    assert data["torch_version"] == str(torch.__version__)
    assert data["has_new_api"] is _flags.HAS_NEW_API
    assert data["readings"][MATMUL] == "highest"
    assert data["cuda_available"] is torch.cuda.is_available()


@needs_new_api
def test_stale_legacy_matmul_and_raising_cublas_getter() -> None:
    # The example from torch's own error: the legacy matmul getter still says "high" while
    # cuBLAS runs in full fp32, and the legacy cuBLAS getter raises.
    status, data = doctor_json("""
        import torch
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    """)
    assert status == 1
    assert data["consistent"] is False
    assert data["readings"][MATMUL] == "high"
    assert data["readings"][CUBLAS] == _flags.RAISES
    messages = [p["message"] for p in data["problems"]]
    assert any(m.startswith(f"{CUBLAS} raises RuntimeError") for m in messages), messages
    assert any(
        f"{MATMUL} reads 'high' but torch.backends.cuda.matmul.fp32_precision reads 'ieee'" in m for m in messages
    ), messages
    assert {p["field"] for p in data["problems"]} == {"matmul"}
    assert "fp32scope.set_process_default(Fp32Precision('high', None))" in data["fix"]
    assert "torch.set_float32_matmul_precision('high')" in data["fix"]
    assert "Do not mix torch.backends.*.fp32_precision writes with the legacy API" in data["fix"]


@needs_new_api
def test_stale_without_any_raise() -> None:
    # No getter raises here: only comparing the two APIs shows that oneDNN runs in fp32.
    status, data = doctor_json("""
        import torch
        torch.set_float32_matmul_precision("high")
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    """)
    assert status == 1
    assert _flags.RAISES not in data["readings"].values()
    assert len(data["problems"]) == 1
    problem = data["problems"][0]
    assert problem["flags"] == [MATMUL, "torch.backends.mkldnn.matmul.fp32_precision"]
    assert "reads 'high' but torch.backends.mkldnn.matmul.fp32_precision reads 'ieee'" in problem["message"]


@needs_new_api
def test_raising_legacy_matmul_getter() -> None:
    status, data = doctor_json("""
        import torch
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    """)
    assert status == 1
    assert data["readings"][MATMUL] == _flags.RAISES
    assert data["problems"][0]["message"].startswith(f"{MATMUL} raises RuntimeError")
    # current_fp32_precision() reports the least precise setting in use: bf16 is "medium".
    assert data["effective"] == {"matmul": "medium", "cudnn_allow_tf32": True}
    assert "Fp32Precision('medium', None)" in data["fix"]


@needs_new_api
def test_cudnn_conv_and_rnn_disagree() -> None:
    status, out = doctor("""
        import torch
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    """)
    assert status == 1
    assert "MIXED: 1 problem(s):" in out
    assert f"{CUDNN} raises RuntimeError" in out
    assert "torch.backends.cudnn.conv.fp32_precision = 'ieee', torch.backends.cudnn.rnn.fp32_precision = 'tf32'" in out
    assert "fix: Call fp32scope.set_process_default(Fp32Precision(None, True))" in out
    assert "torch.backends.cudnn.allow_tf32 = True" in out


@needs_new_api
@pytest.mark.parametrize(
    ("mix", "fix"),
    [
        (
            'torch.set_float32_matmul_precision("high"); torch.backends.cuda.matmul.fp32_precision = "ieee"',
            'fp32scope.set_process_default(Fp32Precision("high", None))',
        ),
        ('torch.backends.mkldnn.matmul.fp32_precision = "bf16"', 'torch.set_float32_matmul_precision("medium")'),
        (
            'torch.backends.cudnn.conv.fp32_precision = "ieee"',
            "fp32scope.set_process_default(Fp32Precision(None, False))",
        ),
    ],
    ids=["matmul-set_process_default", "matmul-torch", "cudnn-set_process_default"],
)
def test_following_the_fix_makes_the_state_consistent(mix: str, fix: str) -> None:
    status, data = doctor_json(f"""
        import torch, fp32scope
        from fp32scope import Fp32Precision
        {mix}
        {fix}
    """)
    assert status == 0, data["problems"]
    assert data["consistent"] is True


def test_text_output_of_a_consistent_process(capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_float32_matmul_precision("high")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}; precision APIs: " in out
    assert f"  {MATMUL}  " in out
    assert "'high'" in out
    assert "consistent: the legacy and new readings agree and no getter raises." in out
    assert ("CUDA: not available" in out) is not torch.cuda.is_available()


def test_doctor_changes_no_flag() -> None:
    torch.set_float32_matmul_precision("medium")
    before = _flags.save_raw_state()
    readings = _flags.read_all()
    assert main(["doctor", "--json"]) == 0
    assert _flags.save_raw_state() == before
    assert _flags.read_all() == readings


def test_command_is_required() -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


@needs_new_api
def test_import_option_checks_what_a_module_sets_at_import(tmp_path: Path) -> None:
    (tmp_path / "engine_config.py").write_text(
        'import torch\ntorch.set_float32_matmul_precision("high")\ntorch.backends.cuda.matmul.fp32_precision = "ieee"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "fp32scope", "doctor", "--import", "engine_config", "--json"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert data["readings"][CUBLAS] == _flags.RAISES
    assert data["consistent"] is False


def test_doctor_says_what_a_compile_does_to_medium(capsys: pytest.CaptureFixture[str]) -> None:
    # Found by compiling a probe (torch 2.4 to 2.8 reset "medium" to "high"); the flags
    # are as they were afterwards (test_doctor_changes_no_flag).
    resets = dynamo_resets_medium()
    assert resets is not None
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dynamo_resets_medium"] is resets
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    if resets:
        assert "torch.compile: RESETS 'medium' to 'high'" in out
        assert "call fp32scope.set_process_default again after warm-up" in out
    else:
        assert "torch.compile: keeps a 'medium' matmul precision while it compiles" in out


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (None, "ModuleNotFoundError: No module named 'nosuchmod'"),
        ("raise RuntimeError('bad config\\nsecond line')", "RuntimeError: bad config second line"),
        ("def broken(:\n", "SyntaxError: "),
    ],
    ids=["missing", "raises", "syntax"],
)
def test_a_module_that_does_not_import_is_one_line_and_exit_status_2(
    tmp_path: Path, source: str | None, reason: str
) -> None:
    # Exit status 2, not 1: a CI job that runs the doctor can tell a typo in its command
    # from a mixed state.
    if source is not None:
        (tmp_path / "nosuchmod.py").write_text(source)
    done = subprocess.run(
        [sys.executable, "-m", "fp32scope", "doctor", "--import", "nosuchmod"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("fp32scope doctor: --import nosuchmod: the module does not import (")
    assert reason in lines[0]


# -- doctor --model -------------------------------------------------------------------

MODEL_FILE = """
import torch
from fp32scope import Fp32Precision, Fp32ScopedModule, node_fp32_precision


class Head(torch.nn.Linear):
    float32_matmul_precision = "highest"
    cudnn_allow_tf32 = False


class Norm(torch.nn.LayerNorm):
    float32_matmul_precision = "highest"


class Model(torch.nn.Module):
    def __init__(self, scope_head=True, scope_norm=False):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), Norm(4))
        head = Head(4, 4)
        if scope_head:
            head = Fp32ScopedModule(head, node_fp32_precision("head", head), name="head")
        self.head = head
        if scope_norm:
            self.body = Fp32ScopedModule(self.body, Fp32Precision("highest"), name="body")


def build():
    return Model(scope_norm=True)


def build_compiled():
    model = Model(scope_norm=True)
    model.head = Fp32ScopedModule(torch.compile(Head(4, 4)), Fp32Precision("highest", False), name="head")
    return torch.compile(model)


def wrong_precision():
    model = Model(scope_head=False, scope_norm=True)
    model.head = Fp32ScopedModule(Head(4, 4), Fp32Precision("highest", True), name="head")
    return model


class Bad(torch.nn.Linear):
    float32_matmul_precision = "fp32"


def invalid():
    return torch.nn.Sequential(Bad(2, 2))


unscoped = Model()
not_a_module = 42


class Zoo:
    built = build()


def fails():
    raise RuntimeError("no weights\\nhere")
"""


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "engine_model.py").write_text(MODEL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "engine_model"
    sys.modules.pop("engine_model", None)


def model_report(capsys: pytest.CaptureFixture[str], target: str) -> tuple[int, dict[str, Any]]:
    status = main(["doctor", "--json", "--model", target])
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return status, data["model"]


FULL_JSON = {"matmul": "highest", "cudnn_allow_tf32": False}


def test_model_with_every_declaring_module_scoped(capsys: pytest.CaptureFixture[str], engine: str) -> None:
    status, model = model_report(capsys, f"{engine}:build")
    assert status == 0
    assert model["ok"] is True
    assert [(n["path"], n["type"], n["runs_in"]) for n in model["scoped"]] == [
        ("body", "Sequential", {"matmul": "highest", "cudnn_allow_tf32": None}),
        ("head", "Head", FULL_JSON),
    ]
    assert [(n["path"], n["scoped_by"], n["problem"]) for n in model["declaring"]] == [
        ("body.1", "body", None),
        ("head", "head", None),
    ]
    assert model["findings"] == []
    assert main(["doctor", "--model", f"{engine}:build"]) == 0
    out = capsys.readouterr().out
    assert "model engine_model:build:\nscoped nodes (2):\n  body  highest  (Sequential)\n" in out
    assert "  head  highest/cudnn-fp32  (Head)\n" in out
    assert out.rstrip().endswith("ok: every module that declares a precision runs in it.")


def test_an_unscoped_declaring_module_is_a_finding(capsys: pytest.CaptureFixture[str], engine: str) -> None:
    status, model = model_report(capsys, f"{engine}:unscoped")
    assert status == 1
    assert model["ok"] is False
    assert [(n["path"], n["type"], n["declares"]) for n in model["findings"]] == [
        ("body.1", "Norm", {"matmul": "highest", "cudnn_allow_tf32": None}),
    ]
    assert model["findings"][0]["runs_in"] is None
    assert main(["doctor", "--model", f"{engine}:unscoped"]) == 1
    out = capsys.readouterr().out
    assert "FOUND 1 module(s) not running in the precision they declare:" in out
    assert (
        "  1. body.1 (Norm) declares highest but is in no scoped node (matmul)\n"
        "     wrap it: Fp32ScopedModule(module, node_fp32_precision('body.1', module))\n"
    ) in out


def test_a_scoped_node_with_another_precision_than_declared_is_a_finding(
    capsys: pytest.CaptureFixture[str], engine: str
) -> None:
    status, model = model_report(capsys, f"{engine}:wrong_precision")
    assert status == 1
    (finding,) = model["findings"]
    assert finding["path"] == "head"
    assert finding["scoped_by"] == "head"
    assert finding["problem"] == (
        "declares highest/cudnn-fp32 but scoped node 'head' applies highest/cudnn-tf32 (cudnn_allow_tf32)"
    )
    assert finding["fix"] == "wrap it: Fp32ScopedModule(module, node_fp32_precision('head', module))"


def test_an_invalid_declaration_is_a_finding(capsys: pytest.CaptureFixture[str], engine: str) -> None:
    status, model = model_report(capsys, f"{engine}:invalid")
    assert status == 1
    (finding,) = model["findings"]
    assert finding["path"] == "0"
    assert finding["problem"].startswith("invalid: float32_matmul_precision of node '0' must be one of")


@pytest.mark.compile
def test_a_compiled_model_is_read_through(capsys: pytest.CaptureFixture[str], engine: str) -> None:
    status, model = model_report(capsys, f"{engine}:build_compiled")
    assert status == 0
    assert [(n["path"], n["type"]) for n in model["scoped"]] == [("body", "Sequential"), ("head", "Head")]
    assert model["findings"] == []


@pytest.mark.parametrize("factory", ["build", "build_compiled", "wrong_precision", "unscoped"])
def test_the_scoped_nodes_are_those_scoped_modules_lists(
    capsys: pytest.CaptureFixture[str], engine: str, factory: str
) -> None:
    import importlib

    from fp32scope import scoped_modules

    built = getattr(importlib.import_module(engine), factory)
    model = built if isinstance(built, torch.nn.Module) else built()
    _, report = model_report(capsys, f"{engine}:{factory}")
    listed = {n["path"]: n["runs_in"] for n in report["scoped"]}
    expected = {name: precision._asdict() for name, precision in scoped_modules(model).items()}
    assert listed == expected


def test_a_model_object_and_a_class_are_accepted(capsys: pytest.CaptureFixture[str], engine: str) -> None:
    # A module attribute is used as it is; a class (callable, not a module) is called.
    status, model = model_report(capsys, f"{engine}:Model")
    assert status == 1
    assert [n["path"] for n in model["scoped"]] == ["head"]
    assert [n["path"] for n in model["findings"]] == ["body.1"]
    assert model["target"] == f"{engine}:Model"
    # A dotted attribute: an attribute of an attribute.
    status, model = model_report(capsys, f"{engine}:Zoo.built")
    assert status == 0
    assert [n["path"] for n in model["scoped"]] == ["body", "head"]
    assert main(["doctor", "--model", f"{engine}:Zoo.missing"]) == 2
    assert "engine_model has no attribute 'Zoo.missing' ('missing' is missing)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("engine_model", "expected MODULE:ATTR (for example engine.model:build_model); got 'engine_model'"),
        ("no_such_module:x", "the module does not import (ModuleNotFoundError: No module named 'no_such_module')"),
        ("engine_model:missing", "engine_model has no attribute 'missing'"),
        ("engine_model:fails", "calling fails without arguments failed (RuntimeError: no weights here)"),
        ("engine_model:not_a_module", "not_a_module is not a torch.nn.Module, nor a callable that returns one; got"),
    ],
    ids=["no-colon", "no-module", "no-attribute", "factory-fails", "not-a-module"],
)
def test_a_model_that_cannot_be_loaded_is_exit_status_2(
    capsys: pytest.CaptureFixture[str], engine: str, target: str, message: str
) -> None:
    assert engine == "engine_model"
    assert main(["doctor", "--model", target]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"fp32scope doctor: --model {target}: {message}")


def test_doctor_model_as_a_ci_job_runs_it(tmp_path: Path) -> None:
    (tmp_path / "engine_model.py").write_text(MODEL_FILE)
    done = subprocess.run(
        [sys.executable, "-m", "fp32scope", "doctor", "--model", "engine_model:unscoped"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "FOUND 1 module(s) not running in the precision they declare:" in done.stdout
