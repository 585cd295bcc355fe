"""The ``Fp32Precision`` value type and the checks on user input."""

from __future__ import annotations

from typing import Literal, NamedTuple

from fp32scope._compat import BFX9_RELEASE, HAS_BFX9, TORCH_RELEASE

__all__ = ["MATMUL_PRECISIONS", "MATMUL_WORDS", "Fp32Precision", "MatmulPrecision", "check_backward", "check_precision"]

MatmulPrecision = Literal["highest", "high", "medium", "bfx9"]

#: Every value ``Fp32Precision.matmul`` knows: torch's legacy words, and "bfx9" (torch >= 2.15).
MATMUL_WORDS: tuple[str, ...] = ("highest", "high", "medium", "bfx9")
#: The values ``Fp32Precision.matmul`` accepts on the installed torch, in torch's own vocabulary.
MATMUL_PRECISIONS: tuple[str, ...] = MATMUL_WORDS if HAS_BFX9 else MATMUL_WORDS[:3]


class Fp32Precision(NamedTuple):
    """A float32 math precision for a region of code: one value per process-wide flag.

    ``matmul`` is torch's float32 matmul precision (``"highest"``, ``"high"`` or
    ``"medium"``, as for :func:`torch.set_float32_matmul_precision`), or, from torch
    2.15, ``"bfx9"``: cuBLAS float32 matmuls emulated with nine bfloat16 products
    (``torch.backends.cuda.matmul.fp32_precision = "bfx9"``), nearly as accurate as float32
    but not IEEE float32, and faster on compute-bound GEMMs on Blackwell GPUs (small or
    skinny shapes may be slower); oneDNN (CPU) matmuls run in full float32 under it, and
    torch's legacy getter reads it as ``"highest"``. ``"bfx9"`` on an older torch is a
    :class:`ValueError`. ``cudnn_allow_tf32`` says whether cuDNN convolutions and RNNs may use TF32. A field
    that is None leaves the process value of that flag as it is.

    Construction does not check the values (it is a plain :class:`~typing.NamedTuple`);
    every function that takes a precision checks it first and raises
    :class:`TypeError` or :class:`ValueError` naming the field.

    >>> Fp32Precision("highest", cudnn_allow_tf32=False)
    Fp32Precision(matmul='highest', cudnn_allow_tf32=False)
    >>> Fp32Precision().is_noop
    True
    """

    matmul: MatmulPrecision | None = None
    cudnn_allow_tf32: bool | None = None

    @property
    def is_noop(self) -> bool:
        """True when both fields are None, so that applying it changes nothing."""
        return self.matmul is None and self.cudnn_allow_tf32 is None


# Words of torch's per-backend API (``fp32_precision``: "ieee", "tf32", "bf16") and common
# names for the same thing, as users write them for ``matmul``: the value meant in torch's
# legacy vocabulary, which is the one ``Fp32Precision`` uses.
_MATMUL_SYNONYMS: dict[str, str] = {
    "ieee": "highest",
    "fp32": "highest",
    "float32": "highest",
    "full": "highest",
    "tf32": "high",
    "tensorfloat32": "high",
    "bf16": "medium",
    "bfloat16": "medium",
    "bf16x9": "bfx9",
}
# The same words for ``cudnn_allow_tf32``, a bool.
_CUDNN_SYNONYMS: dict[str, bool] = {"tf32": True, "ieee": False, "fp32": False, "float32": False}


def _matmul_hint(value: str) -> str:
    lower = value.lower()
    if lower in MATMUL_PRECISIONS:
        return f" (use lower case: {lower!r})"
    if lower == "none":
        return " (to leave the flag as it is, pass None, not the string 'none')"
    meant = _MATMUL_SYNONYMS.get(lower.replace("-", "").replace("_", ""))
    if meant == "bfx9":
        return f" (torch's word for {value!r} is 'bfx9')"
    if meant is not None:
        return (
            f" (Fp32Precision uses the words of torch.set_float32_matmul_precision, not those of the "
            f"fp32_precision attributes: for {value!r} write {meant!r})"
        )
    return ""


def _where(node: str | None) -> str:
    return f" of node {node!r}" if node is not None else ""


def _no_bfx9(field: str, node: str | None) -> ValueError:
    msg = (
        f"{field}{_where(node)} is 'bfx9' (cuBLAS float32 emulated with nine bf16 products), which torch "
        f"{TORCH_RELEASE} does not have: it came in torch {BFX9_RELEASE}. Upgrade torch, or use 'highest' "
        "for full float32."
    )
    return ValueError(msg)


def check_matmul(value: object, *, field: str, node: str | None = None) -> MatmulPrecision | None:
    """Return ``value`` if it is a valid matmul precision or None, else raise naming ``field``.

    "bfx9" on a torch without it raises a :class:`ValueError` naming the release that brings it.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        msg = (
            f"{field}{_where(node)} must be a str, one of {', '.join(map(repr, MATMUL_PRECISIONS))}, "
            f"or None; got {value!r} of type {type(value).__name__}."
        )
        raise TypeError(msg)
    if value not in MATMUL_PRECISIONS:
        if value == "bfx9":
            raise _no_bfx9(field, node)
        msg = (
            f"{field}{_where(node)} must be one of {', '.join(map(repr, MATMUL_PRECISIONS))} "
            f"or None; got {value!r}{_matmul_hint(value)}."
        )
        raise ValueError(msg)
    return value  # type: ignore[return-value]  # narrowed by the membership test above


def check_cudnn(value: object, *, field: str, node: str | None = None) -> bool | None:
    """Return ``value`` if it is a bool or None, else raise naming ``field``."""
    # bool only: 0/1 and numpy bools would be accepted by torch but usually mean a mix-up.
    if value is None or type(value) is bool:
        return value
    hint = ""
    if isinstance(value, str) and value.lower() in _CUDNN_SYNONYMS:
        hint = f" (for {value!r} write {_CUDNN_SYNONYMS[value.lower()]!r}: the field says whether cuDNN may use TF32)"
    msg = f"{field}{_where(node)} must be True, False or None; got {value!r} of type {type(value).__name__}{hint}."
    raise TypeError(msg)


def check_precision(value: object, *, argument: str = "precision") -> Fp32Precision | None:
    """Return ``value`` as a checked ``Fp32Precision`` or None; raise before anything changes.

    Anything that is not an ``Fp32Precision`` or None is a :class:`TypeError` (a plain
    tuple is refused too: its fields have no names to check against).
    """
    if value is None:
        return None
    if not isinstance(value, Fp32Precision):
        msg = (
            f"{argument} must be an fp32scope.Fp32Precision or None; got {value!r} of type "
            f"{type(value).__name__}. Build one with Fp32Precision(matmul=..., cudnn_allow_tf32=...)."
        )
        raise TypeError(msg)
    check_matmul(value.matmul, field=f"{argument}.matmul")
    check_cudnn(value.cudnn_allow_tf32, field=f"{argument}.cudnn_allow_tf32")
    return value


def check_backward(value: object) -> bool:
    """Return ``value`` if it is a bool, else raise naming the ``backward`` argument."""
    if type(value) is bool:
        return value
    msg = (
        f"backward must be True (scope the node's backward too, the default) or False (forward only); "
        f"got {value!r} of type {type(value).__name__}."
    )
    raise TypeError(msg)


# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
Fp32Precision.__module__ = "fp32scope"
