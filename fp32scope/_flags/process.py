"""Process-wide default precision, and reading the process state as an ``Fp32Precision``."""

from __future__ import annotations

import threading

from fp32scope._errors import Fp32ScopeError
from fp32scope._flags import torch_flags
from fp32scope._flags.precision import Fp32Precision, MatmulPrecision
from fp32scope._flags.scope import active_scope_thread, conflict_error, split

__all__ = ["current_fp32_precision", "set_process_default"]


def set_process_default(precision: Fp32Precision | None) -> None:
    """Set the process-wide float32 precision, consistently in torch's legacy and new APIs.

    Typically called once at start-up, e.g. ``set_process_default(Fp32Precision("high",
    True))``; scopes then change it around the nodes that declare their own. A field that
    is None is left as it is. Afterwards the legacy and new readings of each set flag agree
    (``torch.backends.cudnn.allow_tf32 = False`` alone can leave cuDNN resolving to TF32
    under a TF32 parent slot; this writes the conv and rnn slots explicitly).

    Raises :class:`~fp32scope.Fp32ScopeError` while any scope is active on any thread: the
    new default would replace a node's precision in the middle of its forward, and that
    scope's exit would then undo the default; so does None (or a precision with both fields
    None), which outside a scope changes nothing. Invalid input raises before anything
    changes. ``Fp32Precision("bfx9")`` sets cuBLAS matmuls to bfx9 and oneDNN matmuls to
    full float32 (torch >= 2.15).
    """
    fields = split(precision)
    # Refused before the no-op case returns: a call inside a scope is a mistake whatever it asks.
    owner = active_scope_thread()
    if owner == threading.get_ident():
        raise Fp32ScopeError(_INSIDE_A_SCOPE)
    if owner is not None:
        raise conflict_error("Cannot call set_process_default", owner)
    if fields is None:
        return
    torch_flags.apply(*fields)  # the token is dropped: this state is the new default


_INSIDE_A_SCOPE = (
    "Cannot call set_process_default inside an fp32_precision_scope (or a scoped node's call): "
    "the new default would replace the scope's precision for the rest of its block, and the "
    "scope's exit would then put back the state it saved, undoing the new default. Call "
    "set_process_default outside any scope: once at start-up, or between forwards."
)


def _effective_matmul(cuda: str, mkldnn: str) -> MatmulPrecision:
    # The least precise setting any backend uses, least precise first: bf16 (oneDNN only),
    # then tf32 (either), then bfx9 (cuBLAS only); "highest" only when none reduces. The
    # order matters where the legacy "medium" write left cuBLAS at tf32 and oneDNN at bf16.
    if mkldnn == "bf16":
        return "medium"
    if cuda == "tf32" or mkldnn == "tf32":
        return "high"
    if cuda == "bfx9":
        return "bfx9"
    return "highest"


def current_fp32_precision() -> Fp32Precision:
    """The process's float32 precision as an ``Fp32Precision``; never raises.

    In a consistent state (no legacy getter raises) it is what
    ``torch.get_float32_matmul_precision()`` and ``torch.backends.cudnn.allow_tf32`` say,
    except that ``matmul`` is ``"bfx9"`` where cuBLAS matmuls use it (torch >= 2.15; the
    legacy getter reads "highest" there).
    In a mixed state, where the legacy and new APIs disagree and no single value describes
    the process, each field reports the least precise setting any backend is using, from the
    new API's readings: ``matmul`` is ``"medium"`` if oneDNN matmuls use bf16, else
    ``"high"`` if cuBLAS or oneDNN matmuls use TF32, else ``"bfx9"`` if cuBLAS matmuls use
    bfx9, else ``"highest"``; ``cudnn_allow_tf32``
    is True if cuDNN convolutions or RNNs use TF32. ``python -m fp32scope doctor`` shows the
    readings behind it and how to make the state consistent.
    """
    readings = torch_flags.read_all()
    legacy_matmul = readings[torch_flags.LEGACY_MATMUL]
    cublas = readings[torch_flags.LEGACY_CUBLAS]
    matmul: MatmulPrecision
    if torch_flags.RAISES not in (legacy_matmul, cublas):
        matmul = legacy_matmul  # type: ignore[assignment]
        if (
            matmul == "highest"
            and torch_flags.HAS_NEW_API
            and readings[torch_flags.SLOT_NAMES["cuda", "matmul"]] == "bfx9"
        ):
            matmul = "bfx9"
    else:
        matmul = _effective_matmul(
            str(readings[torch_flags.SLOT_NAMES["cuda", "matmul"]]),
            str(readings[torch_flags.SLOT_NAMES["mkldnn", "matmul"]]),
        )
    cudnn = readings[torch_flags.LEGACY_CUDNN]
    if cudnn == torch_flags.RAISES:
        cudnn = "tf32" in (
            readings[torch_flags.SLOT_NAMES["cuda", "conv"]],
            readings[torch_flags.SLOT_NAMES["cuda", "rnn"]],
        )
    return Fp32Precision(matmul, bool(cudnn))
