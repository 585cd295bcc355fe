"""Stateful property tests: random torch writes (reaching the mixed states) and nested scopes.

Torch and a pure-Python model of its state receive the same writes; after every step every
reading torch offers (values, and which legacy getters raise) and the raw state recovered
by the library must equal the model's. On each exit the model goes back to its copy from
before the entry: the scope must restore even the raw values no getter shows.

The machines run on every torch release: on torch >= 2.9 over random legacy and
``fp32_precision`` writes (and on torch >= 2.15 "bfx9", as a write and as a scope's
precision), on earlier releases over the legacy writes that release has
(``torch.backends.mkldnn.allow_tf32`` too, where it exists). On torch >= 2.9 the legacy
implementation also runs, swapped in, over legacy writes only.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from fp32scope import Fp32FlagsChangedWarning, Fp32Precision, _compat, fp32_precision_scope
from fp32scope._flags import scope as _scope
from fp32scope._flags import torch_flags as _flags
from tests._support.common import BoomError
from tests._support.torch_model import (
    APPLIED_CUDA,
    APPLIED_MKLDNN,
    HAS_ONEDNN_BOOL,
    LEGACY_WORD,
    TorchModel,
    read_onednn_bool,
)

# "bfx9" wherever torch accepts it (torch >= 2.15): as a scope's precision, and written to
# every slot (torch refuses it outside cuda/matmul; the model says which).
BFX9: list[str] = ["bfx9"] if _compat.HAS_BFX9 else []
MATMULS = [None, "highest", "high", "medium", *BFX9]
CUDNNS = [None, True, False]
precisions = st.builds(Fp32Precision, st.sampled_from(MATMULS), st.sampled_from(CUDNNS))
# Empty before torch 2.9; the rules that draw from these exist only where the API does.
SLOT_KEYS = [(b, o) for b, o, _ in _flags.SLOTS]
slot_values = st.sampled_from(["none", "ieee", "tf32", "bf16", *BFX9])

MATMUL_NAMES: tuple[str, ...] = (_flags.LEGACY_MATMUL, _flags.LEGACY_CUBLAS)
CUDNN_NAMES: tuple[str, ...] = (_flags.LEGACY_CUDNN,)
if _flags.HAS_NEW_API:
    MATMUL_NAMES += (_flags.SLOT_NAMES["cuda", "matmul"], _flags.SLOT_NAMES["mkldnn", "matmul"])
    CUDNN_NAMES += (_flags.SLOT_NAMES["cuda", "conv"], _flags.SLOT_NAMES["cuda", "rnn"])
OTHER_NAMES = tuple(
    _flags.SLOT_NAMES[k]
    for k in (("generic", "all"), ("mkldnn", "all"), ("mkldnn", "conv"), ("mkldnn", "rnn"))
    if _flags.HAS_NEW_API
)


EXCEPTIONS: list[type[BaseException] | None] = [None, BoomError, KeyboardInterrupt]


def holds(model: TorchModel, precision: Fp32Precision) -> bool:
    """Whether each field the scope sets already holds: it then writes nothing (issue 7, defect 5).

    Holding means every slot the field governs computes as torch's legacy setter would
    leave it (matmul: cuBLAS and oneDNN; cuDNN: conv and rnn), not only that the legacy
    getters say so: see ``TorchModel.matmul_holds`` and ``TorchModel.cudnn_holds``.
    """
    t, b = precision
    return (t is None or model.matmul_holds(t)) and (b is None or model.cudnn_holds(b))


class LegacyWritesMachine(RuleBasedStateMachine):
    """Writes through torch's legacy setters, then nested scopes; runs on every release.

    The matmul and cuDNN setters, and ``torch.backends.mkldnn.allow_tf32`` where torch has
    it (2.7 and later), which no scope writes. Not the cuBLAS bool: on torch >= 2.9 it
    leaves mkldnn/matmul alone, so after "medium" it makes a mixed state, which only the
    full implementation handles (ScopeMachine adds it).
    """

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
    def legacy_cudnn(self, value: bool) -> None:
        note(f"torch.backends.cudnn.allow_tf32 = {value}")
        self.model.set_cudnn_allow_tf32(value)

    if HAS_ONEDNN_BOOL:

        @precondition(lambda self: not self.stack)
        @rule(value=st.booleans())
        def legacy_onednn(self, value: bool) -> None:
            note(f"torch.backends.mkldnn.allow_tf32 = {value}")
            self.model.set_onednn_allow_tf32(value)

    # -- scopes ------------------------------------------------------------------------------

    def scope_for(self, precision: Fp32Precision) -> fp32_precision_scope:
        """A new scope per entry, as ``with fp32_precision_scope(p):`` makes."""
        return fp32_precision_scope(precision)

    @precondition(lambda self: len(self.stack) < 4)
    @rule(precision=precisions)
    def enter(self, precision: Fp32Precision) -> None:
        note(f"enter fp32_precision_scope({precision})")
        before_model = self.model.copy()
        before = _flags.read_all()
        held = holds(before_model, precision)
        scope = self.scope_for(precision)
        scope.__enter__()
        # On the stack before any check, so that teardown exits it also when one fails.
        self.stack.append((scope, before_model, precision))
        inside = _flags.read_all()
        raw_inside = _flags.save_raw_state()
        inside_model = TorchModel.from_raw(raw_inside)  # checked against torch by the invariants
        t, b = precision
        if t is not None:
            # Whatever the entry found, every matmul slot now computes as the legacy setter's.
            assert inside_model.matmul_holds(t), f"matmul precision {t!r} does not hold inside: {inside}"
            assert inside[_flags.LEGACY_MATMUL] == LEGACY_WORD[t]
            assert inside[_flags.LEGACY_CUBLAS] is (LEGACY_WORD[t] != "highest")
        else:
            assert {n: inside[n] for n in MATMUL_NAMES} == {n: before[n] for n in MATMUL_NAMES}
        if b is not None:
            assert inside_model.cudnn_holds(b), f"cudnn_allow_tf32={b} does not hold inside: {inside}"
            assert inside[_flags.LEGACY_CUDNN] is b
        else:
            assert {n: inside[n] for n in CUDNN_NAMES} == {n: before[n] for n in CUDNN_NAMES}
        for name in OTHER_NAMES:
            assert inside[name] == before[name], name
        assert read_onednn_bool() == before_model.onednn, "a scope never writes the oneDNN TF32 bool"
        if held:
            assert raw_inside == before_model.raw(), "the flags already held: nothing may be written"
        # Inside, follow torch (its raw state is checked against the readings by the invariants).
        self.model = inside_model

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
    def onednn_bool_matches_model(self) -> None:
        assert read_onednn_bool() == self.model.onednn

    @invariant()
    def ownership_follows_depth(self) -> None:
        # A scope that changes nothing (all fields None) takes no part in the thread rule.
        assert (_scope.active_scope_thread() is not None) == any(not p.is_noop for _, _, p in self.stack)

    def teardown(self) -> None:
        # After a failed step the flags may not be what the open scopes applied: their exits
        # then warn, which the test config turns into errors. Exit every scope regardless,
        # so that the next example starts with no scope open (else Hypothesis sees a
        # different machine on replay and reports a flaky test instead of the failure).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while self.stack:
                self.stack.pop()[0].__exit__(None, None, None)


class ScopeMachine(LegacyWritesMachine):
    """Every legacy write, the cuBLAS bool included: what a legacy release offers."""

    @precondition(lambda self: not self.stack)
    @rule(value=st.booleans())
    def legacy_cublas(self, value: bool) -> None:
        note(f"torch.backends.cuda.matmul.allow_tf32 = {value}")
        self.model.set_cublas_allow_tf32(value)


class NewApiScopeMachine(ScopeMachine):
    """Adds random ``fp32_precision`` writes, reaching the mixed states (torch >= 2.9)."""

    @precondition(lambda self: not self.stack)
    @rule(key=st.sampled_from(SLOT_KEYS or [("generic", "all")]), value=slot_values)
    def new_api(self, key: tuple[str, str], value: str) -> None:
        accepted = self.model.set_slot(*key, value)
        note(f"{_flags.SLOT_NAMES[key]} = {value!r}{'' if accepted else ' (refused by torch)'}")


#: The richest machine this release can run: random legacy and fp32_precision writes on
#: torch >= 2.9, random legacy writes before.
SCOPE_MACHINE: type[ScopeMachine] = NewApiScopeMachine if _flags.HAS_NEW_API else ScopeMachine


def test_scopes_restore_exactly_from_every_reachable_state() -> None:
    run_state_machine_as_test(
        SCOPE_MACHINE,
        settings=settings(
            max_examples=400,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


class LegacyWrittenStartMachine(LegacyWritesMachine):
    """Starts where legacy setters have written every slot they govern.

    A fresh process's cuda/matmul holds "none", which no legacy write restores (the legacy
    setter writes "ieee" for "highest"): the legacy implementation, run on torch >= 2.9,
    restores exactly from the states legacy writes reach, and those are what it gets there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.model.set_matmul_precision(self.model.e)
        self.model.set_cudnn_allow_tf32(self.model.b)

    # No "bfx9": the legacy implementation runs where torch has no per-backend API, and so no bfx9.
    @precondition(lambda self: len(self.stack) < 4)
    @rule(precision=st.builds(Fp32Precision, st.sampled_from(MATMULS[:4]), st.sampled_from(CUDNNS)))
    def enter(self, precision: Fp32Precision) -> None:
        super().enter(precision)


@pytest.mark.skipif(
    not _flags.HAS_NEW_API,
    reason=(
        "before torch 2.9 the legacy implementation is the one fp32scope uses: "
        "test_scopes_restore_exactly_from_every_reachable_state runs it there for real"
    ),
)
def test_legacy_only_implementation_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    # What torch < 2.9 runs, on this torch, over the legacy writes that keep both APIs consistent.
    monkeypatch.setattr(_scope, "_apply", _flags.legacy_apply)
    monkeypatch.setattr(_scope, "_restore", _flags.legacy_restore)
    run_state_machine_as_test(
        LegacyWrittenStartMachine,
        settings=settings(max_examples=60, stateful_step_count=30, deadline=None),
    )


def test_the_implementation_in_use_matches_the_release() -> None:
    # The machines above test whatever _scope calls: make sure that is this release's.
    if _flags.HAS_NEW_API:
        assert _scope._apply is _flags.apply is not _flags.legacy_apply
    else:
        assert _scope._apply is _flags.apply is _flags.legacy_apply
        assert _scope._restore is _flags.restore is _flags.legacy_restore


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
    def flip_legacy_cublas(self, value: bool) -> None:
        note(f"  (inside) torch.backends.cuda.matmul.allow_tf32 = {value}")
        self.model.set_cublas_allow_tf32(value)

    @precondition(lambda self: bool(self.stack))
    @rule(value=st.booleans())
    def flip_legacy_cudnn(self, value: bool) -> None:
        note(f"  (inside) torch.backends.cudnn.allow_tf32 = {value}")
        self.model.set_cudnn_allow_tf32(value)

    if HAS_ONEDNN_BOOL:

        @precondition(lambda self: bool(self.stack))
        @rule(value=st.booleans())
        def flip_legacy_onednn(self, value: bool) -> None:
            note(f"  (inside) torch.backends.mkldnn.allow_tf32 = {value} (not a scoped field: persists)")
            self.model.set_onednn_allow_tf32(value)

    @precondition(lambda self: len(self.stack) < 4)
    @rule(precision=precisions)
    def enter(self, precision: Fp32Precision) -> None:
        m = self.model
        t, b = precision
        matmul_held = t is not None and m.matmul_holds(t)
        cudnn_held = b is not None and m.cudnn_holds(b)
        all_reading = m.resolve("cuda", "all")
        moved = bool(m.slots) and b is False and not cudnn_held and all_reading == "tf32"
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
        slots = expected.slots  # empty before torch 2.9: E and B are the whole state
        t, b = precision
        broken = False
        if b is not None:
            held_now = expected.cudnn_holds(b)
            broken |= not held_now
            if not entry["cudnn_held"]:
                if entry["moved"]:
                    slots["cuda", "all"] = snap.slots["cuda", "all"]
                    if entry["pinned"]:
                        slots["cuda", "matmul"] = "none"
                expected.b = snap.b
                if slots:
                    for op in ("conv", "rnn"):
                        slots["cuda", op] = snap.slots["cuda", op]
            elif not held_now:
                expected.b = b
                if slots:
                    for op in ("conv", "rnn"):
                        slots["cuda", op] = "tf32" if b else "none"
                    reading = entry["all_reading"]
                    if reading is not None and expected.resolve("cuda", "all") != reading:
                        slots["cuda", "all"] = reading
                        if expected.resolve("cuda", "all") == "tf32":
                            slots["cuda", "all"] = "ieee"
        if t is not None:
            held_now = expected.matmul_holds(t)
            broken |= not held_now
            if not entry["matmul_held"]:
                expected.e = snap.e
                if slots:
                    for backend in ("cuda", "mkldnn"):
                        slots[backend, "matmul"] = snap.slots[backend, "matmul"]
            elif not held_now:
                expected.e = LEGACY_WORD[t]
                if slots:
                    slots["cuda", "matmul"] = APPLIED_CUDA[t]
                    slots["mkldnn", "matmul"] = APPLIED_MKLDNN[t]
        note(f"exit fp32_precision_scope({precision}); the block broke it: {broken}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            error = exception("from the block") if exception is not None else None
            scope.__exit__(exception, error, None)
        flagged = [w for w in caught if issubclass(w.category, Fp32FlagsChangedWarning)]
        assert bool(flagged) == broken
        self.model = expected


class NewApiFlipMachine(FlipMachine, NewApiScopeMachine):
    """FlipMachine with ``fp32_precision`` writes outside and inside scopes (torch >= 2.9)."""

    @precondition(lambda self: bool(self.stack))
    @rule(key=st.sampled_from(SLOT_KEYS or [("generic", "all")]), value=slot_values)
    def flip_new_api(self, key: tuple[str, str], value: str) -> None:
        accepted = self.model.set_slot(*key, value)
        note(f"  (inside) {_flags.SLOT_NAMES[key]} = {value!r}{'' if accepted else ' (refused)'}")


FLIP_MACHINE: type[FlipMachine] = NewApiFlipMachine if _flags.HAS_NEW_API else FlipMachine


def test_scopes_restore_what_they_applied_when_the_block_flips_flags() -> None:
    run_state_machine_as_test(
        FLIP_MACHINE,
        settings=settings(
            max_examples=1000, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )


class ReusedScopes:
    """Mixed into a machine: scopes kept and entered again, nested in themselves too.

    Two per precision, taken in turn: a kept ``fp32_precision_scope`` and a wrapper's scope.
    Both learn from their entries whether the precision holds, and then check it in place
    of apply and restore: the random writes between (and, in the flip machine, inside)
    entries make that check fail as often as pass.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool: dict[Fp32Precision, list[fp32_precision_scope]] = {}
        self.turn = 0

    def scope_for(self, precision: Fp32Precision) -> fp32_precision_scope:
        """One of the two kept scopes of ``precision``, in turn."""
        kept = self.pool.setdefault(
            precision, [fp32_precision_scope(precision), _scope.wrapper_scope(precision, "node")]
        )
        self.turn += 1
        return kept[self.turn % 2]


class ReusedScopeMachine(ReusedScopes, SCOPE_MACHINE):  # type: ignore[misc, valid-type]
    """SCOPE_MACHINE with kept scopes."""


class ReusedFlipMachine(ReusedScopes, FLIP_MACHINE):  # type: ignore[misc, valid-type]
    """FLIP_MACHINE with kept scopes."""


def test_kept_scopes_restore_exactly_from_every_reachable_state() -> None:
    run_state_machine_as_test(
        ReusedScopeMachine,
        settings=settings(
            max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )


def test_kept_scopes_restore_what_they_applied_when_the_block_flips_flags() -> None:
    run_state_machine_as_test(
        ReusedFlipMachine,
        settings=settings(
            max_examples=500, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )


def _sweep_step(machine: FlipMachine, rng: random.Random, *, inside: bool) -> None:
    """One random write, through the machine's own rules (so its model follows torch)."""
    kinds = ["matmul", "cublas", "cudnn", *(["slot"] if _flags.HAS_NEW_API else [])]
    kind = rng.choice(kinds)
    if kind == "matmul":
        value = rng.choice(["highest", "high", "medium"])
        (machine.flip_legacy_matmul if inside else machine.legacy_matmul_precision)(value)
    elif kind == "cublas":
        (machine.flip_legacy_cublas if inside else machine.legacy_cublas)(rng.random() < 0.5)
    elif kind == "cudnn":
        (machine.flip_legacy_cudnn if inside else machine.legacy_cudnn)(rng.random() < 0.5)
    else:
        key = rng.choice(SLOT_KEYS)
        value = rng.choice(["none", "ieee", "tf32", "bf16", *BFX9])
        (machine.flip_new_api if inside else machine.new_api)(key, value)  # type: ignore[attr-defined]


def _check(machine: FlipMachine) -> None:
    machine.readings_match_model()
    machine.raw_state_recovered_exactly_without_changing_anything()
    machine.ownership_follows_depth()


@settings(max_examples=1, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.just(20261201))
def test_a_fixed_sweep_of_scopes_and_flips_follows_the_contract(seed: int) -> None:
    """The state machines' contract over a fixed, seeded sweep of states and flips.

    The same rules and checks as this module's flip machine (enter, exit:
    exact restore of a switched field, re-apply of a held one that the block broke, the
    warning exactly then), driven deterministically over 1500 start states, every precision
    and a random write inside: many more cases than the mutation session's capped
    Hypothesis runs reach, at a fixed cost.
    """
    rng = random.Random(seed)  # noqa: S311  (a fixed sweep, not secrecy)
    for _run in range(1500):
        machine = FLIP_MACHINE()
        try:
            for _ in range(rng.randrange(1, 9)):
                _sweep_step(machine, rng, inside=False)
            _check(machine)
            t = rng.choice(MATMULS)
            b = rng.choice(CUDNNS)
            machine.enter(Fp32Precision(t, b))  # type: ignore[arg-type]
            _check(machine)
            for _ in range(rng.randrange(0, 3)):
                _sweep_step(machine, rng, inside=True)
            machine.exit(rng.choice(EXCEPTIONS))
            _check(machine)
        finally:
            machine.teardown()
