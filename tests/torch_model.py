"""A pure-Python model of torch's float32-precision state (``at::Context``, torch >= 2.9).

The tests drive torch and this model with the same writes and require every reading to
agree, so the model is checked against torch itself at every step; it then serves as the
reference for what a scope must restore, including the raw values no getter shows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from fp32scope import _flags

LEGACY_SM_CUDA = {"highest": "ieee", "high": "tf32", "medium": "tf32"}
LEGACY_SM_MKLDNN = {"highest": "ieee", "high": "tf32", "medium": "bf16"}


def fresh_slots() -> dict[tuple[str, str], str]:
    slots = {(b, o): "none" for b, o, _ in _flags.SLOTS}
    slots["cuda", "conv"] = "tf32"
    slots["cuda", "rnn"] = "tf32"
    return slots


@dataclass
class TorchModel:
    """Raw state: the legacy enum E, the legacy cuDNN bool B, and the nine raw slots."""

    e: str = "highest"
    b: bool = True
    slots: dict[tuple[str, str], str] = field(default_factory=fresh_slots)

    @classmethod
    def from_raw(cls, raw: _flags.RawState) -> TorchModel:
        e, b, values = raw
        return cls(e, b, {(bk, op): v for (bk, op, _), v in zip(_flags.SLOTS, values, strict=True)})

    def raw(self) -> _flags.RawState:
        return (self.e, self.b, tuple(self.slots[bk, op] for bk, op, _ in _flags.SLOTS))

    def copy(self) -> TorchModel:
        return copy.deepcopy(self)

    # -- resolution and legacy checks, as in aten/src/ATen/Context.cpp -------------------

    def resolve(self, backend: str, op: str) -> str:
        p = self.slots[backend, op]
        if p == "none":
            p = self.slots[backend, "all"]
        if p == "none":
            p = self.slots["generic", "all"]
        if backend == "cuda" and p == "bf16":
            return "none"
        return p

    def legacy_matmul(self) -> str:
        cm, mm = self.resolve("cuda", "matmul"), self.resolve("mkldnn", "matmul")
        invalid = (
            (cm == "tf32" and self.e == "highest")
            or (mm == "bf16" and self.e != "medium")
            or (mm == "tf32" and self.e != "high")
        )
        return _flags.RAISES if invalid else self.e

    def legacy_cublas(self) -> bool | str:
        new = self.resolve("cuda", "matmul") == "tf32"
        return _flags.RAISES if (self.e != "highest") != new else new

    def legacy_cudnn(self) -> bool | str:
        rnn = self.resolve("cuda", "rnn") == "tf32"
        conv = self.resolve("cuda", "conv") == "tf32"
        return self.b if rnn == conv == self.b else _flags.RAISES

    def readings(self) -> _flags.FlagReadings:
        out: _flags.FlagReadings = {
            _flags.LEGACY_MATMUL: self.legacy_matmul(),
            _flags.LEGACY_CUBLAS: self.legacy_cublas(),
            _flags.LEGACY_CUDNN: self.legacy_cudnn(),
        }
        for backend, op, name in _flags.SLOTS:
            out[name] = self.resolve(backend, op)
        return out

    # -- writes: each applies to torch and to the model ----------------------------------

    def set_matmul_precision(self, value: str) -> None:
        torch.set_float32_matmul_precision(value)
        self.e = value
        self.slots["cuda", "matmul"] = LEGACY_SM_CUDA[value]
        self.slots["mkldnn", "matmul"] = LEGACY_SM_MKLDNN[value]

    def set_cublas_allow_tf32(self, value: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32 = value
        self.e = "high" if value else "highest"
        self.slots["cuda", "matmul"] = "tf32" if value else "ieee"

    def set_cudnn_allow_tf32(self, value: bool) -> None:
        torch.backends.cudnn.allow_tf32 = value
        self.b = value
        self.slots["cuda", "conv"] = self.slots["cuda", "rnn"] = "tf32" if value else "none"

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
            assert target[0] == "cuda"
            assert value == "bf16"
            return False
        self.slots[target] = value
        return True
