"""``Fp32Advice``'s table, chart, JSON and progress line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fp32scope
from tests._support import advise_models as models

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
