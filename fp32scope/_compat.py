"""What the installed torch has: every release difference fp32scope depends on, decided once.

Each fact is named for what it means and found by presence (an attribute, an accepted
value), so that backports and nightlies count as what they are; the rest of the package
imports the fact (or the function chosen with it) and never asks again. Two facts are
about how Dynamo behaves, which no attribute shows and which only compiling would find
out (too slow for an import): those are read off the release number, here and nowhere
else, and each has a test that checks it against what Dynamo does.

Adding a release or raising the floor should touch this module and the release tables
(README.md, docs/guide/releases.rst), little else.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, cast

import torch

__all__ = [
    "BFX9_RELEASE",
    "COMPILER_STATE",
    "COMPILING_FLAG",
    "CURRENT_GRAPH_TASK_KEEPS_GRAPH",
    "DYNAMO_ENTERS_SCOPES_MADE_OUTSIDE",
    "DYNAMO_READS_OBJECT_DICTS",
    "DYNAMO_RESETS_MEDIUM",
    "DYNAMO_TRACES_SCOPES_MADE_INSIDE",
    "ENGINE_RUN_BACKWARD",
    "EXPORT_HOLDS_AUTOCAST_REGIONS",
    "HAS_BFX9",
    "HAS_COMPILING_FLAG",
    "HAS_IS_EXPORTING",
    "HAS_PER_BACKEND_API",
    "TORCH_RELEASE",
    "active_callback",
    "aoti_packaging_missing",
    "compiles_in_op",
    "cpu_capability",
    "dtensor_type",
    "dynamo_isinstance_as_python",
    "dynamo_refusal",
    "export_node_graph",
    "fsdp2_param_dtype",
    "graph_callable",
    "is_dynamo_compiling",
    "is_exporting",
    "recompile_limit",
    "tracing_backend",
    "tracing_one_graph",
    "treespec_children",
]

_C = torch._C

#: torch's release, e.g. "2.13.0" (without a local part such as "+cpu").
TORCH_RELEASE: Final[str] = str(torch.__version__).split("+", 1)[0]


def _release_at_least(major: int, minor: int) -> bool:
    # Only for the Dynamo facts below. torch.__version__ is a TorchVersion on every supported
    # torch; parsing the string keeps local builds such as "2.4.1+cu121" or "2.10.0a0" working.
    numbers = tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in TORCH_RELEASE.split(".")[:2])
    return numbers >= (major, minor)


# -- the per-backend fp32_precision API (torch >= 2.9) ----------------------------------


def _has_per_backend_api() -> bool:
    # torch 2.7 and 2.8 shipped an earlier form of the same getters whose slots read
    # "default" (no "none"/"ieee" vocabulary); fp32scope uses the legacy API there.
    if not (hasattr(_C, "_get_fp32_precision_getter") and hasattr(_C, "_set_fp32_precision_setter")):
        return False
    try:
        readings = [_C._get_fp32_precision_getter(b, o) for b, o in (("generic", "all"), ("cuda", "matmul"))]
    except RuntimeError:
        return False
    return all(r in {"none", "ieee", "tf32", "bf16", "bfx9"} for r in readings)


#: True when torch has the per-backend ``fp32_precision`` API in its torch >= 2.9 form;
#: without it (fallback) the legacy matmul enum and cuDNN bool are the whole state.
HAS_PER_BACKEND_API: Final[bool] = _has_per_backend_api()

#: The torch release that brought cuda matmul "bfx9", for the messages of older ones.
BFX9_RELEASE: Final = "2.15"


def _has_bfx9() -> bool:
    # Found by writing it: torch offers no list of the values a slot accepts. cuda/matmul is
    # put back to its raw value (what is stored, not what it resolves to), found as
    # _flags.raw_op finds it; a torch without bfx9 refuses the write before changing anything.
    if not HAS_PER_BACKEND_API:
        return False
    get, put = _C._get_fp32_precision_getter, _C._set_fp32_precision_setter
    reading = get("cuda", "matmul")
    if reading == "bfx9":
        return True
    raw = reading
    if reading != "none" and reading == get("cuda", "all"):
        # Reads as its parent: explicit, or inherited. Move cuda/all (put back to its own raw
        # value, found the same way one level up) and see whether cuda/matmul follows.
        generic = get("generic", "all")
        all_raw = reading
        if reading == ("none" if generic == "bf16" else generic):
            put("generic", "all", "tf32" if generic == "ieee" else "ieee")
            all_raw = "none" if get("cuda", "all") != reading else reading
            put("generic", "all", generic)
        put("cuda", "all", "tf32" if reading == "ieee" else "ieee")
        follows = get("cuda", "matmul") != reading
        put("cuda", "all", all_raw)
        raw = "none" if follows else reading
    try:
        put("cuda", "matmul", "bfx9")
    except RuntimeError:
        return False
    put("cuda", "matmul", raw)
    return True


#: True when torch accepts cuda matmul ``fp32_precision = "bfx9"`` (torch >= 2.15: cuBLAS
#: float32 emulated with nine bf16 products). Fallback: Fp32Precision("bfx9") is refused,
#: and no reading can be bfx9.
HAS_BFX9: Final[bool] = _has_bfx9()


# -- Dynamo ------------------------------------------------------------------------------

#: Whether every frame Dynamo converts turns a matmul precision of "medium" into "high".
#: Dynamo saves the cuBLAS matmul flag before it converts a frame and writes it back
#: afterwards: through the per-backend API wherever torch has it (which keeps "medium"),
#: else through the cuBLAS TF32 bool, whose setter writes "high" for True (torch 2.4 to 2.8).
DYNAMO_RESETS_MEDIUM: Final[bool] = not HAS_PER_BACKEND_API


def dynamo_shows_disable_reason() -> bool:
    """Whether Dynamo's error for a call of a ``torch.compiler.disable``'d function shows its reason.

    torch >= 2.8 reads the reason (``_torchdynamo_disable_msg``) into a ``fullgraph=True``
    failure; torch 2.4 names only the function. Read from Dynamo's source, which Dynamo
    need not be imported for; called once, when the first wrapper is marked.
    """
    spec = importlib.util.find_spec("torch._dynamo.symbolic_convert")
    if spec is None or spec.origin is None:  # pragma: no cover  (a torch built without Dynamo)
        return False
    return "_torchdynamo_disable_msg" in Path(spec.origin).read_text(encoding="utf-8")


#: Whether Dynamo can enter a context manager that user code made inside the traced region
#: (torch >= 2.8; torch 2.4 fails with "BEFORE_WITH UserDefinedObjectVariable(...)" before
#: any of the manager's code runs, so a scope there must refuse where it is made).
DYNAMO_TRACES_SCOPES_MADE_INSIDE: Final[bool] = _release_at_least(2, 8)

#: Whether Dynamo enters a context manager made outside the traced region (torch >= 2.14;
#: older releases refuse it before any of its code runs).
DYNAMO_ENTERS_SCOPES_MADE_OUTSIDE: Final[bool] = _release_at_least(2, 14)


#: Whether Dynamo traces the items of a user-defined object's ``__dict__``, which a region
#: reads to carry a plain object argument (a config, a dataclass): torch >= 2.13. Checked on
#: 2.13 and 2.15; 2.4 and 2.8 cannot trace ``obj.__dict__.items()`` (nor ``vars(obj)``); 2.9
#: to 2.12 are not checked, and refuse such an argument, saying so.
DYNAMO_READS_OBJECT_DICTS: Final[bool] = _release_at_least(2, 13)


#: Whether a region op may declare that it updates a list of its tensor arguments in place
#: (``Tensor(a!)[]``) under Inductor, so that a static cache's keys and values are written
#: where they are, not copied into the op and back. Checked on 2.8, 2.10, 2.13 and 2.15
#: (logits, tokens and caches against the eager scoped model, and no copy of a cache layer,
#: tests/compile/test_region_caches.py); 2.5 to 2.7 are not checked and copy, as 2.4 does
#: (whose transformers cannot run the Hugging Face check).
REGION_OPS_UPDATE_CACHES_IN_PLACE: Final[bool] = _release_at_least(2, 8)


def tracing_one_graph() -> bool:
    """Whether Dynamo is tracing a frame that must compile as one graph (``fullgraph=True``).

    Read from the running translator (``one_graph``; ``error_on_graph_break`` where torch has
    it); False outside a trace, and on a torch that names neither.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        translator = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001  (no translator: no trace, or another torch's internals)
        return False
    return bool(getattr(translator, "one_graph", False) or getattr(translator, "error_on_graph_break", False))


#: The backends that do not compile a region's node in its op: Inductor compiles it inside
#: (``_wrappers.inner``) or runs it eagerly there; a CUDA graph cannot be replayed inside an op.
_NOT_IN_OP: Final = frozenset({"inductor", "cudagraphs"})


def tracing_backend() -> Callable[..., Any] | None:
    """The backend of the graph Dynamo is tracing now; None outside a trace."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
    except Exception:  # noqa: BLE001  (no translator: no trace, or another torch's internals)
        return None
    return cast("Callable[..., Any] | None", backend)


def compiles_in_op(backend: Callable[..., Any]) -> bool:
    """Whether a region's op should compile its node with ``backend``, its parent's.

    Not Inductor and cudagraphs (``_NOT_IN_OP``); not before torch 2.9, whose Dynamo resets
    a "medium" precision while it compiles (``DYNAMO_RESETS_MEDIUM``: the node would run at
    "high"); and not where Dynamo does not take a module's parameters as inputs
    (``inline_inbuilt_nn_modules`` off, torch 2.4's default): there it guards each by
    identity, and the op binds new ones at every training call, which would compile the
    node again at every call.
    """
    if getattr(backend, "__name__", None) in _NOT_IN_OP or DYNAMO_RESETS_MEDIUM:
        return False
    with warnings.catch_warnings():  # (torch >= 2.13: deprecated, always on)
        warnings.simplefilter("ignore", FutureWarning)
        return bool(getattr(torch._dynamo.config, "inline_inbuilt_nn_modules", False))


_dynamo_refusals: dict[type, type] = {}


def dynamo_refusal(base: type[Exception], msg: str) -> Exception:
    """An instance of ``base`` that is also Dynamo's ``Unsupported``, so that Dynamo raises it as it is.

    Raised while Dynamo traces a ``fullgraph=True`` frame, any other exception reaches the
    user wrapped in ``InternalTorchDynamoError``; an ``Unsupported`` is re-raised unchanged
    on every supported release (whose constructors all take the message first).
    """
    from torch._dynamo.exc import Unsupported

    cls = _dynamo_refusals.get(base)
    if cls is None:

        def init(self: Exception, message: str) -> None:
            Unsupported.__init__(self, message)  # type: ignore[arg-type]  # (sets Dynamo's own fields)

        cls = type(base.__name__, (base, Unsupported), {"__init__": init, "__module__": base.__module__})
        _dynamo_refusals[base] = cls
    return cast("Exception", cls(msg))


def recompile_limit() -> int:
    """Dynamo's limit on the graphs it keeps per code object (``cache_size_limit`` before torch 2.6).

    Read at each use: a user may change it at any time.
    """
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None)
    return int(config.cache_size_limit if limit is None else limit)


COMPILING_FLAG: Final = "_is_compiling_flag"
#: Whether ``torch.compiler.is_compiling()`` returns torch.compiler's module flag
#: ``_is_compiling_flag`` outside Dynamo and TorchScript (every supported release): torch.export
#: sets it while it traces, and from torch 2.13 a torch.compile session while it compiles.
HAS_COMPILING_FLAG: Final[bool] = COMPILING_FLAG in vars(torch.compiler)
#: ``is_dynamo_compiling() or COMPILER_STATE[COMPILING_FLAG]`` is ``torch.compiler.is_compiling()``
#: without its ``torch.jit.is_scripting()`` call (about 50 ns of each scoped call): Dynamo's own
#: "am I tracing?" (False when called, folded to True where Dynamo traces it), then the flag, read
#: from torch.compiler's module dict. On a torch without the flag, is_compiling() itself and a
#: flag that stays False.
is_dynamo_compiling: Callable[[], bool] = (
    torch.compiler.is_dynamo_compiling if HAS_COMPILING_FLAG else torch.compiler.is_compiling
)
COMPILER_STATE: Final[dict[str, Any]] = vars(torch.compiler) if HAS_COMPILING_FLAG else {COMPILING_FLAG: False}


def _is_exporting_without_api() -> bool:
    """Whether torch.export is tracing, on a torch without ``torch.compiler.is_exporting``."""
    # torch 2.4: only torch.export sets this flag (is_compiling() reads it outside Dynamo,
    # which folds is_compiling() itself).
    return bool(COMPILER_STATE.get(COMPILING_FLAG, False))


#: Whether torch has ``torch.compiler.is_exporting`` (not torch 2.4).
HAS_IS_EXPORTING: Final[bool] = hasattr(torch.compiler, "is_exporting")
#: Whether torch.export is tracing now: torch's own function, or the fallback above.
is_exporting: Callable[[], bool] = torch.compiler.is_exporting if HAS_IS_EXPORTING else _is_exporting_without_api

_eval_frame: Any = _C._dynamo.eval_frame

active_callback: Callable[[], object]
if hasattr(_eval_frame, "get_eval_frame_callback"):
    active_callback = _eval_frame.get_eval_frame_callback
else:  # torch 2.4: only the setter, which returns the callback it replaces
    _set_eval_frame = _eval_frame.set_eval_frame

    def active_callback() -> object:
        """Dynamo's frame callback on this thread (None or False when none compiles)."""
        prior = _set_eval_frame(None)
        if prior is not None:
            _set_eval_frame(prior)
        return prior


# -- autograd ----------------------------------------------------------------------------

#: The engine call behind torch.autograd.grad and backward (torch >= 2.4), without their
#: argument checks; every backward blocks in its frame while the engine runs. None on a
#: torch that renames it (fallback: torch.autograd.grad, and no backward thread is trusted).
ENGINE_RUN_BACKWARD: Final[Callable[..., Any] | None] = getattr(torch.autograd.graph, "_engine_run_backward", None)

#: Whether the running backward retains its graph (torch >= 2.5). None before: a scoped
#: call then adds an identity node (the gate) whose backward tells.
CURRENT_GRAPH_TASK_KEEPS_GRAPH: Final[Callable[[], bool] | None] = getattr(
    _C._autograd, "_get_current_graph_task_keep_graph", None
)


# -- export ------------------------------------------------------------------------------


def _export_holds_autocast_regions() -> bool:
    try:
        from torch._higher_order_ops import wrap
    except ImportError:  # pragma: no cover
        return False
    return hasattr(wrap, "wrap_with_autocast")


#: Whether torch.export records an autocast region (``torch.autocast(..., enabled=False)``
#: inside the exported code) as a ``wrap_with_autocast`` higher-order op (torch >= 2.5);
#: torch 2.4's export fails on such a region ("Node arity mismatch").
EXPORT_HOLDS_AUTOCAST_REGIONS: Final[bool] = _export_holds_autocast_regions()


# -- FSDP2 -------------------------------------------------------------------------------


def fsdp2_param_dtype(module: object) -> torch.dtype | None:
    """The ``param_dtype`` of the FSDP2 mixed precision policy of ``module``'s own unit, or None.

    None where ``module`` is no FSDP2 unit (``fully_shard`` not applied to it) or its policy
    keeps the parameters' dtype. FSDP2 has no public reader of a unit's policy: every release
    with FSDP2 (2.4+, ``torch.distributed._composable.fsdp`` before 2.6) keeps it on the
    unit's state as ``_mp_policy``; read by presence, so a release that moves it reads None.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if not callable(get_state):
        return None
    try:
        state = get_state()
    except (AssertionError, RuntimeError, AttributeError):  # a module FSDP2 has not set up
        return None
    dtype = getattr(getattr(state, "_mp_policy", None), "param_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def dtensor_type() -> type | None:
    """The ``DTensor`` class, or None in a torch built without distributed.

    Public as ``torch.distributed.tensor`` from 2.5, ``torch.distributed._tensor`` in 2.4.
    Imported when asked (importing it loads torch.distributed's tensor package).
    """
    for home in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            found = getattr(importlib.import_module(home), "DTensor", None)
        except ImportError:
            continue
        if isinstance(found, type):
            return found
    return None


# -- other -------------------------------------------------------------------------------


def cpu_capability() -> str | None:
    """Torch's CPU capability (e.g. "AVX512"), or None on a torch without the getter."""
    getter = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return str(getter()) if callable(getter) else None


def aoti_packaging_missing(inductor: Any) -> str | None:
    """Why this torch cannot compile an AOTInductor package with metadata, or None when it can.

    ``inductor`` is the imported ``torch._inductor`` (the caller imports it: about a second).
    """
    if not hasattr(inductor, "aoti_compile_and_package") or not hasattr(inductor, "aoti_load_package"):
        return (
            f"torch {TORCH_RELEASE} has no torch._inductor.aoti_compile_and_package / aoti_load_package "
            "(AOTInductor packages need torch >= 2.6)"
        )
    import inspect

    parameters = list(inspect.signature(inductor.aoti_compile_and_package).parameters.values())[1:]
    if any(p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters):
        return (
            f"torch {TORCH_RELEASE}'s torch._inductor.aoti_compile_and_package takes the example inputs "
            "as arguments (torch 2.5); fp32scope uses the form that reads them from the exported program "
            "(torch >= 2.6)"
        )
    if not hasattr(inductor.config.aot_inductor, "metadata"):
        return f"torch {TORCH_RELEASE}'s AOTInductor has no aot_inductor.metadata to record the precision in"
    return None


def export_node_graph(fn: Callable[..., Any], args: tuple[Any, ...], decompositions: Any, *, joint: bool) -> Any:
    """AOTAutograd's graph of ``fn`` (joint where ``joint``, else inference) and its metadata.

    The private ``_aot_export_function`` takes ``trace_joint`` on some releases (2.10, 2.13,
    2.15) and not on others (2.4, 2.8), which decide "joint" from grad mode and the inputs
    alone: the caller sets both to agree with ``joint``. Which form is read from its
    signature, once.
    """
    from torch._functorch.aot_autograd import _aot_export_function

    if _takes_trace_joint(_aot_export_function):
        graph, meta, *_ = _aot_export_function(fn, args, decompositions=decompositions, trace_joint=joint)
    else:
        graph, meta, *_ = _aot_export_function(fn, args, decompositions=decompositions)
    return graph, meta


@functools.cache
def _takes_trace_joint(export: Callable[..., Any]) -> bool:
    import inspect

    return "trace_joint" in inspect.signature(export).parameters


def graph_callable(compiled: Any) -> Callable[[list[Any]], Any]:
    """The generated code of an Inductor graph (``compile_fx_inner``'s result) once it has run.

    Every release from 2.4 keeps it as the graph's ``current_callable``, which its
    ``__call__`` calls after bookkeeping of its own (metrics, profiler labels, autotune
    caches written at the first call); an object without one is called as it is.
    """
    fn = getattr(compiled, "current_callable", None)
    return fn if callable(fn) else compiled  # type: ignore[no-any-return]


def treespec_children(spec: Any) -> list[Any]:
    """The child specs of a pytree spec node: its ``children()`` where it has one (2.13, 2.15), else its field."""
    children = getattr(spec, "children", None)
    if callable(children):
        return list(children())
    return list(spec.children_specs)


_ISINSTANCE_AS_PYTHON: list[type] = []


def dynamo_isinstance_as_python(cls: type) -> bool:
    """Have Dynamo answer ``isinstance(obj, C)`` for an instance of ``cls`` as Python does.

    ``cls`` is a proxy: its instances report the wrapped object's class as ``__class__``,
    which Python's ``isinstance`` reads. torch 2.15's Dynamo answers an ``isinstance`` of a
    plain class (an ``nn.Module``) from ``type(obj)`` alone, where no proxy can answer: a
    compiled ``isinstance(scoped, nn.Module)`` would be False where eager says True, and a
    ``ModuleList`` holding one could not be sliced. Where that rule is present (found by its
    ``_VALUE_INDEPENDENT_TYPES``), Dynamo's ``isinstance`` handler is wrapped, once, so that
    for instances of the registered classes only it calls Python's ``isinstance`` on the
    object, as it already does for classes with an ``__instancecheck__``. Returns whether
    that rule is present. Imports Dynamo; called when a proxy is made.
    """
    if cls in _ISINSTANCE_AS_PYTHON:
        return bool(_ISINSTANCE_AS_PYTHON)
    from torch._dynamo.variables import builtin

    if not hasattr(builtin, "_VALUE_INDEPENDENT_TYPES"):
        return False
    if not _ISINSTANCE_AS_PYTHON:
        _wrap_dynamo_isinstance(builtin)
    _ISINSTANCE_AS_PYTHON.append(cls)
    return True


def _wrap_dynamo_isinstance(builtin: Any) -> None:
    from torch._dynamo.variables.base import VariableTracker

    original = builtin.BuiltinVariable.call_isinstance
    proxies = _ISINSTANCE_AS_PYTHON

    def call_isinstance(self: Any, tx: Any, arg: Any, isinstance_type_var: Any) -> Any:
        value = getattr(arg, "value", None)
        if issubclass(type(value), tuple(proxies)) and isinstance_type_var.is_python_constant():
            try:
                answer = isinstance(value, isinstance_type_var.as_python_constant())
            except TypeError:  # not a class: Dynamo's own handler raises it as Python would
                return original(self, tx, arg, isinstance_type_var)
            return VariableTracker.build(tx, answer)
        return original(self, tx, arg, isinstance_type_var)

    call_isinstance.__wrapped__ = original  # type: ignore[attr-defined]
    builtin.BuiltinVariable.call_isinstance = call_isinstance
