"""Exact reads and writes of torch's float32-precision flags, through whichever API torch has.

torch keeps this state in C++ (``at::Context``):

* the legacy matmul enum E (``"highest"``/``"high"``/``"medium"``),
* the legacy cuDNN bool B,
* since torch 2.9, nine ``fp32_precision`` slots, one per (backend, op), each holding
  ``"none"`` (inherit from the parent: op -> backend/all -> generic/all), ``"ieee"``,
  ``"tf32"`` or ``"bf16"``.

No getter shows a slot's raw value (getters resolve inheritance) or E and B directly
(the legacy getters raise when they disagree with the slots). This module recovers the
raw values exactly: from the readings where they decide it, and otherwise by probing,
i.e. changing a parent for two C calls and watching whether the child follows. So a save
followed by a restore leaves even the unobservable part of the state as it was, and a
later write to a parent slot reaches a child exactly as it would have without the scope.

Everything here runs on the hot path of every scoped call: plain module functions, C
getters and setters bound to module globals, no allocation beyond small tuples.
"""

from __future__ import annotations

from typing import Final, Union

import torch

__all__ = [
    "HAS_NEW_API",
    "RAISES",
    "FlagReadings",
    "RawState",
    "read_all",
    "restore_raw_state",
    "save_raw_state",
]

_C = torch._C

#: True when torch has the per-backend ``fp32_precision`` API (torch >= 2.9). Detected by
#: presence, not by version, so that backports and nightlies are handled as they are.
HAS_NEW_API: Final[bool] = hasattr(_C, "_get_fp32_precision_getter") and hasattr(
    _C, "_set_fp32_precision_setter"
)

#: The value a reading takes in :func:`read_all` when torch's getter raises (mixed state).
RAISES: Final[str] = "<raises: mixed legacy/new API state>"

FlagReadings = dict[str, Union[str, bool]]
#: (E, B, the nine raw slots in ``SLOTS`` order; empty before torch 2.9).
RawState = tuple[str, bool, tuple[str, ...]]
#: (B, conv raw, rnn raw, cuda/all raw if moved, cuda/matmul raw if pinned).
CudnnSaved = tuple[bool, str, str, Union[str, None], Union[str, None]]

_GM = _C._get_float32_matmul_precision
_SM = _C._set_float32_matmul_precision
_GBLAS = _C._get_cublas_allow_tf32
_GB = _C._get_cudnn_allow_tf32
_SB = _C._set_cudnn_allow_tf32

# Reading names: the Python expression a user would type to read the same value.
LEGACY_MATMUL: Final = "torch.get_float32_matmul_precision()"
LEGACY_CUBLAS: Final = "torch.backends.cuda.matmul.allow_tf32"
LEGACY_CUDNN: Final = "torch.backends.cudnn.allow_tf32"

#: (backend, op) slots of the new API, parents before children, with their Python names.
SLOTS: Final[tuple[tuple[str, str, str], ...]] = (
    ("generic", "all", "torch.backends.fp32_precision"),
    ("cuda", "all", "torch.backends.cudnn.fp32_precision"),
    ("mkldnn", "all", "torch.backends.mkldnn.fp32_precision"),
    ("cuda", "matmul", "torch.backends.cuda.matmul.fp32_precision"),
    ("cuda", "conv", "torch.backends.cudnn.conv.fp32_precision"),
    ("cuda", "rnn", "torch.backends.cudnn.rnn.fp32_precision"),
    ("mkldnn", "matmul", "torch.backends.mkldnn.matmul.fp32_precision"),
    ("mkldnn", "conv", "torch.backends.mkldnn.conv.fp32_precision"),
    ("mkldnn", "rnn", "torch.backends.mkldnn.rnn.fp32_precision"),
)
SLOT_NAMES: Final[dict[tuple[str, str], str]] = {(b, o): n for b, o, n in SLOTS}

# What torch's legacy matmul setter writes into the cuda/matmul and mkldnn/matmul slots.
SM_WRITES_CUDA: Final[dict[str, str]] = {"highest": "ieee", "high": "tf32", "medium": "tf32"}
SM_WRITES_MKLDNN: Final[dict[str, str]] = {"highest": "ieee", "high": "tf32", "medium": "bf16"}

# A value that reads differently from the key, valid on every backend, for probing.
_OTHER: Final[dict[str, str]] = {"ieee": "tf32", "tf32": "ieee", "bf16": "ieee", "none": "ieee"}


def _try(getter: object) -> str | bool:
    try:
        return getter()  # type: ignore[operator, no-any-return]
    except RuntimeError:
        return RAISES


if HAS_NEW_API:
    _G = _C._get_fp32_precision_getter
    _S = _C._set_fp32_precision_setter

    def raw_all(backend: str) -> str:
        """The raw value of ``backend``/all (what is stored, not what it resolves to)."""
        r = _G(backend, "all")
        if r == "none":
            return "none"
        generic = _G("generic", "all")
        parent = "none" if backend == "cuda" and generic == "bf16" else generic
        if r != parent:
            return r
        # Reads the same as generic/all: explicit, or inherited. Move generic/all (whose raw
        # value is its reading) and see whether the slot follows.
        _S("generic", "all", _OTHER[generic])
        try:
            follows = _G(backend, "all") != r
        finally:
            _S("generic", "all", generic)
        return "none" if follows else r

    def raw_op(backend: str, op: str, all_reading: str | None = None) -> str:
        """The raw value of ``backend``/``op``; ``all_reading`` saves a read the caller made."""
        r = _G(backend, op)
        if r == "none":
            return "none"  # an explicit ieee/tf32 would read as such
        if all_reading is None:
            all_reading = _G(backend, "all")
        if r != all_reading:
            return r
        parent_raw = raw_all(backend)
        _S(backend, "all", _OTHER[r])
        try:
            follows = _G(backend, op) != r
        finally:
            _S(backend, "all", parent_raw)
        return "none" if follows else r

    def legacy_matmul(cuda_raw: str, mkldnn_raw: str) -> str:
        """The legacy enum E, also where torch's getter raises (given both slots' raw values)."""
        try:
            return _GM()  # type: ignore[no-any-return]
        except RuntimeError:
            pass
        # With both matmul slots at "ieee" no consistency check can fail, so the getter shows E.
        _S("cuda", "matmul", "ieee")
        _S("mkldnn", "matmul", "ieee")
        try:
            return _GM()  # type: ignore[no-any-return]
        finally:
            _S("cuda", "matmul", cuda_raw)
            _S("mkldnn", "matmul", mkldnn_raw)

    def legacy_cudnn(conv: str, rnn: str, conv_raw: str, rnn_raw: str) -> bool:
        """The legacy cuDNN bool B, also where torch's getter raises."""
        try:
            return _GB()  # type: ignore[no-any-return]
        except RuntimeError:
            pass
        conv_tf32 = conv == "tf32"
        if conv_tf32 == (rnn == "tf32"):
            return not conv_tf32  # the getter raises only because B disagrees with both
        # conv and rnn disagree: B is invisible. With both at "ieee" the getter answers
        # False for B == False and raises for B == True.
        _S("cuda", "conv", "ieee")
        _S("cuda", "rnn", "ieee")
        try:
            _GB()
        except RuntimeError:
            return True
        else:
            return False
        finally:
            _S("cuda", "conv", conv_raw)
            _S("cuda", "rnn", rnn_raw)

    # -- matmul field ---------------------------------------------------------------------

    def matmul_holds(target: str) -> bool:
        """Whether every matmul reading already is what applying ``target`` would give."""
        try:
            if _GM() != target:
                return False
        except RuntimeError:
            return False
        if target == "highest":
            # No raise and "highest" imply neither matmul slot reads tf32 or bf16.
            return True
        return _G("cuda", "matmul") == "tf32" and _G("mkldnn", "matmul") == SM_WRITES_MKLDNN[target]

    def save_matmul() -> tuple[str, str, str]:
        """Exact state of what applying a matmul precision writes: (E, cuda raw, mkldnn raw)."""
        cuda_raw = raw_op("cuda", "matmul")
        mkldnn_raw = raw_op("mkldnn", "matmul")
        return (legacy_matmul(cuda_raw, mkldnn_raw), cuda_raw, mkldnn_raw)

    def restore_matmul(saved: tuple[str, str, str]) -> None:
        """Write back what :func:`save_matmul` returned."""
        e, cuda_raw, mkldnn_raw = saved
        _SM(e)
        if cuda_raw != SM_WRITES_CUDA[e]:
            _S("cuda", "matmul", cuda_raw)
        if mkldnn_raw != SM_WRITES_MKLDNN[e]:
            _S("mkldnn", "matmul", mkldnn_raw)

    # -- cudnn field ----------------------------------------------------------------------

    def cudnn_holds(target: bool) -> bool:
        """Whether every cuDNN reading already is what applying ``target`` would give."""
        try:
            if _GB() is not target:
                return False
        except RuntimeError:
            return False
        # No raise means conv and rnn both read tf32 iff target. For False, Inductor's
        # Triton conv templates also look at cudnn.fp32_precision (cuda/all).
        return target or _G("cuda", "all") != "tf32"

    def save_apply_cudnn(target: bool, pin_matmul: bool) -> CudnnSaved:
        """Save the exact cuDNN state, then apply ``target``; returns what to restore.

        torch's legacy setter writes conv and rnn as "none" for False, which resolves to
        tf32 under a tf32 parent; so False writes both explicitly as "ieee", and moves
        cuda/all off "tf32" too, pinning cuda/matmul (when this scope does not set it) to
        the value it read, so that the matmul precision is left as it is.
        """
        all_reading = _G("cuda", "all")
        conv = _G("cuda", "conv")
        rnn = _G("cuda", "rnn")
        conv_raw = raw_op("cuda", "conv", all_reading)
        rnn_raw = raw_op("cuda", "rnn", all_reading)
        b = legacy_cudnn(conv, rnn, conv_raw, rnn_raw)
        all_raw: str | None = None
        matmul_raw: str | None = None
        if not target and all_reading == "tf32":
            all_raw = raw_all("cuda")
            if pin_matmul:
                matmul_raw = raw_op("cuda", "matmul", all_reading)
        _SB(target)
        if not target:
            _S("cuda", "conv", "ieee")
            _S("cuda", "rnn", "ieee")
            if all_raw is not None:
                if matmul_raw == "none":
                    _S("cuda", "matmul", "tf32")
                _S("cuda", "all", "ieee")
        return (b, conv_raw, rnn_raw, all_raw, matmul_raw)

    def restore_cudnn(saved: CudnnSaved) -> None:
        """Write back what :func:`save_apply_cudnn` returned."""
        b, conv_raw, rnn_raw, all_raw, matmul_raw = saved
        if all_raw is not None:
            _S("cuda", "all", all_raw)
            if matmul_raw == "none":
                _S("cuda", "matmul", "none")
        _SB(b)
        written = "tf32" if b else "none"
        if conv_raw != written:
            _S("cuda", "conv", conv_raw)
        if rnn_raw != written:
            _S("cuda", "rnn", rnn_raw)

    def reapply_cudnn(target: bool, all_reading: str | None) -> None:
        """Re-establish ``target`` after a block flipped it in a scope that saved nothing."""
        _SB(target)
        if not target:
            _S("cuda", "conv", "ieee")
            _S("cuda", "rnn", "ieee")
            if all_reading is not None and _G("cuda", "all") != all_reading:
                _S("cuda", "all", all_reading)

    def cudnn_all_reading() -> str | None:
        """cuda/all's reading (part of what a cudnn=False scope keeps), None without the API."""
        return _G("cuda", "all")  # type: ignore[no-any-return]

    # -- whole state ----------------------------------------------------------------------

    def save_raw_state() -> RawState:
        """Every raw value: (E, B, the nine slots in ``SLOTS`` order)."""
        raws = [_G("generic", "all"), raw_all("cuda"), raw_all("mkldnn")]
        raws += [raw_op(b, o) for b, o, _ in SLOTS[3:]]
        e = legacy_matmul(raws[3], raws[6])
        b = legacy_cudnn(_G("cuda", "conv"), _G("cuda", "rnn"), raws[4], raws[5])
        return (e, b, tuple(raws))

    def restore_raw_state(state: RawState) -> None:
        """Write back what :func:`save_raw_state` returned (legacy setters first)."""
        e, b, raws = state
        _SM(e)
        _SB(b)
        for (backend, op, _), raw in zip(SLOTS, raws):
            _S(backend, op, raw)

    def read_all() -> FlagReadings:
        """Every reading torch offers, as the user would see it; a raising getter reads RAISES."""
        out: FlagReadings = {
            LEGACY_MATMUL: _try(_GM),
            LEGACY_CUBLAS: _try(_GBLAS),
            LEGACY_CUDNN: _try(_GB),
        }
        for backend, op, name in SLOTS:
            out[name] = _G(backend, op)
        return out

else:  # torch < 2.9: the legacy API alone; E and B are all there is, and always readable.

    def matmul_holds(target: str) -> bool:
        """Whether the matmul precision already is ``target``."""
        return _GM() == target  # type: ignore[no-any-return]

    def save_matmul() -> tuple[str, str, str]:
        """The legacy matmul precision (the slots do not exist here)."""
        return (_GM(), "", "")

    def restore_matmul(saved: tuple[str, str, str]) -> None:
        """Write back what :func:`save_matmul` returned."""
        _SM(saved[0])

    def cudnn_holds(target: bool) -> bool:
        """Whether cuDNN TF32 already is ``target``."""
        return _GB() is target  # type: ignore[no-any-return]

    def save_apply_cudnn(target: bool, pin_matmul: bool) -> CudnnSaved:  # noqa: ARG001
        """Save the cuDNN bool, then apply ``target``."""
        b: bool = _GB()
        _SB(target)
        return (b, "", "", None, None)

    def restore_cudnn(saved: CudnnSaved) -> None:
        """Write back what :func:`save_apply_cudnn` returned."""
        _SB(saved[0])

    def reapply_cudnn(target: bool, all_reading: str | None) -> None:  # noqa: ARG001
        """Re-establish ``target`` after a block flipped it."""
        _SB(target)

    def cudnn_all_reading() -> str | None:
        """None: there is no cuda/all slot before torch 2.9."""
        return None

    def save_raw_state() -> RawState:
        """The legacy matmul precision and cuDNN bool."""
        return (_GM(), _GB(), ())

    def restore_raw_state(state: RawState) -> None:
        """Write back what :func:`save_raw_state` returned."""
        _SM(state[0])
        _SB(state[1])

    def read_all() -> FlagReadings:
        """Every reading torch offers."""
        return {LEGACY_MATMUL: _GM(), LEGACY_CUBLAS: _GBLAS(), LEGACY_CUDNN: _GB()}
