"""``fp32scope.advise`` leaves the model and the process as it found them, and refuses bad arguments before any run."""

from __future__ import annotations

import math
from typing import Any, cast

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import fp32scope
from fp32scope import Fp32Precision, scope_modules
from tests._support import advise_models as models
from tests._support.advise_checks import Snapshot, calls_of
from tests._support.common import FULL, BoomError

KEPT = {"matmul": "highest", "cudnn_allow_tf32": False}
BF16 = torch.bfloat16


# -- nothing left behind --------------------------------------------------------------------


@pytest.fixture
def used_model() -> torch.nn.Module:
    """The router model with gradients set, mixed training flags, a "high" default and an RNG state."""
    model = models.NearTieMoE()
    model.train()
    model.experts[1].eval()
    models.near_tie_loss(model(models.near_tie_batch())).backward()  # type: ignore[no-untyped-call]
    fp32scope.set_process_default(Fp32Precision("high", True))  # the conftest fixture puts the flags back
    return model


def test_the_model_and_the_process_come_back_as_they_were(used_model: torch.nn.Module) -> None:
    snapshot = Snapshot(used_model)
    advice = fp32scope.advise(
        used_model,
        models.near_tie_batches(),
        autocast=BF16,
        tolerance=models.ROUTER_TOLERANCE,
        loss=models.near_tie_loss,
    )
    assert advice.fast == Fp32Precision("high", True)  # the process default at the call
    assert advice.policy  # the search scoped and unscoped the model
    snapshot.assert_unchanged()


def test_the_callers_autocast_is_left_on_and_kept_out_of_the_runs() -> None:
    model, batch = models.NearTieMoE(), models.near_tie_batch()
    outside = fp32scope.advise(model, batch, fast="high", tolerance=1e-3)
    assert outside.fast_error == 0.0  # the control: no autocast, "high" is exact on a CPU
    with torch.autocast("cpu", dtype=torch.float16):
        snapshot = Snapshot(model)
        inside = fp32scope.advise(model, batch, fast="high", tolerance=1e-3)
        snapshot.assert_unchanged()
    assert inside.fast_error == 0.0
    assert inside.policy == {}


@pytest.mark.parametrize("fail_at", [1, 2, 5, 9], ids=["reference", "reference again", "sensitivity", "policy"])
def test_an_error_in_the_model_propagates_and_leaves_nothing_behind(used_model: torch.nn.Module, fail_at: int) -> None:
    # One batch: runs 1 and 2 are the reference, 3 every node fast, 4 to 8 one per candidate, 9 the first policy.
    calls = calls_of(used_model)
    snapshot = Snapshot(used_model)

    def boom(*_: Any) -> None:
        if len(calls) == fail_at:
            msg = f"the model fails at call {fail_at}"
            raise BoomError(msg)

    used_model.register_forward_pre_hook(boom)
    with pytest.raises(BoomError, match=f"call {fail_at}") as raised:
        fp32scope.advise(
            used_model,
            models.near_tie_batch(),
            autocast=BF16,
            tolerance=models.ROUTER_TOLERANCE,
            loss=models.near_tie_loss,
        )
    assert raised.traceback[-1].name == "boom"  # the model's own frame, not a re-raise
    snapshot.assert_unchanged()


BAD_ARGUMENTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"model": lambda x: x}, TypeError, r"torch\.nn\.Module"),
    ({"inputs": 3}, TypeError, r"inputs"),
    ({"inputs": []}, ValueError, r"inputs"),
    ({"fast": "fastest"}, ValueError, r"fast.*'fastest'"),
    ({"fast": 3}, TypeError, r"fast"),
    ({"autocast": "bf16"}, TypeError, r"autocast"),
    ({"autocast": torch.float32}, ValueError, r"autocast"),
    ({"tolerance": 0.0}, ValueError, r"tolerance"),
    ({"tolerance": -1e-3}, ValueError, r"tolerance"),
    ({"tolerance": math.nan}, ValueError, r"tolerance"),
    ({"tolerance": "1e-3"}, TypeError, r"tolerance"),
    ({"loss": 3}, TypeError, r"loss"),
    ({"metric": "l2"}, TypeError, r"metric"),
    ({"candidates": ["nope"]}, ValueError, r"'nope'"),
    ({"candidates": [3]}, TypeError, r"selector"),
    ({"candidates": "router"}, TypeError, r"candidates"),
    ({"progress": "yes"}, TypeError, r"progress"),
    ({"candidates": []}, ValueError, r"candidates is an empty list.*give None"),
    ({"margin": 0.5}, ValueError, r"margin must be a finite number >= 1.*0\.5"),
    ({"margin": math.inf}, ValueError, r"margin"),
    ({"margin": "2"}, TypeError, r"margin must be a number"),
    ({"held_out": []}, ValueError, r"held_out is an empty list"),
    ({"held_out": 3}, TypeError, r"held_out"),
    ({"held_out": [torch.zeros(2, 32, device="meta")]}, ValueError, r"held_out\[0\].*meta device"),
    ({"inputs": torch.zeros(2, 32, device="meta")}, ValueError, r"inputs\[0\].*meta device"),
    ({"run": "sample"}, TypeError, r"run must be None or a callable run\(model"),
    ({"autocast": None}, ValueError, r"fast setting is the reference itself.*fast='high'"),
    ({"autocast": None, "fast": "highest"}, ValueError, r"reference itself"),
]


def _argument_id(bad: dict[str, Any]) -> str:
    # The same on every pytest-xdist worker: a function's repr holds its address.
    return ",".join(f"{k}={'<function>' if callable(v) else repr(v)}" for k, v in bad.items())


@pytest.mark.parametrize(("bad", "error", "match"), BAD_ARGUMENTS, ids=[_argument_id(b) for b, _, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_before_the_model_runs(bad: dict[str, Any], error: type, match: str) -> None:
    model = models.NearTieMoE()
    calls = calls_of(model)
    arguments: dict[str, Any] = {"model": model, "inputs": models.near_tie_batch(), "autocast": BF16, **bad}
    with pytest.raises(error, match=match):
        fp32scope.advise(arguments.pop("model"), arguments.pop("inputs"), **arguments)
    assert calls == []


def test_a_model_scoped_already_is_refused() -> None:
    model = models.NearTieMoE()
    calls = calls_of(model)
    scope_modules(model, {"router": "highest"})
    with pytest.raises(ValueError, match="unscope_modules"):
        fp32scope.advise(model, models.near_tie_batch())
    assert calls == []


def test_a_scoped_module_given_as_the_model_is_refused() -> None:
    model = models.NearTieMoE()
    calls = calls_of(model)
    wrapped = fp32scope.Fp32ScopedModule(model, FULL)
    with pytest.raises(ValueError, match=r"model is an Fp32ScopedModule around a NearTieMoE.*refuses scoped ones"):
        fp32scope.advise(cast("torch.nn.Module", wrapped), models.near_tie_batch(), autocast=BF16)
    assert calls == []


def test_a_model_on_the_meta_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"meta device \(router\.weight, .*to_empty"):
        fp32scope.advise(models.meta_model(), models.near_tie_batch(), autocast=BF16)


# -- buffers, parameters, training flags: as found after every run --------------------------


def test_batchnorm_running_statistics_in_train_mode_are_left_as_found() -> None:
    model = models.BatchNormNet().train()
    model(models.near_tie_batch())  # running statistics away from their initial values
    snapshot = Snapshot(model)
    before = model.state_dict()["norm.num_batches_tracked"].item()
    advice = fp32scope.advise(
        model, models.near_tie_batches(), autocast=BF16, tolerance=models.ROUTER_TOLERANCE, loss=models.mean_square
    )
    assert advice.runs > 10  # the control: the model ran many times in train mode
    assert model.state_dict()["norm.num_batches_tracked"].item() == before
    snapshot.assert_unchanged()


def test_a_buffer_the_forward_writes_is_put_back_after_every_run() -> None:
    # Without the put-back, each run would see another count: the two reference runs would
    # differ (noise), and the fast errors would mix precision with the count.
    model = models.Stateful()
    snapshot = Snapshot(model)
    advice = fp32scope.advise(model, models.near_tie_batch(), autocast=BF16, tolerance=models.ROUTER_TOLERANCE)
    assert advice.noise == 0.0
    assert advice.policy == {"moe.router": KEPT}
    assert model.state_dict()["calls"].item() == 0.0
    snapshot.assert_unchanged()


@pytest.mark.parametrize("adds", [False, True], ids=["replaces", "replaces and adds"])
def test_a_buffer_the_forward_replaces_is_put_back_after_every_run(adds: bool) -> None:
    model = models.Reassigns(adds=adds)
    snapshot = Snapshot(model)
    advice = fp32scope.advise(model, models.near_tie_batch(), autocast=BF16, tolerance=models.ROUTER_TOLERANCE)
    assert advice.noise == 0.0
    assert not hasattr(model, "added")
    snapshot.assert_unchanged()


def test_a_parameter_the_forward_writes_is_put_back_after_every_run() -> None:
    model = models.WritesItsWeight()
    snapshot = Snapshot(model)
    advice = fp32scope.advise(model, models.near_tie_batch(), autocast=BF16, tolerance=models.ROUTER_TOLERANCE)
    assert advice.noise == 0.0  # each run starts from the same bias
    snapshot.assert_unchanged()


@settings(max_examples=12, deadline=None)
@given(
    training=st.lists(st.booleans(), min_size=3, max_size=3),
    fail_at=st.one_of(st.none(), st.integers(min_value=1, max_value=12)),
    with_loss=st.booleans(),
    grads=st.booleans(),
)
def test_any_mix_of_modes_and_failures_leaves_the_model_as_found(
    training: list[bool], fail_at: int | None, with_loss: bool, grads: bool
) -> None:
    model = models.BatchNormNet()
    for module, mode in zip([model, model.norm, model.moe], training, strict=True):
        module.training = mode
    if grads:
        models.mean_square(model(models.near_tie_batch())).backward()  # type: ignore[no-untyped-call]
    calls = calls_of(model)
    snapshot = Snapshot(model)

    def boom(*_: Any) -> None:
        if len(calls) == fail_at:
            msg = f"the model fails at call {fail_at}"
            raise BoomError(msg)

    handle = model.moe.register_forward_pre_hook(boom)
    note(f"training {training}, fail at {fail_at}, loss {with_loss}, grads {grads}")
    try:
        fp32scope.advise(
            model,
            models.near_tie_batch(),
            autocast=BF16,
            tolerance=models.ROUTER_TOLERANCE,
            loss=models.mean_square if with_loss else None,
        )
    except BoomError:
        assert fail_at is not None
    finally:
        handle.remove()
    snapshot.assert_unchanged()
