"""Exceptions and warnings raised by fp32scope."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = [
    "Fp32AutocastWarning",
    "Fp32BackwardNotScopedWarning",
    "Fp32EagerFallbackWarning",
    "Fp32FlagsChangedWarning",
    "Fp32ParameterDtypeWarning",
    "Fp32RegionBreakWarning",
    "Fp32ScopeError",
    "user_stacklevel",
]

_PACKAGE = str(Path(__file__).parent) + os.sep  # as the frames of its modules name their files


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside fp32scope: the user's call.

    Called by the function that warns. A wrapper's call takes one frame or two (an in-graph
    region's proxy adds its own), so a fixed level would point into fp32scope.
    """
    frame = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level


class Fp32ScopeError(RuntimeError):
    """A float32-precision scope cannot be entered or a default cannot be set now.

    Raised when a scope would change the process-wide flags inside a region that
    ``torch.compile`` is tracing, while another thread is inside a scope, or when
    :func:`~fp32scope.set_process_default` is called while any scope is active.
    """


class Fp32FlagsChangedWarning(RuntimeWarning):
    """The code inside a scope changed the float32-precision flags the scope applied.

    The scope restores the state it saved on entry regardless; this warning names the
    flags that the block changed so that the code responsible can be found.
    """


class Fp32BackwardNotScopedWarning(UserWarning):
    """A scoped node's backward cannot be bracketed to the node's own autograd nodes.

    Warned once per wrapper object (two wrappers of one name each warn), in two cases;
    every gradient stays exact in both:

    * the wrapped call reaches a tensor with autograd history that is not one of its
      arguments (a closure over an activation, FSDP1's flat-parameter views): the backward
      of that tensor's history runs inside the node's backward too, in the node's
      precision (and, where the tensor is also used outside the node, once more for that
      use). Pass the tensor as an argument, or wrap the unit that makes it;
    * the call runs inside a ``torch.func`` transform, which differentiates it as it is:
      its backward runs under the precision current when autograd reaches it.

    ``backward=False`` keeps the node forward-only and silences it.
    """


class Fp32EagerFallbackWarning(UserWarning):
    """A scope inside code that ``torch.compile`` compiles made Dynamo run that code eagerly.

    Dynamo cannot compile a change of the float32 precision flags, so where a scope is
    entered inside a compiled function (without ``fullgraph=True``, which makes it an
    error) that function runs eagerly, not compiled. Warned once per code location, at
    the scope's line, when Dynamo traces it. Wrap the compiled callable instead
    (``with_fp32_precision(precision)(torch.compile(fn))``,
    ``Fp32ScopedModule(torch.compile(module), precision)``), or make the part a scoped
    child of the compiled model.
    """


class Fp32AutocastWarning(UserWarning):
    """A scoped node that asks for full float32 runs under ``torch.autocast``.

    Autocast casts matmuls and convolutions to its dtype (bf16, fp16) whatever the float32
    precision flags say, so a node scoped to ``"highest"`` or ``cudnn_allow_tf32=False``
    would compute them in that dtype. Warned once per wrapper, at its first call under
    autocast, when the wrapper's ``autocast`` is None (the default). Wrap the node with
    ``autocast=False`` to run it in float32 (autocast off inside it, its floating-point
    arguments cast to float32), or with ``autocast=True`` to keep the caller's autocast
    silently.
    """


class Fp32ParameterDtypeWarning(UserWarning):
    """A scoped node that asks for full float32 runs with bf16 or fp16 parameters.

    The float32 precision flags act on float32 tensors only: a node whose parameters are
    bfloat16 or float16 when it runs (FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` of
    the unit that holds them, or parameters cast by hand) computes its matmuls in that
    dtype whatever its precision says; with ``autocast=False`` under autocast its float32
    arguments then meet those parameters (a dtype mismatch error). Warned once per
    :class:`~fp32scope.Fp32ScopedModule`, at its first call, when its precision asks for
    full float32 (matmul ``"highest"`` or ``cudnn_allow_tf32=False``). Give the node
    float32 parameters: under FSDP2 a unit of its own with a float32 policy,
    ``fully_shard(node, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))``,
    before its parent's ``fully_shard``.
    """


class Fp32RegionBreakWarning(UserWarning):
    """An in-graph region was called with an argument it cannot carry: a graph break instead.

    A region (``in_graph=True``, or an ``eager=True`` node) takes tensors, ints and
    constants, also in tuples, lists and dicts; an object (a Hugging Face cache, a
    dataclass) cannot cross the opaque op. Such a call of the node is a graph break
    instead, as with ``in_graph=False``: the node runs in its scope, compiled as a graph
    of its own (eagerly for an ``eager=True`` node), and ``fullgraph=True`` fails there
    with a message naming this. Warned once per wrapper, when the call first runs. Pass
    the object's tensors as arguments, or scope a module inside the node that takes only
    tensors.
    """


# Tracebacks, reprs and pytest's reports name the public home (``fp32scope.Fp32ScopeError``),
# where users import these from, rather than this private module. Pickling still works: the
# package resolves the name lazily.
for _name in __all__:
    globals()[_name].__module__ = "fp32scope"
del _name
