"""``python -m fp32scope demo``: nodes run with their precision, on the forward thread, without recompiling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fp32scope import Fp32Precision
from fp32scope.__main__ import main
from fp32scope._flags import torch_flags as _flags
from fp32scope._flags.dynamo_exclude import dynamo_resets_medium
from fp32scope._tools.demo import _TRACE_TITLE, NodeResult, run_demo
from tests._support.common import ROOT

HIGH = {"matmul": "high", "cudnn_allow_tf32": True}
MEDIUM = {"matmul": "medium", "cudnn_allow_tf32": True}
FULL = {"matmul": "highest", "cudnn_allow_tf32": False}


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    status = main(["demo", "--backend", "eager", "--json", *args])
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return status, data


def test_each_node_runs_with_its_precision_and_leaves_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_float32_matmul_precision("highest")
    readings = _flags.read_all()
    status, data = run_json(capsys)
    assert status == 0
    assert data["ok"] is True
    assert data["default"] == HIGH
    nodes = {node["name"]: node for node in data["nodes"]}
    assert list(nodes) == ["embed", "body", "head"]
    assert nodes["head"]["declared"] == FULL
    assert nodes["embed"]["declared"] is None
    assert [nodes[n]["ran_with"] for n in ("embed", "body", "head")] == [HIGH, HIGH, FULL]
    for node in nodes.values():
        assert node["before"] == HIGH
        assert node["after"] == HIGH
        assert node["graphs"] == 1
        assert node["recompiles"] == 0
        assert node["forward_thread"].startswith("fp32scope-forward")
        assert node["cuda_graph"] is False
    assert data["graph_breaks"] == 0
    # fp32scope.trace() of the first request: the scoped node's compiling call, in its precision.
    assert data["trace"] == [
        {
            "name": "head",
            "phase": "forward",
            "precision": FULL,
            "observed": FULL,
            "thread": nodes["head"]["forward_thread"],
        }
    ]
    # The demo restores the caller's flags.
    assert _flags.read_all() == readings


def test_medium_default_changes_the_default_nodes_but_not_the_fp32_one(capsys: pytest.CaptureFixture[str]) -> None:
    status, data = run_json(capsys, "--default", "medium", "--steps", "1")
    assert status == 0
    nodes = {node["name"]: node for node in data["nodes"]}
    assert [nodes[n]["ran_with"] for n in ("embed", "body", "head")] == [MEDIUM, MEDIUM, FULL]
    if not data["numeric_effect"]:
        assert all(node["max_abs_error"] is None for node in nodes.values())
        pytest.skip("'medium' (bf16 in oneDNN) changes no float32 result on this CPU")
    # The eager backend runs the same kernels as the eager module: under its full-fp32
    # scope the head's error is exactly the full-fp32 error, while the others' grows.
    assert nodes["head"]["max_abs_error"] == nodes["head"]["full_fp32_error"]
    for name in ("embed", "body"):
        assert nodes[name]["max_abs_error"] > nodes[name]["full_fp32_error"] > 0.0


COLUMNS = ["node", "declares", "ran with", "before call", "after call", "graphs", "recompiles"]
ERROR_COLUMNS = ["error vs float64", "same, in full fp32"]


def columns(header: str) -> list[str]:
    return [cell for cell in header.split("  ") if cell.strip()]


@pytest.mark.parametrize("default", ["high", "medium"])
def test_table(capsys: pytest.CaptureFixture[str], default: str) -> None:
    assert main(["demo", "--backend", "eager", "--steps", "1", "--default", default]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("node "))
    numeric_effect = "No error columns" not in text
    # The error columns appear only where the default changes results on this device, so a
    # column is never all "-", and each header says what it shows.
    assert [c.strip() for c in columns(lines[header])] == COLUMNS + (ERROR_COLUMNS if numeric_effect else [])
    rows = [lines[header + i].split() for i in (1, 2, 3)]
    assert [row[1] for row in rows] == ["nothing", "nothing", "highest/cudnn-fp32"]
    head = rows[2]
    assert head[:7] == [
        "head",
        "highest/cudnn-fp32",
        "highest/cudnn-fp32",
        f"{default}/cudnn-tf32",
        f"{default}/cudnn-tf32",
        "1",
        "0",
    ]
    if numeric_effect:
        assert all(len(row) == 9 and "-" not in row[7:] for row in rows), rows
        assert "'error vs float64': the largest difference between the node's output and a float64 copy" in text
    else:
        assert all(len(row) == 7 for row in rows)
    assert lines[-1] == "all nodes ok."
    traced = lines.index(_TRACE_TITLE)
    assert lines[traced + 1].split() == ["node", "phase", "precision", "observed", "match", "thread"]
    traced_rows = [line.split() for line in lines[traced + 2 :] if line.split()[:1] in (["embed"], ["body"], ["head"])]
    # Where Dynamo turns "medium" into "high" (torch < 2.9), the demo scopes the nodes that
    # declare nothing with the default too: they are traced, before the head.
    assert [row[0] for row in traced_rows][-1:] == ["head"]
    assert traced_rows[-1][:5] == ["head", "forward", "highest/cudnn-fp32", "highest/cudnn-fp32", "yes"]
    assert all(row[4] == "yes" for row in traced_rows)
    assert "fp32scope demo: 3 torch.compile'd nodes, backend 'eager', device cpu" in lines[0]


def test_problem_detection() -> None:
    expected = Fp32Precision("highest", False)
    good = NodeResult("n", expected, expected, ran_with=expected, forward_thread="fp32scope-forward_0")
    good.before = good.after = Fp32Precision("high", True)
    assert good.ok
    for change in (
        {"recompiles": 1},
        {"ran_with": Fp32Precision("high", True)},
        {"after": Fp32Precision("highest", True)},
        {"forward_thread": "MainThread"},
    ):
        bad = NodeResult(**{**good.__dict__, **change})
        assert not bad.ok, change


def test_bad_requests(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--backend", "eager", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--backend", "no-such-backend"]) == 2
    assert "unknown --backend 'no-such-backend'; torch.compile knows " in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["demo", "--device", "cuda"]) == 2
        assert "torch.cuda.is_available() is False" in capsys.readouterr().err
    with pytest.raises(ValueError, match="default must be one of"):
        run_demo(default="HIGH", backend="eager")


@pytest.mark.compile
def test_inductor_demo_as_nox_runs_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fp32scope", "demo", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["backend"] == "inductor"
    assert data["ok"] is True
    assert [node["recompiles"] for node in data["nodes"]] == [0, 0, 0]
    assert [node["ran_with"] for node in data["nodes"]] == [HIGH, HIGH, FULL]
    assert data["warmup_s"] < 60


def test_a_medium_default_says_what_dynamo_does_to_it(capsys: pytest.CaptureFixture[str]) -> None:
    # torch 2.4 to 2.8 turn "medium" into "high" at every Dynamo compile. There the demo
    # scopes the nodes that declare nothing with the default, and says why; elsewhere it
    # leaves them unscoped and says nothing about it.
    resets = dynamo_resets_medium()
    status, data = run_json(capsys, "--default", "medium", "--steps", "1")
    assert status == 0
    assert data["dynamo_resets_medium"] is resets
    assert data["nodes_scoped_with_default"] is bool(resets)
    assert main(["demo", "--backend", "eager", "--default", "medium", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    explained = "every torch.compile (Dynamo) compile turns a 'medium' default into 'high'" in out
    assert explained is bool(resets), out
    assert out.rstrip().endswith("all nodes ok.")
    # Under the other defaults the probe is not needed and not run.
    status, data = run_json(capsys, "--steps", "1")
    assert data["dynamo_resets_medium"] is None
    assert data["nodes_scoped_with_default"] is False


def test_a_policy_file_decides_the_nodes_precisions(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"re:embed|body": {"matmul": "highest", "cudnn_allow_tf32": False}}))
    status, data = run_json(capsys, "--steps", "1", "--policy", str(policy))
    assert status == 0
    nodes = {node["name"]: node for node in data["nodes"]}
    assert nodes["embed"]["declared"] == FULL
    assert nodes["head"]["declared"] is None  # the policy, not the class, decides
    assert [nodes[n]["ran_with"] for n in ("embed", "body", "head")] == [FULL, FULL, HIGH]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"tail": "highest"}', "policy selector(s) 'tail' match no submodule"),
        ('{"body.fc2": "highest"}', "selects 'body.fc2' inside one"),
        ('{"head": "fast"}', "policy['head'] must be one of"),
        ("not json", "Expecting value"),
    ],
)
def test_a_bad_policy_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, message: str
) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(content)
    assert main(["demo", "--backend", "eager", "--policy", str(policy)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert str(policy) in err
