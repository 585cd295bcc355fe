"""``python -m fp32scope doctor``: checks that the process's float32 precision state is consistent.

torch keeps each flag twice, in the legacy API and in the per-backend ``fp32_precision``
API (torch >= 2.9). Writes through one API do not always update the other, and the two can
then disagree: a legacy getter raises, or (worse) answers a stale value without raising.
The doctor reads every flag, names each disagreement, and says how to make the state
consistent again. It also says whether compiling with Dynamo turns a "medium" precision
into "high" on this torch (2.4 to 2.8 do). It writes no flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Mapping

import torch

from fp32scope._compat import cpu_capability
from fp32scope._flags import torch_flags
from fp32scope._flags.dynamo_exclude import dynamo_resets_medium
from fp32scope._flags.precision import Fp32Precision
from fp32scope._flags.process import current_fp32_precision
from fp32scope._tools.targets import TargetError, call_factory, resolve
from fp32scope._wrappers.autocast import CUBLAS_OVERRIDE, NVIDIA_OVERRIDE
from fp32scope._wrappers.node import node_fp32_precision
from fp32scope._wrappers.proxy import Fp32ScopedModule, precision_of

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "CudaDevice",
    "Diagnosis",
    "ModelLoadError",
    "ModelNode",
    "ModelReport",
    "Problem",
    "add_arguments",
    "check_model",
    "diagnose",
    "environment_overrides",
    "load_model",
    "render",
    "render_model",
    "run",
]

Reading = str | bool

# What the legacy matmul enum makes each new-API matmul slot read when both agree.
# "none" resolves to "none" all the way up, which torch treats as full fp32, like "ieee".
_AGREES_CUDA: dict[str, tuple[str, ...]] = {
    "highest": ("ieee", "none", "bfx9"),  # bfx9 (torch >= 2.15) reads "highest" by design
    "high": ("tf32",),
    "medium": ("tf32",),
}
_AGREES_MKLDNN: dict[str, tuple[str, ...]] = {
    "highest": ("ieee", "none"),
    "high": ("tf32",),
    "medium": ("bf16",),
}

_NO_MIXING = (
    "Do not mix torch.backends.*.fp32_precision writes with the legacy API "
    "(torch.set_float32_matmul_precision, torch.backends.*.allow_tf32) in one process."
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One disagreement: the field it concerns (``"matmul"`` or ``"cudnn"``) and what is wrong."""

    field: str
    flags: tuple[str, ...]
    message: str


@dataclasses.dataclass(frozen=True)
class CudaDevice:
    """One CUDA device and whether it has TF32 tensor cores."""

    index: int
    name: str
    capability: str
    tf32: bool | None


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """Everything the doctor found; ``consistent`` decides the exit status."""

    torch_version: str
    has_new_api: bool
    readings: dict[str, Reading]
    effective: dict[str, object]
    cuda_available: bool
    cuda_devices: tuple[CudaDevice, ...]
    cpu_capability: str | None
    problems: tuple[Problem, ...]
    fix: str | None
    #: Whether a Dynamo compile turns "medium" into "high" here (None: the probe could not compile).
    dynamo_resets_medium: bool | None = None
    #: The environment variables set here that override the TF32 flags, each with what it does.
    overrides: tuple[str, ...] = ()

    @property
    def consistent(self) -> bool:
        """True when no legacy getter raises and every legacy reading agrees with the new API."""
        return not self.problems

    def as_json(self) -> dict[str, object]:
        """The diagnosis as JSON-ready data (the ``--json`` output)."""
        data = dataclasses.asdict(self)
        data["consistent"] = self.consistent
        return data


def _raise_problems(readings: dict[str, Reading]) -> list[Problem]:
    slot = torch_flags.SLOT_NAMES
    matmul_readers = "Inductor's autotuning, libraries"
    checks = (
        (torch_flags.LEGACY_MATMUL, "matmul", (slot["cuda", "matmul"], slot["mkldnn", "matmul"]), matmul_readers),
        (torch_flags.LEGACY_CUBLAS, "matmul", (slot["cuda", "matmul"],), matmul_readers),
        (
            torch_flags.LEGACY_CUDNN,
            "cudnn",
            (slot["cuda", "conv"], slot["cuda", "rnn"]),
            "torch.backends.cudnn.flags()",
        ),
    )
    problems = []
    for legacy, field, new, readers in checks:
        if readings[legacy] == torch_flags.RAISES:
            shown = ", ".join(f"{name} = {readings[name]!r}" for name in new)
            message = (
                f"{legacy} raises RuntimeError: torch found that the legacy value it keeps disagrees "
                f"with the new API ({shown}), so no legacy read of this flag works; code that reads it "
                f"({readers}) fails."
            )
            problems.append(Problem(field, (legacy, *new), message))
    return problems


def _stale(legacy: str, legacy_value: Reading, new: str, new_value: Reading, meaning: str) -> str:
    return (
        f"{legacy} reads {legacy_value!r} but {new} reads {new_value!r}: the legacy reading is stale "
        f"(no error is raised), and {meaning}."
    )


def _stale_problems(readings: dict[str, Reading]) -> list[Problem]:
    slot = torch_flags.SLOT_NAMES
    problems = []
    e = readings[torch_flags.LEGACY_MATMUL]
    if isinstance(e, str) and e in _AGREES_CUDA:
        for backend, agrees, kernels in (
            ("cuda", _AGREES_CUDA, "cuBLAS"),
            ("mkldnn", _AGREES_MKLDNN, "oneDNN (CPU)"),
        ):
            name = slot[backend, "matmul"]
            value = readings[name]
            if value not in agrees[e]:
                meaning = f"{kernels} float32 matmuls follow {name}"
                problems.append(
                    Problem(
                        "matmul",
                        (torch_flags.LEGACY_MATMUL, name),
                        _stale(torch_flags.LEGACY_MATMUL, e, name, value, meaning),
                    )
                )
    cublas = readings[torch_flags.LEGACY_CUBLAS]
    name = slot["cuda", "matmul"]
    if isinstance(cublas, bool) and cublas is not (readings[name] == "tf32"):
        meaning = f"cuBLAS float32 matmuls follow {name}"
        problems.append(
            Problem(
                "matmul",
                (torch_flags.LEGACY_CUBLAS, name),
                _stale(torch_flags.LEGACY_CUBLAS, cublas, name, readings[name], meaning),
            )
        )
    cudnn = readings[torch_flags.LEGACY_CUDNN]
    if isinstance(cudnn, bool):
        for op in ("conv", "rnn"):
            name = slot["cuda", op]
            if cudnn is not (readings[name] == "tf32"):
                meaning = f"cuDNN {op} kernels follow {name}"
                problems.append(
                    Problem(
                        "cudnn",
                        (torch_flags.LEGACY_CUDNN, name),
                        _stale(torch_flags.LEGACY_CUDNN, cudnn, name, readings[name], meaning),
                    )
                )
    return problems


def _fix(problems: list[Problem], matmul: str, cudnn: bool) -> str | None:
    fields = {p.field for p in problems}
    if not fields:
        return None
    m = repr(matmul) if "matmul" in fields else "None"
    c = repr(cudnn) if "cudnn" in fields else "None"
    torch_calls = []
    if "matmul" in fields and matmul == "bfx9":  # no legacy word: the legacy "highest", then cuBLAS bfx9
        torch_calls.append(
            "torch.set_float32_matmul_precision('highest') and torch.backends.cuda.matmul.fp32_precision = 'bfx9'"
        )
    elif "matmul" in fields:
        torch_calls.append(f"torch.set_float32_matmul_precision({matmul!r})")
    if "cudnn" in fields:
        torch_calls.append(f"torch.backends.cudnn.allow_tf32 = {cudnn!r}")
    return (
        f"Call fp32scope.set_process_default(Fp32Precision({m}, {c})) once at start-up, or "
        f"{' and '.join(torch_calls)}: each writes the legacy and the new API consistently. "
        f"The values shown keep the least precise setting the process uses now "
        f"(fp32scope.current_fp32_precision()); use Fp32Precision('highest', False) for full float32 "
        f"everywhere. {_NO_MIXING}"
    )


def _cuda_devices() -> tuple[CudaDevice, ...]:
    if not torch.cuda.is_available():
        return ()
    devices = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        # TF32 tensor cores arrived with Ampere (compute capability 8.0); ROCm's numbering differs.
        tf32 = None if torch.version.hip else major >= 8
        devices.append(CudaDevice(index, torch.cuda.get_device_name(index), f"{major}.{minor}", tf32))
    return tuple(devices)


def diagnose() -> Diagnosis:
    """Read every float32 precision flag (changing none) and check that the two APIs agree."""
    readings = torch_flags.read_all()
    problems: list[Problem] = []
    if torch_flags.HAS_NEW_API:
        problems = _raise_problems(readings) + _stale_problems(readings)
    effective = current_fp32_precision()
    return Diagnosis(
        torch_version=str(torch.__version__),
        has_new_api=torch_flags.HAS_NEW_API,
        readings=readings,
        effective=effective._asdict(),
        cuda_available=torch.cuda.is_available(),
        cuda_devices=_cuda_devices(),
        cpu_capability=cpu_capability(),
        problems=tuple(problems),
        fix=_fix(problems, str(effective.matmul), bool(effective.cudnn_allow_tf32)),
        dynamo_resets_medium=dynamo_resets_medium(),
        overrides=environment_overrides(os.environ),
    )


_DYNAMO_LINES: dict[bool | None, str] = {
    True: (
        "torch.compile: RESETS 'medium' to 'high': on this torch every frame Dynamo compiles leaves the matmul "
        "precision at 'high' where it was 'medium' (Dynamo writes the cuBLAS TF32 flag back through a setter "
        "that writes 'high'; torch 2.4 to 2.8). A scope that applies 'medium', or applies only the cuDNN "
        "field, puts 'medium' back after the call it wraps (the compiling call itself runs under 'high'); all "
        "other code runs 'high' after the first compile. "
        "With a 'medium' default, wrap every compiled node, also those that declare nothing, with the default "
        "(Fp32ScopedModule(torch.compile(m), Fp32Precision('medium'))), or call "
        "fp32scope.set_process_default again after warm-up, and again after any recompile."
    ),
    False: "torch.compile: keeps a 'medium' matmul precision while it compiles.",
    None: "torch.compile: not checked (Dynamo could not compile a probe function in this process).",
}


def render(diagnosis: Diagnosis) -> str:
    """The diagnosis as the text the ``doctor`` command prints."""
    d = diagnosis
    api = (
        "legacy + per-backend fp32_precision (torch >= 2.9)"
        if d.has_new_api
        else "legacy only (no fp32_precision API before torch 2.9)"
    )
    lines = [f"torch {d.torch_version}; precision APIs: {api}"]
    if d.cuda_available:
        for dev in d.cuda_devices:
            tf32 = {
                True: "TF32 supported",
                False: "no TF32 (needs compute capability >= 8.0)",
                None: "TF32: ROCm",
            }
            lines.append(f"CUDA device {dev.index}: {dev.name}, compute capability {dev.capability}, {tf32[dev.tf32]}")
    else:
        lines.append("CUDA: not available (the cuBLAS and cuDNN TF32 flags have no effect here)")
    if d.cpu_capability is not None:
        lines.append(f"CPU capability: {d.cpu_capability} (oneDNN float32 matmuls follow mkldnn.matmul)")
    lines.append("")
    lines.append("readings:")
    width = max(map(len, d.readings))
    lines.extend(
        f"  {name:<{width}}  {value if value == torch_flags.RAISES else repr(value)}"
        for name, value in d.readings.items()
    )
    lines.append(f"effective (fp32scope.current_fp32_precision()): {d.effective}")
    lines.append(_DYNAMO_LINES[d.dynamo_resets_medium])
    lines.append("")
    if d.overrides:
        lines.append(f"TF32 OVERRIDDEN by the environment: {len(d.overrides)} variable(s):")
        lines.extend(f"  - {message}" for message in d.overrides)
        lines.append("")
    if d.consistent:
        lines.append("consistent: the legacy and new readings agree and no getter raises.")
    else:
        lines.append(f"MIXED: {len(d.problems)} problem(s):")
        lines.extend(f"  {i}. {p.message}" for i, p in enumerate(d.problems, 1))
        lines.append(f"fix: {d.fix}")
    return "\n".join(lines)


def environment_overrides(environ: Mapping[str, str]) -> tuple[str, ...]:
    """What each TF32 override set in ``environ`` does to scoped nodes (empty when none is set).

    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (torch reads "1" as on) and
    ``NVIDIA_TF32_OVERRIDE=0`` (NVIDIA's libraries read only "0") override the flags that
    scopes set; other values change nothing and are not reported.
    """
    found = []
    if environ.get(CUBLAS_OVERRIDE) == "1":
        found.append(
            f"{CUBLAS_OVERRIDE}=1: torch lets cuBLAS use TF32 for every float32 matmul on CUDA, whatever the "
            "matmul precision says: a scoped node that asks for 'highest' runs its CUDA matmuls in TF32 (cuDNN "
            "is not affected). It also makes torch.get_float32_matmul_precision() read 'high' in a process that "
            "has set no precision yet. Unset it wherever a node needs full float32."
        )
    if environ.get(NVIDIA_OVERRIDE) == "0":
        found.append(
            f"{NVIDIA_OVERRIDE}=0: cuBLAS and cuDNN never use TF32, whatever torch asks: every node, scoped "
            "'high' or 'medium' and the process default included, runs its CUDA float32 matmuls and convolutions "
            "in full float32 (exact, but slower on GPUs with TF32). Unset it to let the precisions apply."
        )
    return tuple(found)


#: The ``doctor --help`` text: plain text for a terminal.
DESCRIPTION = """\
Check that torch's float32 precision flags are consistent in this process.

torch keeps each flag twice: in the legacy API
(torch.set_float32_matmul_precision, torch.backends.cuda.matmul.allow_tf32,
torch.backends.cudnn.allow_tf32) and, from torch 2.9, in the per-backend
fp32_precision attributes. A write through one API does not always update the
other; then a legacy getter raises, or returns a stale value without raising.
The doctor reads every flag, names each disagreement and prints the call that
makes the state consistent again.

It also says whether torch.compile turns a "medium" matmul precision into
"high" on this torch (2.4 to 2.8 do). It changes no flag."""

#: The ``doctor --help`` closing lines.
EPILOG = """\
exit status: 0 when the state is consistent (and, with --model, every module
that declares a precision runs in it); 1 when it is mixed (the two APIs
disagree), an environment variable overrides the TF32 flags
(TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, NVIDIA_TF32_OVERRIDE=0), or a module runs
outside its declared precision; 2 for a bad option, a --import module that does
not import, or a --model that cannot be loaded."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``doctor`` command's options to ``parser``."""
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument(
        "--import",
        dest="modules",
        metavar="MODULE",
        action="append",
        default=[],
        help=(
            "import MODULE first (repeatable), so that the flags it sets at import time, e.g. an "
            "engine's configuration module, are what the doctor checks"
        ),
    )
    parser.add_argument(
        "--model",
        metavar="MODULE:ATTR",
        help=(
            "also check a model: import MODULE and take its attribute ATTR, a torch.nn.Module "
            "or a function or class that returns one when called without arguments; list the "
            "scoped nodes (Fp32ScopedModule) with their precision, and every submodule that "
            "declares a precision (float32_matmul_precision, cudnn_allow_tf32) but does not "
            "run in it"
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Print the diagnosis; 0 when the state is consistent, 1 when it is mixed, 2 when a module does not import."""
    for module in args.modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001, PERF203  (any failure of the user's module: report it, exit 2)
            # One line, distinct from the findings' exit status 1: a CI job can tell a typo in
            # the command from a mixed state.
            reason = " ".join(f"{type(error).__name__}: {error}".split())
            print(f"fp32scope doctor: --import {module}: the module does not import ({reason})", file=sys.stderr)
            return 2
    report = None
    if args.model is not None:
        try:
            report = check_model(load_model(args.model), args.model)
        except ModelLoadError as error:
            print(f"fp32scope doctor: --model {args.model}: {error}", file=sys.stderr)
            return 2
    diagnosis = diagnose()
    if args.json:
        data = diagnosis.as_json()
        if report is not None:
            data["model"] = report.as_json()
        print(json.dumps(data, indent=2))
    else:
        print(render(diagnosis))
        if report is not None:
            print()
            print(render_model(report))
    return 0 if diagnosis.consistent and not diagnosis.overrides and (report is None or report.ok) else 1


# -- --model: which nodes of a model are scoped, and which declare a precision they lack ---


#: A ``--model`` target that cannot be loaded (exit status 2).
ModelLoadError = TargetError


def load_model(target: str) -> torch.nn.Module:
    """The module ``MODULE:ATTR`` names: the attribute itself, or what calling it returns."""
    obj, attribute = resolve(target, example="engine.model:build_model")
    if not isinstance(obj, torch.nn.Module) and callable(obj):
        obj = call_factory(obj, attribute)
    if not isinstance(obj, torch.nn.Module):
        msg = (
            f"{attribute} is not a torch.nn.Module, nor a callable that returns one; got "
            f"an object of type {type(obj).__name__}"
        )
        raise TargetError(msg)
    return obj


@dataclasses.dataclass(frozen=True)
class ModelNode:
    """One submodule of the checked model: its path, class, and precisions."""

    path: str
    type: str
    #: What the submodule declares on its class or instance (None: nothing).
    declares: Fp32Precision | None
    #: The precision the enclosing scoped nodes (itself included) apply; None: none applies.
    runs_in: Fp32Precision | None
    #: The path of the innermost scoped node it runs in (None: none).
    scoped_by: str | None
    #: Why its declaration is not what it runs in (None: it is).
    problem: str | None = None
    #: What makes it run in its declaration (None: nothing to fix, or no fix to suggest).
    fix: str | None = None


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """What ``doctor --model`` found: the scoped nodes and the modules that declare a precision."""

    target: str
    scoped: tuple[ModelNode, ...]
    declaring: tuple[ModelNode, ...]

    @property
    def findings(self) -> tuple[ModelNode, ...]:
        """The declaring submodules that do not run in their declared precision."""
        return tuple(node for node in self.declaring if node.problem is not None)

    @property
    def ok(self) -> bool:
        """True when every module that declares a precision runs in it."""
        return not self.findings

    def as_json(self) -> dict[str, object]:
        """The report as JSON-ready data (``model`` in the ``--json`` output)."""

        def node(n: ModelNode) -> dict[str, object]:
            data = dataclasses.asdict(n)
            for key in ("declares", "runs_in"):
                value = getattr(n, key)
                data[key] = None if value is None else value._asdict()
            return data

        return {
            "target": self.target,
            "ok": self.ok,
            "scoped": [node(n) for n in self.scoped],
            "declaring": [node(n) for n in self.declaring],
            "findings": [node(n) for n in self.findings],
        }


def _combine(outer: Fp32Precision | None, inner: Fp32Precision | None) -> Fp32Precision | None:
    # A scope inside another replaces the fields it sets and keeps the others.
    if inner is None:
        return outer
    if outer is None:
        return inner
    return Fp32Precision(
        inner.matmul if inner.matmul is not None else outer.matmul,
        inner.cudnn_allow_tf32 if inner.cudnn_allow_tf32 is not None else outer.cudnn_allow_tf32,
    )


def _mismatch(declares: Fp32Precision, runs_in: Fp32Precision | None) -> list[str]:
    fields = []
    for field in ("matmul", "cudnn_allow_tf32"):
        wanted = getattr(declares, field)
        if wanted is not None and (runs_in is None or getattr(runs_in, field) != wanted):
            fields.append(field)
    return fields


def _unwrap(module: torch.nn.Module) -> tuple[torch.nn.Module, Fp32Precision | None]:
    """The bare module under proxies and compiled modules, and the precision the proxies apply."""
    from torch._dynamo.eval_frame import OptimizedModule

    applied: Fp32Precision | None = None
    while True:  # a proxy around a compiled module around ...: one node, one path
        if isinstance(module, Fp32ScopedModule):
            precision = precision_of(module)
            if precision is not None and not precision.is_noop:
                applied = _combine(precision, applied)  # the inner proxy's fields win
            module = module.__wrapped__
        elif isinstance(module, OptimizedModule):
            module = module._orig_mod
        else:
            return module, applied


def _walk(model: torch.nn.Module) -> tuple[list[ModelNode], list[ModelNode]]:
    """Every scoped node of ``model`` and every submodule that declares a precision.

    Walks the module tree through proxies (their ``__wrapped__``) and compiled modules (their
    ``_orig_mod``), each module once, with the precision the enclosing proxies apply; its
    scoped nodes are :func:`~fp32scope.scoped_modules`'s (tested), with what encloses them.
    """
    scoped: list[ModelNode] = []
    declaring: list[ModelNode] = []
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module, Fp32Precision | None, str | None]] = [("", model, None, None)]
    while stack:
        path, module, runs_in, scoped_by = stack.pop()
        if id(module) in seen:  # a module reached twice (shared): listed at its first path
            continue
        seen.add(id(module))
        shown = path or "(model)"
        module, precision = _unwrap(module)
        seen.add(id(module))
        if precision is not None:
            runs_in = _combine(runs_in, precision)
            scoped_by = shown
            scoped.append(ModelNode(shown, type(module).__name__, None, runs_in, scoped_by))
        try:
            declares = node_fp32_precision(shown, module)
        except (TypeError, ValueError) as error:
            declaring.append(ModelNode(shown, type(module).__name__, None, runs_in, scoped_by, f"invalid: {error}"))
        else:
            if declares is not None:
                problem = fix = None
                fields = _mismatch(declares, runs_in)
                if fields:
                    where = (
                        "is in no scoped node"
                        if scoped_by is None
                        else f"scoped node {scoped_by!r} applies {_show(runs_in)}"
                    )
                    problem = f"declares {_show(declares)} but {where} ({', '.join(fields)})"
                    fix = f"wrap it: Fp32ScopedModule(module, node_fp32_precision({shown!r}, module))"
                node = ModelNode(shown, type(module).__name__, declares, runs_in, scoped_by, problem, fix)
                declaring.append(node)
        children = list(module._modules.items())
        stack.extend(
            (f"{path}.{key}" if path else key, child, runs_in, scoped_by)
            for key, child in reversed(children)
            if child is not None
        )
    return scoped, declaring


def _show(precision: Fp32Precision | None) -> str:
    if precision is None:
        return "the process default"
    cudnn = {None: "", True: "/cudnn-tf32", False: "/cudnn-fp32"}[precision.cudnn_allow_tf32]
    return f"{precision.matmul or '-'}{cudnn}"


def check_model(model: torch.nn.Module, target: str = "model") -> ModelReport:
    """Which nodes of ``model`` are scoped, and whether each declaring submodule runs in its precision."""
    scoped, declaring = _walk(model)
    return ModelReport(target, tuple(scoped), tuple(declaring))


def render_model(report: ModelReport) -> str:
    """The model report as the text ``doctor --model`` prints."""
    lines = [f"model {report.target}:"]
    if report.scoped:
        lines.append(f"scoped nodes ({len(report.scoped)}):")
        width = max(len(n.path) for n in report.scoped)
        lines.extend(f"  {n.path:<{width}}  {_show(n.runs_in)}  ({n.type})" for n in report.scoped)
    else:
        lines.append("scoped nodes: none")
    covered = [n for n in report.declaring if n.problem is None]
    if covered:
        lines.append("declaring modules that run in their precision:")
        lines.extend(
            f"  {n.path} ({n.type}) declares {_show(n.declares)}, runs in scoped node {n.scoped_by!r}" for n in covered
        )
    if report.ok:
        lines.append("ok: every module that declares a precision runs in it.")
    else:
        lines.append(f"FOUND {len(report.findings)} module(s) not running in the precision they declare:")
        for i, n in enumerate(report.findings, 1):
            lines.append(f"  {i}. {n.path} ({n.type}) {n.problem}")
            if n.fix is not None:
                lines.append(f"     {n.fix}")
    return "\n".join(lines)
