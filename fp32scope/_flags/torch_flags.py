"""Exact reads and writes of torch's float32-precision flags, through whichever API torch has.

torch keeps this state in C++ (``at::Context``):

* the legacy matmul enum E (``"highest"``/``"high"``/``"medium"``),
* the legacy cuDNN bool B,
* since torch 2.9, nine ``fp32_precision`` slots, one per (backend, op), each holding
  ``"none"`` (inherit from the parent: op -> backend/all -> generic/all), ``"ieee"``,
  ``"tf32"`` or ``"bf16"``, and since torch 2.15 ``"bfx9"`` in cuda/matmul only (cuBLAS
  float32 emulated with nine bf16 products; the legacy getters read it as "highest" and
  cuBLAS TF32 off, so that only the slot itself tells it from IEEE).

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

import linecache
from collections.abc import Callable
from typing import Final, NoReturn

import torch

from fp32scope._compat import HAS_BFX9, HAS_PER_BACKEND_API

__all__ = [
    "ALL_HELD_CHECKS",
    "HAS_NEW_API",
    "RAISES",
    "FlagReadings",
    "HeldCheck",
    "RawState",
    "Token",
    "apply",
    "held_check",
    "read_all",
    "restore",
    "restore_raw_state",
    "save_raw_state",
]

_C = torch._C


#: True when torch has the per-backend ``fp32_precision`` API in its torch >= 2.9 form
#: (:data:`fp32scope._compat.HAS_PER_BACKEND_API`, under the name the package grew with).
HAS_NEW_API: Final[bool] = HAS_PER_BACKEND_API
# Bound once for the hot path: whether a cuda/matmul reading can be "bfx9".
_BFX9: Final[bool] = HAS_BFX9

#: The value a reading takes in :func:`read_all` when torch's getter raises (mixed state).
RAISES: Final[str] = "<raises: mixed legacy/new API state>"

FlagReadings = dict[str, str | bool]
#: (E, B, the nine raw slots in ``SLOTS`` order; empty before torch 2.9).
RawState = tuple[str, bool, tuple[str, ...]]
#: (E, cuda/matmul raw, mkldnn/matmul raw).
MatmulSaved = tuple[str, str, str]
#: (B, conv raw, rnn raw, cuda/all raw if moved, cuda/matmul raw if pinned).
CudnnSaved = tuple[bool, str, str, str | None, str | None]
#: (matmul, cudnn, matmul saved, cudnn saved): what apply returns and restore takes. A saved
#: part is None where nothing was written; for a held cudnn=False it is cuda/all's reading.
Token = tuple[str | None, bool | None, MatmulSaved | None, CudnnSaved | str | None]

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

# A value that reads differently from the key, valid on every backend, for probing. Only
# parents (generic/all, <backend>/all) are moved to probe, and they never read "bfx9" (it is
# valid in cuda/matmul only), so "bfx9" is neither a key nor a value here.
_OTHER: Final[dict[str, str]] = {"ieee": "tf32", "tf32": "ieee", "bf16": "ieee", "none": "ieee"}


def _try(getter: object) -> str | bool:
    try:
        return getter()  # type: ignore[operator, no-any-return]
    except RuntimeError:
        return RAISES


MATMUL_READINGS: Final = (
    LEGACY_MATMUL,
    LEGACY_CUBLAS,
    "torch.backends.cuda.matmul.fp32_precision",
    "torch.backends.mkldnn.matmul.fp32_precision",
)
CUDNN_READINGS: Final = (
    LEGACY_CUDNN,
    "torch.backends.cudnn.conv.fp32_precision",
    "torch.backends.cudnn.rnn.fp32_precision",
    "torch.backends.cudnn.fp32_precision",
)


def describe(field: str, applied: object, names: tuple[str, ...]) -> str:
    """Say what ``names`` read now, for a scope that had applied ``applied`` to ``field``."""
    readings = read_all()
    found = ", ".join(f"{n} = {readings[n]!r}" for n in names if n in readings)
    return f"{field} applied as {applied!r}, found {found}"


def _no_new_api(*_args: object) -> NoReturn:
    msg = (
        f"fp32scope: torch {torch.__version__} has no per-backend fp32_precision API "
        "(torch >= 2.9); this function is for torch >= 2.9 only"
    )
    raise RuntimeError(msg)


# The per-backend implementation below is defined on every torch (and bound as the public
# one at the end of the module on torch >= 2.9 only); before 2.9 its getter and setter raise.
_G: Final[Callable[[str, str], str]] = getattr(_C, "_get_fp32_precision_getter", _no_new_api)
_S: Final[Callable[[str, str, str], None]] = getattr(_C, "_set_fp32_precision_setter", _no_new_api)


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
        return _GM()
    except RuntimeError:
        pass
    # With both matmul slots at "ieee" no consistency check can fail, so the getter shows E.
    _S("cuda", "matmul", "ieee")
    _S("mkldnn", "matmul", "ieee")
    try:
        return _GM()
    finally:
        _S("cuda", "matmul", cuda_raw)
        _S("mkldnn", "matmul", mkldnn_raw)


def legacy_cudnn(conv: str, rnn: str, conv_raw: str, rnn_raw: str) -> bool:
    """The legacy cuDNN bool B, also where torch's getter raises."""
    try:
        return _GB()
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
# The hot path: each function reads every value once, probes only where the readings
# leave a raw value open, and writes only what differs.


def apply(t: str | None, b: bool | None) -> Token:  # noqa: C901, PLR0912, PLR0915  (hot path: one flat function on purpose)
    """Apply the fields that are not None; returns the token :func:`restore` takes.

    A field that already holds is not written (and nothing of it is saved). "Holds"
    means that every slot the field governs resolves to what torch's legacy setter
    writes for the value, and the legacy getter shows the value without raising: for
    the matmul field, ``get_float32_matmul_precision()`` returns ``t`` ("highest" for
    "bfx9"), cuda/matmul resolves to tf32 exactly for "high" and "medium" and to bfx9
    exactly for "bfx9", and mkldnn/matmul resolves to tf32 for "high", bf16 for
    "medium" and neither for "highest" and "bfx9" (a slot resolving to "none" computes
    as "ieee"). This is the one definition of "held" for the matmul field; apply and
    restore each inline it. For "highest" and "bfx9" the getter not raising rules out
    tf32 and bf16 in both slots (it raises whenever either resolves to one of them
    while it says "highest"), so only cuda/matmul's bfx9 is read (it reads "highest"
    under bfx9). For "high" and "medium" the getter rules out only the other reduced
    type on oneDNN, so mkldnn/matmul is read; the cuBLAS getter answers True without
    raising exactly when cuda/matmul resolves to tf32 (and is cheaper than the string
    getter). "bfx9" is written as the legacy setter's "highest" (full float32 on
    oneDNN), then cuda/matmul "bfx9". For cuDNN, ``torch.backends.cudnn.allow_tf32`` reads
    ``b`` without raising (so conv and rnn both resolve to tf32 exactly when ``b``)
    and, for False, cudnn.fp32_precision does not read "tf32". :func:`restore` checks
    the same definition on exit. Otherwise the exact raw state is saved first: E, B and
    each written slot's raw value, read off the readings where they decide it and
    probed where they do not.

    cuDNN: torch's legacy setter writes conv and rnn as "none" for False, which
    resolves to tf32 under a tf32 parent (cudnn.fp32_precision, cuda/all, or
    torch.backends.fp32_precision), and Inductor's Triton conv templates read cuda/all
    itself; so where cuda/all reads "tf32", False also moves it to "ieee", pinning
    cuda/matmul (when this scope leaves the matmul precision alone) to the value it read.
    """
    sm: MatmulSaved | None = None
    all_reading: str | None = None  # cuda/all: read at most once, SM does not write it
    if t is not None:
        try:
            e: str | None = _GM()
        except RuntimeError:
            e = None
        if t == "highest":
            held = e == t and (not _BFX9 or _G("cuda", "matmul") != "bfx9")
        elif t == "bfx9":
            held = e == "highest" and _G("cuda", "matmul") == "bfx9"
        else:
            held = e == t
            if held:
                try:
                    held = _GBLAS() is True and _G("mkldnn", "matmul") == SM_WRITES_MKLDNN[t]
                except RuntimeError:
                    held = False
        if not held:
            r = _G("cuda", "matmul")
            if r == "none":
                cuda_raw = r  # an explicit ieee/tf32 would read as such
            else:
                all_reading = _G("cuda", "all")
                cuda_raw = r if r != all_reading else raw_op("cuda", "matmul", all_reading)
            r = _G("mkldnn", "matmul")
            mkldnn_raw = r if r == "none" or r != _G("mkldnn", "all") else raw_op("mkldnn", "matmul")
            if e is None:
                e = legacy_matmul(cuda_raw, mkldnn_raw)
            if t == "bfx9":
                _SM("highest")
                _S("cuda", "matmul", "bfx9")
            else:
                _SM(t)
            sm = (e, cuda_raw, mkldnn_raw)
    if b is None:
        return (t, b, sm, None)
    try:
        try:
            cur: bool | None = _GB()
        except RuntimeError:
            cur = None
        if cur is b:
            # No raise: conv and rnn both read tf32 iff b.
            if b:
                return (t, b, sm, None)
            if all_reading is None:
                all_reading = _G("cuda", "all")
            if all_reading != "tf32":
                return (t, b, sm, all_reading)  # held; the reading lets a flip be undone
        elif all_reading is None:
            all_reading = _G("cuda", "all")
        conv = _G("cuda", "conv")
        rnn = _G("cuda", "rnn")
        conv_raw = conv if conv == "none" or conv != all_reading else raw_op("cuda", "conv", all_reading)
        rnn_raw = rnn if rnn == "none" or rnn != all_reading else raw_op("cuda", "rnn", all_reading)
        if cur is None:
            cur = legacy_cudnn(conv, rnn, conv_raw, rnn_raw)
        all_raw: str | None = None
        matmul_raw: str | None = None
        if not b and all_reading == "tf32":
            all_raw = raw_all("cuda")
            if sm is None:  # this scope leaves the matmul precision alone: pin it
                matmul_raw = raw_op("cuda", "matmul", all_reading)
        # The legacy setter writes conv and rnn as "none" for False; they then resolve
        # through cuda/all, which after this reads ieee or none: never tf32.
        _SB(b)
        if all_raw is not None:
            if matmul_raw == "none":
                _S("cuda", "matmul", "tf32")
            _S("cuda", "all", "ieee")
    except BaseException:
        if sm is not None:  # only an interrupt or a torch error gets here: undo the matmul field
            restore((t, None, sm, None))
        raise
    return (t, b, sm, (cur, conv_raw, rnn_raw, all_raw, matmul_raw))


def restore(token: Token) -> str | None:  # noqa: C901, PLR0912, PLR0915  (hot path: inlined on purpose)
    """Undo what :func:`apply` did; say what the block changed, if it changed what was applied.

    Restores in the reverse order of :func:`apply`. Where a field was already held
    (nothing saved), a block that broke it gets the field re-applied.
    """
    t, b, sm, sc = token
    note = None
    if b is not None:
        try:
            ok = _GB() is b
        except RuntimeError:
            ok = False
        if ok and not b:
            ok = _G("cuda", "all") != "tf32"
        if not ok:
            note = describe("cudnn_allow_tf32", b, CUDNN_READINGS)
        if type(sc) is tuple:
            cur, conv_raw, rnn_raw, all_raw, matmul_raw = sc
            if all_raw is not None:
                _S("cuda", "all", all_raw)
                if matmul_raw == "none":
                    _S("cuda", "matmul", "none")
            _SB(cur)
            written = "tf32" if cur else "none"
            if conv_raw != written:
                _S("cuda", "conv", conv_raw)
            if rnn_raw != written:
                _S("cuda", "rnn", rnn_raw)
        elif not ok:
            # The scope saved nothing: re-establish b. For False, cuda/all goes back to the
            # reading it had; where a parent the block changed still makes that tf32 (an
            # inherited "none"), to "ieee".
            _SB(b)
            if isinstance(sc, str) and _G("cuda", "all") != sc:
                _S("cuda", "all", sc)
                if _G("cuda", "all") == "tf32":
                    _S("cuda", "all", "ieee")
    if t is not None:
        try:  # "held" as apply defines it: the exit check uses the entry's definition
            if t == "highest":
                ok = _GM() == t and (not _BFX9 or _G("cuda", "matmul") != "bfx9")
            elif t == "bfx9":
                ok = _GM() == "highest" and _G("cuda", "matmul") == "bfx9"
            else:
                ok = _GM() == t and _GBLAS() is True and _G("mkldnn", "matmul") == SM_WRITES_MKLDNN[t]
        except RuntimeError:
            ok = False
        if not ok:
            found = describe("matmul precision", t, MATMUL_READINGS)
            note = found if note is None else f"{found}; {note}"
        if sm is not None:
            e, cuda_raw, mkldnn_raw = sm
            _SM(e)
            if cuda_raw != SM_WRITES_CUDA[e]:
                _S("cuda", "matmul", cuda_raw)
            if mkldnn_raw != SM_WRITES_MKLDNN[e]:
                _S("mkldnn", "matmul", mkldnn_raw)
        elif not ok:
            _SM("highest" if t == "bfx9" else t)
            if t == "bfx9":
                _S("cuda", "matmul", "bfx9")
    return note


# -- held checks: the scope's fast path ---------------------------------------------
# Where a scope finds its precision held (the common case of a node whose precision is the
# process default), apply and restore would run their whole branch chains to write nothing.
# A held check is one function per precision, made from the sources below by joining the
# fields' tests: on entry and on exit the scope calls it and runs apply and restore only
# where it fails. Each field's test is its "held" of apply's docstring, as apply and
# restore inline it; tests/flags/test_held.py checks that a held check returns exactly
# the token apply returns where apply writes nothing, and None everywhere else.

_MATMUL_HELD: Final[dict[str, str]] = {
    "highest": '_GM() == "highest"' + (' and _G("cuda", "matmul") != "bfx9"' if _BFX9 else ""),
    "bfx9": '_GM() == "highest" and _G("cuda", "matmul") == "bfx9"',
    "high": '_GM() == "high" and _GBLAS() is True and _G("mkldnn", "matmul") == "tf32"',
    "medium": '_GM() == "medium" and _GBLAS() is True and _G("mkldnn", "matmul") == "bf16"',
}
# cuDNN first: in the usual switch (a full-float32 node under a TF32 default) its one read
# fails the check, and it is the cheaper getter. False keeps cuda/all's reading in the
# token, as apply does, so that restore can undo a block's flip of it.
_CUDNN_HELD: Final[dict[bool, str]] = {
    True: "_GB() is True",
    False: '_GB() is False and (r := _G("cuda", "all")) != "tf32"',
}
_LEGACY_MATMUL_HELD: Final[dict[str, str]] = {t: f"_GM() == {t!r}" for t in ("highest", "high", "medium")}
_LEGACY_CUDNN_HELD: Final[dict[bool, str]] = {True: "_GB() is True", False: "_GB() is False"}

HeldCheck = Callable[[], "Token | None"]


def _make_held_check(
    t: str | None, b: bool | None, matmul: dict[str, str], cudnn: dict[bool, str], cudnn_reading: bool
) -> HeldCheck:
    tests = ([] if b is None else [cudnn[b]]) + ([] if t is None else [matmul[t]])
    kept = "r" if b is False and cudnn_reading else "None"
    source = (
        "def held():\n"
        "    try:\n"
        f"        if {' and '.join(tests)}:\n"
        f"            return ({t!r}, {b!r}, None, {kept})\n"
        "    except RuntimeError:\n"
        "        pass\n"
        "    return None\n"
    )
    api = "new" if cudnn_reading else "legacy"
    filename = f"<fp32scope held check {t!r}, {b!r} ({api} API)>"
    namespace: dict[str, object] = {}
    exec(compile(source, filename, "exec"), globals(), namespace)  # noqa: S102
    # Tracebacks through a held check show its lines, as they do for attrs' generated methods.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    held: HeldCheck = namespace["held"]  # type: ignore[assignment]
    held.__qualname__ = held.__name__ = f"held_{t}_{b}"
    return held


def _held_checks(matmul: dict[str, str], cudnn: dict[bool, str], *, cudnn_reading: bool) -> dict[Fields, HeldCheck]:
    # Every precision's, made once at import (a fixed, small set): so that the scope can
    # keep Dynamo out of their frames, as out of every other function here.
    return {
        (t, b): _make_held_check(t, b, matmul, cudnn, cudnn_reading)
        for t in (None, *matmul)
        for b in (None, True, False)
        if t is not None or b is not None
    }


Fields = tuple[str | None, bool | None]
_HELD_CHECKS: Final = _held_checks(_MATMUL_HELD, _CUDNN_HELD, cudnn_reading=True)
_LEGACY_HELD_CHECKS: Final = _held_checks(_LEGACY_MATMUL_HELD, _LEGACY_CUDNN_HELD, cudnn_reading=False)
#: Every held check, for the scope's Dynamo exclusion.
ALL_HELD_CHECKS: Final[tuple[HeldCheck, ...]] = (*_HELD_CHECKS.values(), *_LEGACY_HELD_CHECKS.values())


def held_check(t: str | None, b: bool | None) -> HeldCheck:
    """The held check of (``t``, ``b``), not both None: apply's token where it would write nothing, else None."""
    return _HELD_CHECKS[t, b]


def legacy_held_check(t: str | None, b: bool | None) -> HeldCheck:
    """:func:`held_check` for :func:`legacy_apply` (before torch 2.9: the legacy getters alone)."""
    return _LEGACY_HELD_CHECKS[t, b]


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
    for (backend, op, _), raw in zip(SLOTS, raws, strict=True):
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


# The legacy-API-only implementation: what torch < 2.9 gets. Defined on every torch so that
# the tests can run it on a new torch too (through legacy writes only, which keep the two
# APIs consistent).


def legacy_apply(t: str | None, b: bool | None) -> Token:
    """Apply the fields that are not None through the legacy API; returns the token.

    Before torch 2.9 the enum E is the whole matmul state (cuBLAS TF32 for "high" and
    "medium", oneDNN bf16 for "medium") and the bool B the whole cuDNN state, so a field
    "holds" (every backend it governs computes as the legacy setter leaves it) exactly
    when E or B equals it. torch 2.7 and 2.8's oneDNN TF32 bool (Intel GPUs) is written by
    no matmul setter, so it is not part of the matmul field and never touched here.
    """
    sm: MatmulSaved | None = None
    if t is not None:
        e: str = _GM()
        if e != t:
            _SM(t)
            sm = (e, "", "")
    sc: CudnnSaved | None = None
    if b is not None:
        try:
            cur: bool = _GB()
            if cur is not b:
                _SB(b)
                sc = (cur, "", "", None, None)
        except BaseException:
            if sm is not None:  # only an interrupt or a torch error gets here: undo the matmul field
                _SM(sm[0])
            raise
    return (t, b, sm, sc)


def legacy_restore(token: Token) -> str | None:
    """Undo what :func:`legacy_apply` did; say what the block changed, if anything."""
    t, b, sm, sc = token
    note = None
    if b is not None:
        ok = _GB() is b
        if not ok:
            note = describe("cudnn_allow_tf32", b, CUDNN_READINGS)
        if type(sc) is tuple:
            _SB(sc[0])
        elif not ok:
            _SB(b)
    if t is not None:
        ok = _GM() == t
        if not ok:
            found = describe("matmul precision", t, MATMUL_READINGS)
            note = found if note is None else f"{found}; {note}"
        if sm is not None:
            _SM(sm[0])
        elif not ok:
            _SM(t)
    return note


def legacy_save_raw_state() -> RawState:
    """The legacy matmul precision and cuDNN bool."""
    return (_GM(), _GB(), ())


def legacy_restore_raw_state(state: RawState) -> None:
    """Write back what :func:`legacy_save_raw_state` returned."""
    _SM(state[0])
    _SB(state[1])


def legacy_read_all() -> FlagReadings:
    """Every reading torch offers."""
    return {LEGACY_MATMUL: _GM(), LEGACY_CUBLAS: _GBLAS(), LEGACY_CUDNN: _GB()}


if not HAS_NEW_API:
    apply = legacy_apply
    restore = legacy_restore
    held_check = legacy_held_check
    save_raw_state = legacy_save_raw_state
    restore_raw_state = legacy_restore_raw_state
    read_all = legacy_read_all
