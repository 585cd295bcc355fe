"""Reading the precision a node declares on its module."""

from __future__ import annotations

from fp32scope._flags.precision import Fp32Precision, check_cudnn, check_matmul
from fp32scope._wrappers.autocast import check_autocast

__all__ = ["node_fp32_precision"]

#: The attribute names a module uses to declare its precision.
MATMUL_ATTRIBUTE = "float32_matmul_precision"
CUDNN_ATTRIBUTE = "cudnn_allow_tf32"


def _unwrap(module: object) -> object:
    # Read the declaration on the real module, not through OptimizedModule's forwarding
    # (which a subclass or a later torch may change). Imported here: importing Dynamo is
    # slow, and a user who never compiles has no OptimizedModule to unwrap.
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(module, OptimizedModule):
        module = module._orig_mod
    return module


def node_fp32_precision(node_name: str, submodule: object) -> Fp32Precision | None:
    """The precision that ``submodule`` declares, checked, or None if it declares none.

    A module declares its precision with the class or instance attributes
    ``float32_matmul_precision`` (``"highest"``, ``"high"`` or ``"medium"``, or from torch
    2.15 ``"bfx9"``) and
    ``cudnn_allow_tf32`` (a bool); a missing attribute counts as None. A
    ``torch.compile``'d module is read through to the module it wraps. An engine calls this
    when it loads a node, so that a bad declaration fails at load time; the error names
    ``node_name``, the attribute, the value and what is allowed.

    >>> import torch
    >>> class Head(torch.nn.Linear):
    ...     float32_matmul_precision = "highest"
    >>> node_fp32_precision("head", Head(2, 2))
    Fp32Precision(matmul='highest', cudnn_allow_tf32=None)
    >>> node_fp32_precision("body", torch.nn.Linear(2, 2)) is None
    True
    """
    if not isinstance(node_name, str):
        msg = f"node_name must be a str; got {node_name!r} of type {type(node_name).__name__}."
        raise TypeError(msg)
    module = _unwrap(submodule)
    matmul = check_matmul(getattr(module, MATMUL_ATTRIBUTE, None), field=MATMUL_ATTRIBUTE, node=node_name)
    cudnn = check_cudnn(getattr(module, CUDNN_ATTRIBUTE, None), field=CUDNN_ATTRIBUTE, node=node_name)
    if matmul is None and cudnn is None:
        return None
    return Fp32Precision(matmul, cudnn)


#: The attribute name a module uses to declare what it does under ``torch.autocast``.
AUTOCAST_ATTRIBUTE = "autocast"


def declared_autocast(node_name: str, submodule: object) -> bool | None:
    """What ``submodule`` declares for ``torch.autocast`` (its ``autocast`` attribute), checked; None if nothing.

    ``autocast = False`` (a class or instance attribute, beside
    ``float32_matmul_precision``) makes the module's wrapper run it without the caller's
    autocast, ``True`` keeps the caller's autocast; see :class:`~fp32scope.Fp32ScopedModule`.
    A bad value raises :class:`TypeError` naming ``node_name`` and the attribute.
    """
    value = getattr(_unwrap(submodule), AUTOCAST_ATTRIBUTE, None)
    return check_autocast(value, field=AUTOCAST_ATTRIBUTE, node=node_name)
