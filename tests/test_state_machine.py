"""Stateful property tests: random torch writes (reaching the mixed states) and nested scopes.

Torch and a pure-Python model of its state receive the same writes; after every step every
reading torch offers (values, and which legacy getters raise) and the raw state recovered
by the library must equal the model's. On each exit the model goes back to its copy from
before the entry: the scope must restore even the raw values no getter shows.
"""

from __future__ import annotations

import warnings
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, note, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from fp32scope import Fp32FlagsChangedWarning, Fp32Precision, _flags, _scope, fp32_precision_scope
from tests.torch_model import LEGACY_SM_CUDA, LEGACY_SM_MKLDNN, TorchModel

pytestmark = pytest.mark.skipif(not _flags.HAS_NEW_API, reason="models torch's new fp32_precision API")

MATMULS = [None, "highest", "high", "medium"]
CUDNNS = [None, True, False]
precisions = st.builds(Fp32Precision, st.sampled_from(MATMULS), st.sampled_from(CUDNNS))
slot_keys = st.sampled_from([(b, o) for b, o, _ in _flags.SLOTS])
slot_values = st.sampled_from(["none", "ieee", "tf32", "bf16"])

MATMUL_NAMES = (
    _flags.LEGACY_MATMUL,
    _flags.LEGACY_CUBLAS,
    _flags.SLOT_NAMES["cuda", "matmul"],
    _flags.SLOT_NAMES["mkldnn", "matmul"],
)
CUDNN_NAMES = (_flags.LEGACY_CUDNN, _flags.SLOT_NAMES["cuda", "conv"], _flags.SLOT_NAMES["cuda", "rnn"])


class BoomError(Exception):
    pass


EXCEPTIONS: list[type[BaseException] | None] = [None, BoomError, KeyboardInterrupt]


def holds(model: TorchModel, precision: Fp32Precision) -> bool:
    """Whether torch's own view already shows ``precision`` (the scope then writes nothing)."""
    t, b = precision
    if t is not None and (model.legacy_matmul() != t or model.legacy_cublas() != (t != "highest")):
        return False
    return b is None or (model.legacy_cudnn() is b and (b or model.resolve("cuda", "all") != "tf32"))


class ScopeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = TorchModel()
        _flags.restore_raw_state(self.model.raw())
        self.stack: list[tuple[fp32_precision_scope, TorchModel, Fp32Precision]] = []

    # -- writes, outside any scope (a write inside one is a flip: tested on its own) --------

    @precondition(lambda self: not self.stack)
    @rule(value=st.sampled_from(["highest", "high", "medium"]))
    def legacy_matmul_precision(self, value: str) -> None:
        note(f"torch.set_float32_matmul_precision({value!r})")
        self.model.set_matmul_precision(value)

    @precondition(lambda self: not self.stack)
    @rule(value=st.booleans())
    def legacy_cublas(self, value: bool) -> None:
        note(f"torch.backends.cuda.matmul.allow_tf32 = {value}")
        self.model.set_cublas_allow_tf32(value)

    @precondition(lambda self: not self.stack)
    @rule(value=st.booleans())
    def legacy_cudnn(self, value: bool) -> None:
        note(f"torch.backends.cudnn.allow_tf32 = {value}")
        self.model.set_cudnn_allow_tf32(value)

    @precondition(lambda self: not self.stack)
    @rule(key=slot_keys, value=slot_values)
    def new_api(self, key: tuple[str, str], value: str) -> None:
        accepted = self.model.set_slot(*key, value)
        note(f"{_flags.SLOT_NAMES[key]} = {value!r}{'' if accepted else ' (refused by torch)'}")

    # -- scopes ------------------------------------------------------------------------------

    @precondition(lambda self: len(self.stack) < 4)
    @rule(precision=precisions)
    def enter(self, precision: Fp32Precision) -> None:
        note(f"enter fp32_precision_scope({precision})")
        before_model = self.model.copy()
        before = _flags.read_all()
        held = holds(before_model, precision)
        scope = fp32_precision_scope(precision)
        scope.__enter__()
        inside = _flags.read_all()
        raw_inside = _flags.save_raw_state()
        t, b = precision
        if t is not None:
            assert inside[_flags.LEGACY_MATMUL] == t
            assert inside[_flags.LEGACY_CUBLAS] is (t != "highest")
        else:
            assert {n: inside[n] for n in MATMUL_NAMES} == {n: before[n] for n in MATMUL_NAMES}
        if b is not None:
            assert inside[_flags.LEGACY_CUDNN] is b
            assert inside[_flags.SLOT_NAMES["cuda", "conv"]] == inside[_flags.SLOT_NAMES["cuda", "rnn"]] or b is False
            if not b:
                assert inside[_flags.SLOT_NAMES["cuda", "all"]] != "tf32"
        else:
            assert {n: inside[n] for n in CUDNN_NAMES} == {n: before[n] for n in CUDNN_NAMES}
        for name in (
            "torch.backends.fp32_precision",
            "torch.backends.mkldnn.fp32_precision",
            "torch.backends.mkldnn.conv.fp32_precision",
            "torch.backends.mkldnn.rnn.fp32_precision",
        ):
            assert inside[name] == before[name], name
        if held:
            assert raw_inside == before_model.raw(), "the flags already held: nothing may be written"
        # Inside, follow torch (its raw state is checked against the readings by the invariants).
        self.model = TorchModel.from_raw(raw_inside)
        self.stack.append((scope, before_model, precision))

    @precondition(lambda self: bool(self.stack))
    @rule(exception=st.sampled_from(EXCEPTIONS))
    def exit(self, exception: type[BaseException] | None) -> None:
        scope, before_model, precision = self.stack.pop()
        note(f"exit fp32_precision_scope({precision}) with {exception.__name__ if exception else 'no exception'}")
        if exception is None:
            scope.__exit__(None, None, None)  # returns None: never suppresses
        else:
            error = exception("from the block")
            # What a with statement does: __exit__ gets the exception and must not suppress it.
            scope.__exit__(exception, error, error.__traceback__)
        self.model = before_model

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def readings_match_model(self) -> None:
        assert _flags.read_all() == self.model.readings()

    @invariant()
    def raw_state_recovered_exactly_without_changing_anything(self) -> None:
        before = _flags.read_all()
        assert _flags.save_raw_state() == self.model.raw()
        assert _flags.read_all() == before

    @invariant()
    def ownership_follows_depth(self) -> None:
        # A scope that changes nothing (all fields None) takes no part in the thread rule.
        assert (_scope.active_scope_thread() is not None) == any(not p.is_noop for _, _, p in self.stack)

    def teardown(self) -> None:
        while self.stack:
            self.stack.pop()[0].__exit__(None, None, None)


def test_scopes_restore_exactly_from_every_reachable_state() -> None:
    run_state_machine_as_test(
        ScopeMachine,
        settings=settings(
            max_examples=400,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


class LegacyScopeMachine(RuleBasedStateMachine):
    """The torch < 2.9 implementation, run on this torch through legacy writes only."""

    def __init__(self) -> None:
        super().__init__()
        self.state = (torch_get(), cudnn_get())
        self.stack: list[tuple[fp32_precision_scope, tuple[str, bool]]] = []

    @precondition(lambda self: not self.stack)
    @rule(value=st.sampled_from(["highest", "high", "medium"]))
    def legacy_matmul_precision(self, value: str) -> None:
        import torch

        torch.set_float32_matmul_precision(value)

    @precondition(lambda self: not self.stack)
    @rule(value=st.booleans())
    def legacy_cudnn(self, value: bool) -> None:
        import torch

        torch.backends.cudnn.allow_tf32 = value

    @precondition(lambda self: len(self.stack) < 4)
    @rule(precision=precisions)
    def enter(self, precision: Fp32Precision) -> None:
        before = (torch_get(), cudnn_get())
        scope = fp32_precision_scope(precision)
        scope.__enter__()
        t, b = precision
        assert torch_get() == (t if t is not None else before[0])
        assert cudnn_get() is (b if b is not None else before[1])
        self.stack.append((scope, before))

    @precondition(lambda self: bool(self.stack))
    @rule(exception=st.sampled_from(EXCEPTIONS))
    def exit(self, exception: type[BaseException] | None) -> None:
        scope, before = self.stack.pop()
        error = exception("from the block") if exception is not None else None
        scope.__exit__(exception, error, None)
        assert (torch_get(), cudnn_get()) == before

    def teardown(self) -> None:
        while self.stack:
            self.stack.pop()[0].__exit__(None, None, None)


def torch_get() -> str:
    import torch

    return torch.get_float32_matmul_precision()


def cudnn_get() -> bool:
    import torch

    value: bool = torch.backends.cudnn.allow_tf32
    return value


def test_legacy_only_implementation_restores(monkeypatch: Any) -> None:
    monkeypatch.setattr(_scope, "_apply", _flags.legacy_apply)
    monkeypatch.setattr(_scope, "_restore", _flags.legacy_restore)
    run_state_machine_as_test(
        LegacyScopeMachine,
        settings=settings(max_examples=60, stateful_step_count=30, deadline=None),
    )


class FlipMachine(ScopeMachine):
    """As ScopeMachine, but blocks also write flags inside scopes (a model that flips them).

    On exit a scope that switched a field restores that field's raw state exactly, whatever
    the block did; one that found its field held re-applies it only where the block broke it
    (and warns); writes to flags outside the scope's fields persist, as any write does.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[dict[str, Any]] = []

    @precondition(lambda self: bool(self.stack))
    @rule(value=st.sampled_from(["highest", "high", "medium"]))
    def flip_legacy_matmul(self, value: str) -> None:
        note(f"  (inside) torch.set_float32_matmul_precision({value!r})")
        self.model.set_matmul_precision(value)

    @precondition(lambda self: bool(self.stack))
    @rule(value=st.booleans())
    def flip_legacy_cudnn(self, value: bool) -> None:
        note(f"  (inside) torch.backends.cudnn.allow_tf32 = {value}")
        self.model.set_cudnn_allow_tf32(value)

    @precondition(lambda self: bool(self.stack))
    @rule(key=slot_keys, value=slot_values)
    def flip_new_api(self, key: tuple[str, str], value: str) -> None:
        accepted = self.model.set_slot(*key, value)
        note(f"  (inside) {_flags.SLOT_NAMES[key]} = {value!r}{'' if accepted else ' (refused)'}")

    @precondition(lambda self: len(self.stack) < 4)
    @rule(precision=precisions)
    def enter(self, precision: Fp32Precision) -> None:
        m = self.model
        t, b = precision
        matmul_held = t is not None and m.legacy_matmul() == t and (t == "highest" or m.legacy_cublas() is True)
        cudnn_held = b is not None and m.legacy_cudnn() is b and (b or m.resolve("cuda", "all") != "tf32")
        all_reading = m.resolve("cuda", "all")
        moved = b is False and not cudnn_held and all_reading == "tf32"
        matmul_switched = t is not None and not matmul_held
        pinned = moved and not matmul_switched and m.slots["cuda", "matmul"] == "none"
        self.entries.append(
            {
                "matmul_held": matmul_held,
                "cudnn_held": cudnn_held,
                "all_reading": all_reading if b is False and cudnn_held else None,
                "moved": moved,
                "pinned": pinned,
            }
        )
        super().enter(precision)

    @precondition(lambda self: bool(self.stack))
    @rule(exception=st.sampled_from(EXCEPTIONS))
    def exit(self, exception: type[BaseException] | None) -> None:  # noqa: C901, PLR0912  (the contract, case by case)
        scope, snap, precision = self.stack.pop()
        entry = self.entries.pop()
        expected = self.model.copy()
        t, b = precision
        broken = False
        if b is not None:
            held_now = expected.legacy_cudnn() is b and (b or expected.resolve("cuda", "all") != "tf32")
            broken |= not held_now
            if not entry["cudnn_held"]:
                if entry["moved"]:
                    expected.slots["cuda", "all"] = snap.slots["cuda", "all"]
                    if entry["pinned"]:
                        expected.slots["cuda", "matmul"] = "none"
                expected.b = snap.b
                for op in ("conv", "rnn"):
                    expected.slots["cuda", op] = snap.slots["cuda", op]
            elif not held_now:
                expected.b = b
                for op in ("conv", "rnn"):
                    expected.slots["cuda", op] = "tf32" if b else "none"
                reading = entry["all_reading"]
                if reading is not None and expected.resolve("cuda", "all") != reading:
                    expected.slots["cuda", "all"] = reading
                    if expected.resolve("cuda", "all") == "tf32":
                        expected.slots["cuda", "all"] = "ieee"
        if t is not None:
            held_now = expected.legacy_matmul() == t and (t == "highest" or expected.legacy_cublas() is True)
            broken |= not held_now
            if not entry["matmul_held"]:
                expected.e = snap.e
                for backend in ("cuda", "mkldnn"):
                    expected.slots[backend, "matmul"] = snap.slots[backend, "matmul"]
            elif not held_now:
                expected.e = t
                expected.slots["cuda", "matmul"] = LEGACY_SM_CUDA[t]
                expected.slots["mkldnn", "matmul"] = LEGACY_SM_MKLDNN[t]
        note(f"exit fp32_precision_scope({precision}); the block broke it: {broken}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            error = exception("from the block") if exception is not None else None
            scope.__exit__(exception, error, None)
        flagged = [w for w in caught if issubclass(w.category, Fp32FlagsChangedWarning)]
        assert bool(flagged) == broken
        self.model = expected

    def teardown(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            super().teardown()


def test_scopes_restore_what_they_applied_when_the_block_flips_flags() -> None:
    run_state_machine_as_test(
        FlipMachine,
        settings=settings(
            max_examples=1000, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )
