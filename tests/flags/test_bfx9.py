"""cuda matmul "bfx9" (torch >= 2.15): read, applied, restored exactly, never taken for "highest".

Under bfx9 torch's legacy getters read "highest" and cuBLAS TF32 off, so only the
cuda/matmul slot tells it from IEEE float32. The Hypothesis state machines
(tests/flags/test_state_machine.py) write bfx9 wherever torch accepts it; these are the cases
by name. On an older torch, "bfx9" is refused with the release that brings it.
"""

from __future__ import annotations

import pytest
import torch

from fp32scope import (
    Fp32FlagsChangedWarning,
    Fp32Precision,
    Fp32ScopedModule,
    _compat,
    current_fp32_precision,
    fp32_precision_scope,
    node_fp32_precision,
    set_process_default,
    with_fp32_precision,
)
from fp32scope._export.record import MATMUL_KEY, read_record, record
from fp32scope._flags import torch_flags as _flags
from tests._support.common import BoomError
from tests._support.releases import needs_bfx9, needs_new_api, needs_no_bfx9

CUDA = "torch.backends.cuda.matmul.fp32_precision"
MKLDNN = "torch.backends.mkldnn.matmul.fp32_precision"
G = torch._C._get_fp32_precision_getter if _flags.HAS_NEW_API else None


def _cuda() -> str:
    assert G is not None
    value: str = G("cuda", "matmul")
    return value


def _bfx9_default() -> None:
    torch.backends.cuda.matmul.fp32_precision = "bfx9"


# -- a bfx9 default: other scopes apply their own precision --------------------------------


@needs_bfx9
@pytest.mark.parametrize(
    ("matmul", "cuda", "mkldnn"), [("highest", "ieee", "ieee"), ("high", "tf32", "tf32"), ("medium", "tf32", "bf16")]
)
def test_under_a_bfx9_default_a_scope_applies_its_precision_and_restores_bfx9(
    matmul: str, cuda: str, mkldnn: str
) -> None:
    _bfx9_default()
    before = _flags.save_raw_state()
    with fp32_precision_scope(Fp32Precision(matmul)):  # type: ignore[arg-type]
        readings = _flags.read_all()
        assert (readings[CUDA], readings[MKLDNN]) == (cuda, mkldnn)
        assert readings[_flags.LEGACY_MATMUL] == matmul
    assert _flags.save_raw_state() == before
    assert _cuda() == "bfx9"


@needs_bfx9
def test_a_highest_node_under_a_bfx9_default_computes_in_ieee() -> None:
    # The wrapper's forward sees what its kernels see.
    seen: list[str] = []

    class Probe(torch.nn.Module):
        float32_matmul_precision = "highest"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(_cuda())
            return x

    _bfx9_default()
    module = Fp32ScopedModule(Probe(), node_fp32_precision("probe", Probe()))
    module(torch.ones(1))
    assert seen == ["ieee"]
    assert _cuda() == "bfx9"


@needs_bfx9
@pytest.mark.parametrize("exception", [None, BoomError, KeyboardInterrupt])
def test_nested_scopes_over_bfx9_restore_each_level_exactly(exception: type[BaseException] | None) -> None:
    torch.set_float32_matmul_precision("medium")
    _bfx9_default()  # a mixed state: the legacy getter raises
    states = [_flags.save_raw_state()]
    try:
        with fp32_precision_scope(Fp32Precision("highest", False)):
            states.append(_flags.save_raw_state())
            assert _cuda() == "ieee"
            with fp32_precision_scope(Fp32Precision("bfx9")):
                states.append(_flags.save_raw_state())
                assert (_cuda(), current_fp32_precision().matmul) == ("bfx9", "bfx9")
                with fp32_precision_scope(Fp32Precision("high")):
                    assert _cuda() == "tf32"
                    if exception is not None:
                        raise exception
                assert _flags.save_raw_state() == states.pop()
            assert _flags.save_raw_state() == states.pop()
    except (BoomError, KeyboardInterrupt):
        assert exception is not None
    assert _flags.save_raw_state() == states[0]
    assert _cuda() == "bfx9"


# -- a node that asks for bfx9 ------------------------------------------------------------


@needs_bfx9
@pytest.mark.parametrize("default", ["highest", "high", "medium"])
def test_a_bfx9_scope_sets_cublas_bfx9_and_onednn_full_float32(default: str) -> None:
    torch.set_float32_matmul_precision(default)
    before = _flags.save_raw_state()
    with fp32_precision_scope(Fp32Precision("bfx9")):
        readings = _flags.read_all()
        assert (readings[CUDA], readings[MKLDNN]) == ("bfx9", "ieee")
        assert readings[_flags.LEGACY_MATMUL] == "highest"
        assert current_fp32_precision().matmul == "bfx9"
    assert _flags.save_raw_state() == before


@needs_bfx9
def test_a_held_bfx9_writes_nothing_and_a_block_that_breaks_it_is_undone_with_a_warning() -> None:
    _bfx9_default()
    before = _flags.save_raw_state()
    with fp32_precision_scope(Fp32Precision("bfx9")):
        assert _flags.save_raw_state() == before  # already held: nothing written
    with (
        pytest.warns(Fp32FlagsChangedWarning, match="matmul precision applied as 'bfx9'"),
        fp32_precision_scope(Fp32Precision("bfx9")),
    ):
        torch.set_float32_matmul_precision("highest")  # cuda/matmul "ieee": bfx9 broken
    assert _cuda() == "bfx9"


@needs_bfx9
def test_declarations_wrappers_and_the_process_default_take_bfx9() -> None:
    class Head(torch.nn.Linear):
        float32_matmul_precision = "bfx9"

    assert node_fp32_precision("head", Head(2, 2)) == Fp32Precision("bfx9")
    seen: list[str] = []

    @with_fp32_precision(Fp32Precision("bfx9", cudnn_allow_tf32=False))
    def fn() -> None:
        seen.append(_cuda())

    fn()
    assert seen == ["bfx9"]
    set_process_default(Fp32Precision("bfx9"))
    assert (_cuda(), G("mkldnn", "matmul") if G else None) == ("bfx9", "ieee")
    assert current_fp32_precision().matmul == "bfx9"
    set_process_default(Fp32Precision("highest"))
    assert _cuda() == "ieee"
    assert current_fp32_precision().matmul == "highest"


@needs_bfx9
def test_current_precision_reports_bfx9_and_the_least_precise_setting_in_mixed_states() -> None:
    _bfx9_default()
    assert current_fp32_precision().matmul == "bfx9"
    torch.backends.mkldnn.matmul.fp32_precision = "tf32"  # type: ignore[attr-defined]  # the getter raises now
    assert current_fp32_precision().matmul == "high"
    torch.set_float32_matmul_precision("high")
    _bfx9_default()
    torch.backends.mkldnn.matmul.fp32_precision = "ieee"  # type: ignore[attr-defined]  # E "high", bfx9: raises
    assert _flags.read_all()[_flags.LEGACY_MATMUL] == _flags.RAISES
    assert current_fp32_precision().matmul == "bfx9"


@needs_bfx9
def test_the_raw_state_round_trips_with_bfx9() -> None:
    _bfx9_default()
    saved = _flags.save_raw_state()
    assert saved[2][3] == "bfx9"  # cuda/matmul, in SLOTS order
    torch.set_float32_matmul_precision("medium")
    _flags.restore_raw_state(saved)
    assert _flags.save_raw_state() == saved
    assert _flags.read_all()[CUDA] == "bfx9"


@needs_bfx9
def test_the_export_record_carries_bfx9() -> None:
    written = record(Fp32Precision("bfx9", True))
    assert written[MATMUL_KEY] == "bfx9"
    assert read_record(written, "a package") == Fp32Precision("bfx9", True)


# -- a torch without bfx9 ------------------------------------------------------------------


@needs_no_bfx9
def test_bfx9_is_refused_with_the_release_that_brings_it() -> None:
    message = rf"'bfx9' .*torch {_compat.TORCH_RELEASE} does not have: it came in torch 2\.15"
    before = _flags.save_raw_state()
    with pytest.raises(ValueError, match=r"precision\.matmul is " + message):
        fp32_precision_scope(Fp32Precision("bfx9"))
    with pytest.raises(ValueError, match=r"precision\.matmul is " + message):
        set_process_default(Fp32Precision("bfx9"))

    class Head(torch.nn.Linear):
        float32_matmul_precision = "bfx9"

    with pytest.raises(ValueError, match="float32_matmul_precision of node 'head' is " + message):
        node_fp32_precision("head", Head(2, 2))
    with pytest.raises(ValueError, match=message):
        read_record(record(Fp32Precision("bfx9")), "a package")
    assert _flags.save_raw_state() == before


# -- the probe behind HAS_BFX9 ---------------------------------------------------------------


@needs_new_api
@pytest.mark.parametrize(
    "writes",
    [
        [],
        [("cuda", "all", "ieee")],  # cuda/matmul inherits the ieee it reads
        [("cuda", "all", "ieee"), ("cuda", "matmul", "ieee")],  # explicit, reading the same
        [("generic", "all", "tf32")],  # cuda/all and cuda/matmul both inherit
        [("generic", "all", "tf32"), ("cuda", "all", "tf32")],
        [("generic", "all", "tf32"), ("cuda", "matmul", "tf32")],
        [("cuda", "matmul", "tf32")],
    ],
)
def test_the_bfx9_probe_leaves_the_raw_state_as_it_was(writes: list[tuple[str, str, str]]) -> None:
    for backend, op, value in writes:
        torch._C._set_fp32_precision_setter(backend, op, value)
    before = _flags.save_raw_state()
    assert _compat._has_bfx9() is _compat.HAS_BFX9
    assert _flags.save_raw_state() == before
    # Inheritance is kept, not only the readings: a parent write still reaches the slot.
    torch._C._set_fp32_precision_setter("cuda", "all", "tf32")
    after = _flags.save_raw_state()
    _flags.restore_raw_state(before)
    torch._C._set_fp32_precision_setter("cuda", "all", "tf32")
    assert _flags.save_raw_state() == after


def test_bfx9_is_found_only_with_the_per_backend_api() -> None:
    assert _compat.HAS_BFX9 <= _compat.HAS_PER_BACKEND_API
