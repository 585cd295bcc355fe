"""``advise(..., compile=..., reference="eager")`` on a real client: diffusers' tiny FLUX transformer in bf16.

The model is ``FluxTransformer2DModel`` built from a tiny config (one double-stream block,
one single-stream block, random weights, no download), in bf16, compiled whole with
Inductor and ``fullgraph=True``: ``examples/flux_advise_compile.py``, whose ``main()`` runs
once here, in this process (a module-scoped fixture: Inductor compiles C++ on the CPU, and
one advise run serves every test of its result), and returns the figures it prints. Its
control, measured by the example's own compile and error (relative L2 of the output, as
advise measures it, in code of its own): compiled whole, the model drifts from the same
model run eagerly (skipped, with the figures, on a CPU where some batch does not). The
tolerance is derived from that control: a tenth of its smallest drift over the calibration
and held-out batches, an order of magnitude under the drift on every batch. What the
advised policy promises is measured there too: scoped with it (every kept node an
``"eager"`` in-graph region) and compiled whole, the model is within the tolerance of
eager on the held-out batches (and the calibration ones), in one graph with no graph break.

The candidates are restricted with advise's own ``candidates=``: the rotary and timestep
embeddings, each transformer block and the output norm (5 nodes). Every submodule (60
candidates) takes 13 whole-model compiles and 60 node compiles, about 80 s on two cores:
too slow for the suite (the how-to gives that run's figures).
"""

from __future__ import annotations

import contextlib
import io
import math
import runpy
from typing import Any, NamedTuple

import pytest
import torch

import fp32scope
from fp32scope import scope_modules, scoped_modules, unscope_modules
from tests._support.examples import EXAMPLES

#: The example advises on its first two batches and holds out the other two.
CALIBRATION = 2


def _diffusers_missing() -> str | None:
    # Not installed on Python 3.10; diffusers 0.42 does not import on torch 2.4 (it uses torch.accelerator).
    try:
        import diffusers  # noqa: F401
    except Exception as error:  # ImportError, or an AttributeError of an old torch
        return f"diffusers does not import here: {type(error).__name__}: {error}"
    return None


class Found(NamedTuple):
    """The example's namespace, what its ``main()`` printed and returned, whether advise gave the model back bare."""

    example: dict[str, Any]
    out: str
    figures: Any  # the example's Figures: plain (a Drift), tolerance, advice, advised (a Drift)
    bare: list[bool]  # per advise call: no scoped module left in the model it returned from


@pytest.fixture(scope="module")
def found() -> Found:
    reason = _diffusers_missing()
    if reason is not None:
        pytest.skip(reason)
    example = runpy.run_path(str(EXAMPLES / "flux_advise_compile.py"))  # not as __main__: main() is not called
    advise, bare = fp32scope.advise, []

    def advise_and_look(model: torch.nn.Module, *args: Any, **kwargs: Any) -> fp32scope.Fp32Advice:
        advice = advise(model, *args, **kwargs)
        bare.append(not scoped_modules(model))
        return advice

    out = io.StringIO()
    torch.compiler.reset()
    try:
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
            patch.setattr(fp32scope, "advise", advise_and_look)  # the example calls fp32scope.advise
            figures = example["main"]()
    except SystemExit as stop:  # the plain compile does not drift on some batch: no tolerance under it
        pytest.skip(f"{stop}\n{out.getvalue()}")
    finally:
        torch.compiler.reset()
    return Found(example, out.getvalue(), figures, bare)


@pytest.mark.compile
def test_the_control_compiled_whole_the_plain_model_drifts_as_advise_measures(found: Found) -> None:
    plain, tolerance, advice = found.figures.plain, found.figures.tolerance, found.figures.advice
    assert plain.graph_breaks == 0
    assert plain.graphs == 1
    assert all(e > tolerance for e in plain.relative)
    # advise's "every node compiled" run is the example's compile: its error is the example's, on the calibration
    # batches (the first CALIBRATION of the four).
    assert math.isclose(advice.fast_error, max(plain.relative[:CALIBRATION]), rel_tol=1e-9)


@pytest.mark.compile
def test_compiled_whole_with_the_policy_the_model_is_within_the_tolerance_of_eager_on_held_out_batches(
    found: Found,
) -> None:
    advised, tolerance, advice = found.figures.advised, found.figures.tolerance, found.figures.advice
    held_out = advised.relative[CALIBRATION:]
    assert len(held_out) == 2
    assert max(held_out) <= tolerance
    assert max(advised.relative) <= tolerance  # the calibration batches too
    assert advice.met
    assert advice.held_out_error is not None
    assert advice.held_out_error <= tolerance
    assert math.isclose(advice.held_out_error, max(held_out), rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.compile
def test_with_the_policy_the_model_compiles_to_one_graph_with_no_graph_break(found: Found) -> None:
    assert found.figures.advised.graph_breaks == 0
    assert found.figures.advised.graphs == 1


@pytest.mark.compile
def test_every_kept_node_is_an_eager_region_among_the_candidates(found: Found) -> None:
    advice = found.figures.advice
    assert found.bare == [True]  # advise gave the model back bare
    assert advice.policy
    assert set(advice.policy.values()) == {"eager"}
    assert advice.reference == "eager"
    assert advice.compile == {"fullgraph": True}
    names = [n.name for n in advice.nodes]
    assert set(advice.policy) <= set(names)
    assert [n.name for n in advice.nodes if n.kept] == list(advice.policy)
    model = found.example["FluxTransformer2DModel"](**found.example["CONFIG"])
    scope_modules(model, advice.policy, in_graph=True)
    try:
        for name in advice.policy:
            assert isinstance(model.get_submodule(name), fp32scope.Fp32ScopedModule)
    finally:
        unscope_modules(model)


@pytest.mark.compile
def test_advise_reports_its_compiles_within_the_bound(found: Found) -> None:
    advice = found.figures.advice
    n, k = len(advice.nodes), len(advice.policy)
    assert n == len(found.example["CANDIDATES"]) + 1  # the pattern selects the two blocks
    assert advice.node_compiles == n  # one per candidate, compiled alone
    assert 2 <= advice.compiles <= 2 * math.log2(n) + k + 4
    assert 0 < advice.compile_seconds <= advice.seconds


@pytest.mark.compile
def test_the_example_prints_the_drift_before_and_after(found: Found) -> None:
    # What a user reads: the figures as the example prints them, the same as those it returned.
    figures = dict(line.split(": ", 1) for line in found.out.splitlines() if ": " in line)
    tolerance = float(figures["tolerance"])
    before = [float(e) for e in figures["plain compile, relative error per batch"].split()]
    after = [float(e) for e in figures["advised policy, relative error per batch"].split()]
    assert len(before) == len(after) == 4
    assert min(before) > tolerance
    assert max(after) <= tolerance
    assert figures["plain compile, graphs and graph breaks"] == "1 0"
    assert figures["advised policy, graphs and graph breaks"] == "1 0"
    assert figures["policy"] == str(found.figures.advice.policy)
    assert tolerance == pytest.approx(found.figures.tolerance, rel=1e-2)  # printed to 3 significant figures
