"""A pure-Python model of torch's float32-precision state (``at::Context``), for every release.

The tests drive torch and this model with the same writes and require every reading to
agree, so the model is checked against torch itself at every step; it then serves as the
reference for what a scope must restore, including the raw values no getter shows.

On torch >= 2.9 (``_flags.HAS_NEW_API``) the state is the legacy enum E, the legacy cuDNN
bool B and the nine raw ``fp32_precision`` slots. Before 2.9 it is E and B alone: cuBLAS
TF32 is ``E != "highest"`` and oneDNN's bf16 matmul is ``E == "medium"``, with no slot to
disagree with them. torch 2.7 and 2.8 also have a legacy oneDNN TF32 bool
(``torch.backends.mkldnn.allow_tf32``) that only Intel GPU (XPU) builds store: elsewhere
its setter only warns and its getter returns None. No matmul setter writes it, so the
model carries it as a value that only its own setter changes.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import torch

from fp32scope._flags import torch_flags as _flags

LEGACY_SM_CUDA = {"highest": "ieee", "high": "tf32", "medium": "tf32"}
LEGACY_SM_MKLDNN = {"highest": "ieee", "high": "tf32", "medium": "bf16"}
#: What applying each matmul precision leaves: the legacy setter's writes, and for "bfx9"
#: (torch >= 2.15) the legacy "highest" with cuda/matmul "bfx9".
LEGACY_WORD = {"highest": "highest", "high": "high", "medium": "medium", "bfx9": "highest"}
APPLIED_CUDA = {**LEGACY_SM_CUDA, "bfx9": "bfx9"}
APPLIED_MKLDNN = {**LEGACY_SM_MKLDNN, "bfx9": "ieee"}

#: torch has the legacy oneDNN TF32 bool (2.7 and later; on a build without XPU it reads None).
HAS_ONEDNN_BOOL = hasattr(torch._C, "_get_onednn_allow_tf32")
ONEDNN_READING = "torch.backends.mkldnn.allow_tf32"


def fresh_slots() -> dict[tuple[str, str], str]:
    if not _flags.HAS_NEW_API:
        return {}
    slots = {(b, o): "none" for b, o, _ in _flags.SLOTS}
    slots["cuda", "conv"] = "tf32"
    slots["cuda", "rnn"] = "tf32"
    return slots


def read_onednn_bool() -> bool | None:
    """What ``torch.backends.mkldnn.allow_tf32`` reads (None where torch has no such flag)."""
    if not HAS_ONEDNN_BOOL:
        return None
    value: bool | None = torch._C._get_onednn_allow_tf32()
    return value


def computes(resolved: str) -> str:
    """What a resolved slot makes a kernel do: "none" (nothing set anywhere) computes as "ieee"."""
    return "ieee" if resolved == "none" else resolved


@dataclass
class TorchModel:
    """Raw state: the legacy enum E, the legacy cuDNN bool B, the raw slots (none before 2.9)."""

    e: str = "highest"
    b: bool = True
    slots: dict[tuple[str, str], str] = field(default_factory=fresh_slots)
    # The oneDNN TF32 bool as torch reads it: None on builds that do not store it.
    onednn: bool | None = field(default_factory=read_onednn_bool)

    @classmethod
    def from_raw(cls, raw: _flags.RawState) -> TorchModel:
        e, b, values = raw
        slots = {(bk, op): v for (bk, op, _), v in zip(_flags.SLOTS, values, strict=True)} if values else {}
        return cls(e, b, slots)

    def raw(self) -> _flags.RawState:
        return (self.e, self.b, tuple(self.slots[bk, op] for bk, op, _ in _flags.SLOTS) if self.slots else ())

    def copy(self) -> TorchModel:
        return copy.deepcopy(self)

    # -- resolution and legacy checks, as in aten/src/ATen/Context.cpp -------------------

    def resolve(self, backend: str, op: str) -> str:
        """The new API's reading of (backend, op); on a legacy release, what E and B imply."""
        if not self.slots:
            if op == "matmul":
                return (LEGACY_SM_CUDA if backend == "cuda" else LEGACY_SM_MKLDNN)[self.e]
            if backend == "cuda" and op in ("conv", "rnn"):
                return "tf32" if self.b else "ieee"
            return "ieee"
        p = self.slots[backend, op]
        if p == "none":
            p = self.slots[backend, "all"]
        if p == "none":
            p = self.slots["generic", "all"]
        if backend == "cuda" and p == "bf16":
            return "none"
        return p

    def legacy_matmul(self) -> str:
        if not self.slots:
            return self.e
        cm, mm = self.resolve("cuda", "matmul"), self.resolve("mkldnn", "matmul")
        invalid = (
            (cm == "tf32" and self.e == "highest")
            or (cm == "bfx9" and self.e != "highest")
            or (mm == "bf16" and self.e != "medium")
            or (mm == "tf32" and self.e != "high")
        )
        return _flags.RAISES if invalid else self.e

    def legacy_cublas(self) -> bool | str:
        if not self.slots:
            return self.e != "highest"
        new = self.resolve("cuda", "matmul") == "tf32"
        return _flags.RAISES if (self.e != "highest") != new else new

    def legacy_cudnn(self) -> bool | str:
        if not self.slots:
            return self.b
        rnn = self.resolve("cuda", "rnn") == "tf32"
        conv = self.resolve("cuda", "conv") == "tf32"
        return self.b if rnn == conv == self.b else _flags.RAISES

    def readings(self) -> _flags.FlagReadings:
        out: _flags.FlagReadings = {
            _flags.LEGACY_MATMUL: self.legacy_matmul(),
            _flags.LEGACY_CUBLAS: self.legacy_cublas(),
            _flags.LEGACY_CUDNN: self.legacy_cudnn(),
        }
        if self.slots:
            for backend, op, name in _flags.SLOTS:
                out[name] = self.resolve(backend, op)
        return out

    # -- what a scope's fast path may treat as already applied (issue 7, defect 5) -------

    def matmul_holds(self, t: str) -> bool:
        """The legacy getter says ``t``, and every matmul slot computes as the legacy setter's write.

        That is what ``torch.set_float32_matmul_precision(t)`` would leave: cuBLAS and oneDNN
        matmuls both. A oneDNN slot moved by the new API (e.g. to "none" after "medium")
        does not hold, although no legacy getter shows it.
        """
        return (
            self.legacy_matmul() == LEGACY_WORD[t]
            and computes(self.resolve("cuda", "matmul")) == APPLIED_CUDA[t]
            and computes(self.resolve("mkldnn", "matmul")) == APPLIED_MKLDNN[t]
        )

    def cudnn_holds(self, b: bool) -> bool:
        """The legacy getter says ``b``; conv and rnn compute as ``cudnn.allow_tf32 = b`` makes them.

        For False the library's contract adds that ``torch.backends.cudnn.fp32_precision``
        (cuda/all, which Inductor's Triton conv templates read) is not "tf32".
        """
        want = "tf32" if b else "ieee"
        return (
            self.legacy_cudnn() is b
            and computes(self.resolve("cuda", "conv")) == want
            and computes(self.resolve("cuda", "rnn")) == want
            and (b or self.resolve("cuda", "all") != "tf32")
        )

    # -- writes: each applies to torch and to the model ----------------------------------

    def set_matmul_precision(self, value: str) -> None:
        torch.set_float32_matmul_precision(value)
        self.e = value
        if self.slots:
            self.slots["cuda", "matmul"] = LEGACY_SM_CUDA[value]
            self.slots["mkldnn", "matmul"] = LEGACY_SM_MKLDNN[value]

    def set_cublas_allow_tf32(self, value: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32 = value
        self.e = "high" if value else "highest"
        if self.slots:
            self.slots["cuda", "matmul"] = "tf32" if value else "ieee"

    def set_cudnn_allow_tf32(self, value: bool) -> None:
        torch.backends.cudnn.allow_tf32 = value
        self.b = value
        if self.slots:
            self.slots["cuda", "conv"] = self.slots["cuda", "rnn"] = "tf32" if value else "none"

    def set_onednn_allow_tf32(self, value: bool) -> None:
        """``torch.backends.mkldnn.allow_tf32 = value``: stored by XPU builds only."""
        with warnings.catch_warnings():
            # Without XPU, torch warns "TF32 acceleration on top of oneDNN is available for
            # Intel GPUs" and keeps nothing; the model says so (the reading stays None).
            warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN", category=UserWarning)
            # The attribute a user writes (typed as torch's ContextProp descriptor, hence setattr).
            setattr(torch.backends.mkldnn, "allow_tf32", value)  # noqa: B010
        if self.onednn is not None:
            self.onednn = value

    def set_slot(self, backend: str, op: str, value: str) -> bool:
        """Write through the Python attribute a user would use; False where torch refuses."""
        name = _flags.SLOT_NAMES[backend, op]
        target = (backend, op)
        if name == "torch.backends.mkldnn.fp32_precision":
            target = ("generic", "all")  # torch's quirk: this setter writes generic/all
        *path, attribute = name.split(".")
        obj: object = torch
        for part in path[1:]:
            obj = getattr(obj, part)
        try:
            setattr(obj, attribute, value)
        except RuntimeError:
            # cuda refuses bf16; only cuda/matmul takes bfx9 (torch >= 2.15, else no slot).
            assert (target[0] == "cuda" and value == "bf16") or (value == "bfx9" and target != ("cuda", "matmul"))
            return False
        self.slots[target] = value
        return True


#: One write a user can make: ("legacy", matmul word), ("cudnn", bool), or, on torch >= 2.9,
#: ((backend, op), slot value).
Write = tuple[Any, Any]


def flag_writes(max_size: int) -> st.SearchStrategy[list[Write]]:
    """Sequences of up to ``max_size`` writes of the flags, through the APIs a user would use."""
    kinds = [
        st.tuples(st.just("legacy"), st.sampled_from(["highest", "high", "medium"])),
        st.tuples(st.just("cudnn"), st.booleans()),
    ]
    if _flags.HAS_NEW_API:  # before torch 2.9 the legacy writes are all there is
        kinds.append(
            st.tuples(st.sampled_from([(b, o) for b, o, _ in _flags.SLOTS]), st.sampled_from(["none", "ieee", "tf32"]))
        )
    return st.lists(st.one_of(*kinds), max_size=max_size)


def apply_writes(model: TorchModel, sequence: list[Write]) -> None:
    """Make each write to torch and to ``model`` alike."""
    for key, value in sequence:
        if key == "legacy":
            model.set_matmul_precision(str(value))
        elif key == "cudnn":
            model.set_cudnn_allow_tf32(bool(value))
        else:
            model.set_slot(key[0], key[1], str(value))
