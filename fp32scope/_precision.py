"""The ``Fp32Precision`` value type and the checks on user input."""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["MATMUL_PRECISIONS", "Fp32Precision", "MatmulPrecision", "check_backward", "check_precision"]

MatmulPrecision = Literal["highest", "high", "medium"]

#: The values ``Fp32Precision.matmul`` accepts, in torch's own vocabulary.
MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")


class Fp32Precision(NamedTuple):
    """A float32 math precision for a region of code: one value per process-wide flag.

    ``matmul`` is torch's float32 matmul precision (``"highest"``, ``"high"`` or
    ``"medium"``, as for :func:`torch.set_float32_matmul_precision`);
    ``cudnn_allow_tf32`` says whether cuDNN convolutions and RNNs may use TF32. A field
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


def _where(node: str | None) -> str:
    return f" of node {node!r}" if node is not None else ""


def check_matmul(value: object, *, field: str, node: str | None = None) -> MatmulPrecision | None:
    """Return ``value`` if it is a valid matmul precision or None, else raise naming ``field``."""
    if value is None:
        return None
    if not isinstance(value, str):
        msg = (
            f"{field}{_where(node)} must be a str, one of {', '.join(map(repr, MATMUL_PRECISIONS))}, "
            f"or None; got {value!r} of type {type(value).__name__}."
        )
        raise TypeError(msg)
    if value not in MATMUL_PRECISIONS:
        hint = ""
        if value.lower() in MATMUL_PRECISIONS:
            hint = f" (use lower case: {value.lower()!r})"
        msg = (
            f"{field}{_where(node)} must be one of {', '.join(map(repr, MATMUL_PRECISIONS))} "
            f"or None; got {value!r}{hint}."
        )
        raise ValueError(msg)
    return value  # type: ignore[return-value]  # narrowed by the membership test above


def check_cudnn(value: object, *, field: str, node: str | None = None) -> bool | None:
    """Return ``value`` if it is a bool or None, else raise naming ``field``."""
    # bool only: 0/1 and numpy bools would be accepted by torch but usually mean a mix-up.
    if value is None or type(value) is bool:
        return value
    msg = f"{field}{_where(node)} must be True, False or None; got {value!r} of type {type(value).__name__}."
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
