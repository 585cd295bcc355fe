"""``Fp32Advice``'s table, chart, JSON and progress line."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import fp32scope
from fp32scope import scope_modules, unscope_modules
from tests._support import advise_models as models
from tests._support.common import FULL

KEPT = {"matmul": "highest", "cudnn_allow_tf32": False}
BF16 = torch.bfloat16


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


# -- JSON -----------------------------------------------------------------------------------


def test_the_whole_advice_goes_through_json_and_its_policy_into_scope_modules() -> None:
    model = models.NearTieMoE()
    advice = fp32scope.advise(
        model,
        models.near_tie_batches(),
        held_out=models.held_out_batches(),
        autocast=BF16,
        tolerance=models.ROUTER_TOLERANCE,
    )
    assert advice.policy  # the control: a policy, measured sensitivities
    text = advice.to_json()
    document = json.loads(text)
    for field in ("policy", "autocast", "tolerance", "margin", "met", "reason", "error", "fast_error", "noise"):
        assert field in document
    assert document["held_out_error"] == advice.held_out_error
    assert document["batch_errors"] == {k: list(v) for k, v in advice.batch_errors.items()}
    assert document["torch_version"] == torch.__version__
    assert [n["name"] for n in document["nodes"]] == [n.name for n in advice.nodes]
    back = fp32scope.Fp32Advice.from_json(text)
    assert back == advice
    try:
        assert scope_modules(model, document["policy"], autocast=document["autocast"]) == {"router": FULL}
    finally:
        unscope_modules(model)


def test_json_is_strict_a_nan_is_null_and_an_infinity_a_string() -> None:
    advice = fp32scope.advise(models.NearTieMoE(), models.near_tie_batch(), autocast=BF16, tolerance=10.0)
    assert all(math.isnan(n.sensitivity) for n in advice.nodes)  # the control: not measured
    advice = dataclasses.replace(advice, fast_error=math.inf)
    text = advice.to_json()
    document = json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert {n["sensitivity"] for n in document["nodes"]} == {None}
    assert document["fast_error"] == "inf"
    back = fp32scope.Fp32Advice.from_json(text)
    assert back.to_json() == text  # equal, a nan to a nan
    assert back.fast_error == math.inf


def test_from_json_refuses_text_that_is_not_an_advice() -> None:
    with pytest.raises(ValueError, match=r"not an advice written by Fp32Advice\.to_json.*found None"):
        fp32scope.Fp32Advice.from_json(json.dumps({"router": KEPT}))


# -- the chart ------------------------------------------------------------------------------


def _advice(nodes: list[fp32scope.Fp32AdviceNode], policy: list[str]) -> fp32scope.Fp32Advice:
    return fp32scope.Fp32Advice(
        policy={name: dict(KEPT) for name in policy},
        autocast=False,
        error=1e-3,
        fast_error=0.5,
        tolerance=2e-3,
        met=True,
        runs=10,
        seconds=1.0,
        fast=fp32scope.current_fp32_precision(),
        autocast_dtype=BF16,
        nodes=tuple(nodes),
        margin=1.5,
    )


def test_the_chart_draws_not_measured_apart_from_zero_and_kept_through_a_parent_as_kept() -> None:
    pytest.importorskip("matplotlib")
    node = fp32scope.Fp32AdviceNode
    advice = _advice(
        [
            node("outer", "Outer", 10, 0.5, 0.3, True),
            node("outer.router", "Linear", 5, 0.1, 0.9, False),
            node("zero", "Linear", 5, 0.2, 0.0, False),
            node("unmeasured", "Linear", 5, 0.2, math.nan, False),
        ],
        ["outer"],
    )
    fig = advice._figure()
    try:
        left, right = fig.axes
        labels = [t.get_text() for t in left.get_yticklabels()]
        bars = dict(zip(labels, left.patches, strict=True))
        kept, inside, fast = (
            bars[n].get_facecolor() for n in ["outer (Outer)", "outer.router (Linear)", "zero (Linear)"]
        )
        assert inside != fast  # a node inside a kept one is not drawn as a fast one ...
        assert inside[:3] != kept[:3]  # ... nor as a node of the policy: its own color, in the legend
        assert "kept (inside a kept node)" in [t.get_text() for t in fig.legends[0].get_texts()]
        unmeasured = bars["unmeasured (Linear)"]
        assert unmeasured.get_hatch() == "//"
        assert unmeasured.get_facecolor()[3] == 0.0  # hollow: not a value
        assert bars["zero (Linear)"].get_hatch() is None
        texts = [t.get_text() for t in left.texts]
        assert "not measured" in texts
        assert " 0" in texts  # a measured zero, said as such
        shares = {label: p.get_width() for label, p in zip(labels, right.patches, strict=True)}
        assert shares["outer (Outer)"] == pytest.approx(50.0)  # the FLOP share beside the sensitivity
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_the_chart_of_many_nodes_draws_the_most_sensitive_and_one_line_for_the_rest(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    node = fp32scope.Fp32AdviceNode
    nodes = [
        node(f"transformer.h.{i // 8}.block.part{i % 8}", "Linear", 1, 1 / 116, (i + 1) * 1e-5, False)
        for i in range(116)
    ]
    nodes[3] = nodes[3]._replace(kept=True)  # kept but not among the most sensitive: drawn all the same
    advice = _advice(nodes, [nodes[3].name])
    fig = advice._figure()
    try:
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert len(labels) == 41
    assert labels[0] == f"{nodes[3].name} (Linear)"
    assert labels[1] == f"{nodes[115].name} (Linear)"  # then the most sensitive
    assert labels[-1] == f"... 76 more nodes, each at most {nodes[76].sensitivity:.2g}, 66% of FLOPs together"
    assert all(label.endswith("(Linear)") for label in labels[:-1])  # whole names, never cut
    advice.plot(tmp_path / "many.png")
    assert (tmp_path / "many.png").read_bytes()[:4] == b"\x89PNG"
