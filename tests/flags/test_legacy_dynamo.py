"""Dynamo's "medium" -> "high" on torch <= 2.8, and the scope that tells it from the wrapped code's writes.

Before torch 2.9 every frame Dynamo converts leaves "high" behind a "medium", also inside a
scope (``fp32scope._compat.DYNAMO_RESETS_MEDIUM``). There a scope whose matmul field is
"medium" or None is a ``_LegacyDynamoScope``: a compile inside a "medium" scope is not blamed
on the wrapped code, and a scope that leaves the matmul field alone puts the "medium" it found
back. The tests compile with ``backend="eager"`` (Dynamo alone, no C compiler) and call the
scope eagerly around the compiled code, so that the mutation run, which leaves out the tests
marked ``compile``, runs them: ``nox -s mutation-2.4.1`` mutates that class on a torch where it
runs. On newer releases they check that nothing of it is needed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fp32scope import (
    Fp32FlagsChangedWarning,
    Fp32Precision,
    Fp32ScopedModule,
    _compat,
    set_process_default,
    trace,
    with_fp32_precision,
)
from fp32scope._flags import torch_flags as _flags
from fp32scope._flags.dynamo_exclude import dynamo_resets_medium
from fp32scope._flags.hooks import open_ranges

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_the_medium_reset_fact_is_what_an_unwrapped_compile_does() -> None:
    found = dynamo_resets_medium()
    torch.set_float32_matmul_precision("medium")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    torch.compile(fn, backend="eager")(torch.ones(2))
    assert found is (torch.get_float32_matmul_precision() != "medium")
    # Observed: 2.4.1 and 2.8.0 reset; 2.10.0, 2.13.0, 2.14.1 and 2.15.0 do not (the docs say so).
    assert found is _compat.DYNAMO_RESETS_MEDIUM


@pytest.mark.parametrize("cudnn", [None, False, True])
@pytest.mark.parametrize("default", ["highest", "high", "medium"])
def test_a_medium_node_compiling_in_its_scope_is_not_blamed_and_restores_exactly(
    default: str, cudnn: bool | None
) -> None:
    # torch 2.4 and 2.8 warned "The code inside an fp32_precision_scope around 'Linear'
    # changed the float32 precision flags" at the first call: Dynamo's own reset.
    torch.set_float32_matmul_precision(default)
    before = _flags.save_raw_state()
    node = Fp32ScopedModule(torch.compile(torch.nn.Linear(4, 4), backend="eager"), Fp32Precision("medium", cudnn))
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp32FlagsChangedWarning)
        with torch.no_grad():
            node(torch.randn(2, 4))  # compiles
            node(torch.randn(3, 4))  # recompiles (a new shape), on torch <= 2.8 a reset again
            node(torch.randn(3, 4))
    assert _flags.save_raw_state() == before


def test_a_medium_scope_still_warns_about_the_wrapped_code_changing_the_flags() -> None:
    # The control: only a reset during a Dynamo compile is torch's; this one is the code's.
    @with_fp32_precision(Fp32Precision("medium"))
    def sets_high() -> None:
        torch.set_float32_matmul_precision("high")

    torch.set_float32_matmul_precision("highest")
    with pytest.warns(Fp32FlagsChangedWarning, match="around 'test_a_medium_scope_still_warns"):
        sets_high()
    assert torch.get_float32_matmul_precision() == "highest"


def test_a_cudnn_only_node_leaves_a_medium_default_as_it_found_it() -> None:
    # torch 2.4 and 2.8: the node's compile turned the process's "medium" into "high" for
    # good, although the node's scope is about cuDNN only.
    set_process_default(Fp32Precision("medium", True))
    before = _flags.save_raw_state()
    node = Fp32ScopedModule(torch.compile(torch.nn.Linear(4, 4), backend="eager"), Fp32Precision(None, False))
    with torch.no_grad():
        node(torch.randn(2, 4))
    assert _flags.save_raw_state() == before
    assert torch.get_float32_matmul_precision() == "medium"


@pytest.mark.parametrize("cudnn", [None, False, True])
def test_a_medium_node_compiling_inside_a_trace_is_traced_as_running_in_its_precision(cudnn: bool | None) -> None:
    # Dynamo's reset is torch's, not the node's: the event keeps the flags the node ran
    # in, and the exit closes it (nothing is left open for a later scope's exit).
    torch.set_float32_matmul_precision("highest")
    before = _flags.save_raw_state()
    precision = Fp32Precision("medium", cudnn)
    node = Fp32ScopedModule(torch.compile(torch.nn.Linear(4, 4), backend="eager"), precision, name="head")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp32FlagsChangedWarning)
        with trace() as events, torch.no_grad():
            node(torch.randn(2, 4))  # compiles: on torch <= 2.8 a reset to "high"
    assert [(e.name, e.precision, e.matches) for e in events] == [("head", precision, True)]
    assert events[0].observed.matmul == "medium"
    assert open_ranges == []
    assert _flags.save_raw_state() == before


def test_a_medium_node_that_changes_the_flags_inside_a_trace_is_traced_as_not_matching() -> None:
    # The control: the node's own write is observed, as in any other scope.
    @with_fp32_precision(Fp32Precision("medium"), name="sets_high")
    def sets_high() -> None:
        torch.set_float32_matmul_precision("high")

    torch.set_float32_matmul_precision("highest")
    with pytest.warns(Fp32FlagsChangedWarning, match="around 'sets_high'"), trace() as events:
        sets_high()
    assert [(e.name, e.matches, e.observed.matmul) for e in events] == [("sets_high", False, "high")]
    assert open_ranges == []
    assert torch.get_float32_matmul_precision() == "highest"
