"""Exported artifacts that carry their node's precision: AOTInductor packages and saved programs.

A node's precision cannot live inside one exported graph (torch reads the process-wide
flags when it compiles the graph and when its kernels run), so it travels next to the
graph: compiled in, recorded in the artifact (see :mod:`fp32scope._export.record`), and
applied around every call of what is loaded from it.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
import wrapt

from fp32scope._compat import TORCH_RELEASE, aoti_packaging_missing
from fp32scope._export.record import (
    EXTRA_FILE,
    check_not_reserved,
    read_record,
    read_record_file,
    record,
    record_file,
)
from fp32scope._flags import dynamo_exclude
from fp32scope._flags.precision import Fp32Precision, check_precision
from fp32scope._flags.scope import fp32_precision_scope, wrapper_scope
from fp32scope._wrappers.proxy import Fp32ScopedModule

if TYPE_CHECKING:
    from torch.export import ExportedProgram
    from torch.export.pt2_archive._package import AOTICompiledModel

__all__ = [
    "RECORDED",
    "ScopedAOTIModel",
    "aoti_compile_and_package",
    "aoti_load_package",
    "load_exported_program",
    "save_exported_program",
]

_METADATA: Final = "aot_inductor.metadata"


class _Recorded:
    """The type of :data:`RECORDED`, the loaders' default ``precision=`` (one instance)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<recorded>"


#: ``precision=RECORDED`` (the default): use the precision the artifact records.
RECORDED: Final = _Recorded()


def _aoti_missing() -> str | None:
    """Why this torch cannot compile a package with a record, or None when it can."""
    return aoti_packaging_missing(_inductor())


def _inductor() -> Any:
    # Imported on first use: Inductor takes about a second to import. torch 2.10's package
    # loader reads torch._inductor.codecache without importing it, so that a fresh process's
    # first aoti_load_package failed with "module 'torch._inductor' has no attribute 'codecache'".
    import torch._inductor
    import torch._inductor.codecache
    import torch._inductor.config

    return torch._inductor


def _refuse_without_aoti(function: str) -> None:
    missing = _aoti_missing()
    if missing is not None:
        msg = f"fp32scope.{function} needs AOTInductor packaging: {missing}."
        raise NotImplementedError(msg)


def _check_exported_program(exported_program: object) -> ExportedProgram:
    from torch.export import ExportedProgram

    if not isinstance(exported_program, ExportedProgram):
        msg = (
            f"exported_program must be a torch.export.ExportedProgram (from torch.export.export(node, args)); "
            f"got {exported_program!r} of type {type(exported_program).__name__}."
        )
        raise TypeError(msg)
    return exported_program


def _check_path(value: object, argument: str, *, suffix: str | None = None, exists: bool = False) -> str:
    if not isinstance(value, (str, os.PathLike)):
        msg = (
            f"{argument} must be a path (str or os.PathLike); got {value!r} of type {type(value).__name__}. "
            "Packages are files on disk, which is where an engine (a C++ one too) loads them from."
        )
        raise TypeError(msg)
    path = os.fspath(value)
    if not isinstance(path, str):
        msg = f"{argument} must be a str path; got {value!r}, a bytes path."
        raise TypeError(msg)
    if suffix is not None and not path.endswith(suffix):
        msg = f"{argument} must end in {suffix!r} (torch's AOTInductor packages do); got {path!r}."
        raise ValueError(msg)
    if exists and not Path(path).is_file():
        msg = f"{argument} {path!r} is not a file."
        raise FileNotFoundError(msg)
    return path


def _check_inductor_configs(inductor_configs: object) -> dict[str, Any]:
    """A copy of the caller's configs with the record merged into ``aot_inductor.metadata``."""
    if inductor_configs is None:
        return {}
    if not isinstance(inductor_configs, dict):
        msg = (
            f"inductor_configs must be a dict of Inductor config names to values, or None; got "
            f"{inductor_configs!r} of type {type(inductor_configs).__name__}."
        )
        raise TypeError(msg)
    for key in inductor_configs:
        if not isinstance(key, str):
            msg = f"inductor_configs must have str keys; got {key!r} of type {type(key).__name__}."
            raise TypeError(msg)
    metadata = inductor_configs.get(_METADATA)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            msg = (
                f"inductor_configs[{_METADATA!r}] must be a dict of str to str (AOTInductor stores strings "
                f"only); got {metadata!r}."
            )
            raise TypeError(msg)
        check_not_reserved(metadata, f"inductor_configs[{_METADATA!r}]")
    return dict(inductor_configs)


def aoti_compile_and_package(
    exported_program: ExportedProgram,
    precision: Fp32Precision | None,
    *,
    package_path: str | os.PathLike[str] | None = None,
    inductor_configs: dict[str, Any] | None = None,
) -> str:
    """Compile an exported node with AOTInductor in ``precision`` into a package that records it.

    The compile (``torch._inductor.aoti_compile_and_package``) runs inside
    ``fp32_precision_scope(precision)``, so that code Inductor generates from the flags
    (Triton matmul and convolution templates' TF32 on CUDA, autotuning) is generated for the
    node's precision; the flags are restored afterwards, also when compiling fails. The
    precision is recorded in the package's AOTInductor metadata under the keys
    ``fp32scope.version``, ``fp32scope.matmul`` and ``fp32scope.cudnn_allow_tf32`` (see
    :doc:`guide/exported`), merged with the caller's own ``inductor_configs["aot_inductor.metadata"]``;
    the caller's dicts are not changed. None (or a field that is None) is recorded as
    ``"None"``: the package then runs in the loading process's default for that flag.

    ``package_path`` is a path ending in ``.pt2``, or None for a file torch names. Every
    argument is checked before compiling: :class:`TypeError` or :class:`ValueError` naming
    it; metadata keys starting with ``fp32scope`` are reserved. Returns the package's path.
    Raises :class:`NotImplementedError` on a torch without AOTInductor packaging (before 2.6).
    Load the package with :func:`aoti_load_package` (Python) or read the record with
    ``AOTIModelPackageLoader::get_metadata()`` (C++).
    """
    ep = _check_exported_program(exported_program)
    checked = check_precision(precision)
    path = None if package_path is None else _check_path(package_path, "package_path", suffix=".pt2")
    configs = _check_inductor_configs(inductor_configs)
    if getattr(ep, "example_inputs", ()) is None:
        msg = (
            "exported_program has no example inputs, which AOTInductor needs: export it with "
            "torch.export.export(node, args) (a program loaded from an old file may lack them)."
        )
        raise ValueError(msg)
    _refuse_without_aoti("aoti_compile_and_package")
    configs[_METADATA] = {**configs.get(_METADATA, {}), **record(checked)}
    inductor = _inductor()
    with fp32_precision_scope(checked):
        result = inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=configs)
    return str(os.fspath(result))


def _resolve(recorded: Fp32Precision | None, requested: object, where: str, load: str) -> Fp32Precision | None:
    """The precision to apply: the recorded one, or ``requested`` where nothing is recorded."""
    if requested is RECORDED:
        if recorded is None:
            msg = (
                f"{where} records no fp32scope precision (it was not written by fp32scope), so the precision "
                f"its calls need is unknown. Pass the precision it was made for: "
                f"{load}(..., precision=Fp32Precision(...)), or None to run it in the process default."
            )
            raise ValueError(msg)
        return recorded
    checked = check_precision(requested)
    if recorded is None:
        return checked
    if (checked or Fp32Precision()) != recorded:
        msg = (
            f"precision={checked!r} differs from the precision {where} records, {recorded!r}: the artifact was "
            "made for the recorded precision (an AOTInductor package's code is generated for it). Leave "
            "precision= out to use the recorded one, or export and compile the node again in the other precision."
        )
        raise ValueError(msg)
    return recorded


if TYPE_CHECKING:
    _ProxyBase = wrapt.BaseObjectProxy[Any]
else:  # subscripting at run time needs a newer wrapt than the 2.0 this library supports
    _ProxyBase = wrapt.BaseObjectProxy


class ScopedAOTIModel(_ProxyBase):
    """A loaded AOTInductor package whose every call runs in its node's precision.

    What :func:`~fp32scope.aoti_load_package` returns; not made directly.
    Transparent like :class:`~fp32scope.Fp32ScopedModule`: ``isinstance`` against torch's
    ``AOTICompiledModel`` holds and ``get_metadata``, ``get_constant_fqns`` and
    ``load_constants`` are the package's. The bare model is ``__wrapped__``; the precision
    is :func:`~fp32scope.precision_of`'s answer. A package's outputs carry no autograd
    history, so there is no backward to scope: every call (grad mode, ``torch.no_grad()``,
    ``torch.inference_mode()``) runs inside one scope.
    """

    def __init__(self, model: AOTICompiledModel, precision: Fp32Precision | None, name: str) -> None:
        dynamo_exclude.ensure()
        super().__init__(model)
        self._self_precision = precision
        self._self_scope = wrapper_scope(precision, name)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        """Run the package on ``args`` and ``kwargs`` in its precision; returns the package's outputs."""
        with self._self_scope:
            return self.__wrapped__(*args, **kwargs)

    @property
    def __fp32scope_precision__(self) -> Fp32Precision | None:
        """The precision every call runs in (what :func:`~fp32scope.precision_of` returns)."""
        return self._self_precision

    def __repr__(self) -> str:
        return f"ScopedAOTIModel(precision={self._self_precision!r}, model={self.__wrapped__!r})"


dynamo_exclude.exclude(ScopedAOTIModel.__call__)


def _torch_load_kwargs(torch_kwargs: dict[str, Any]) -> None:
    loader = _inductor().aoti_load_package
    allowed = [name for name in inspect.signature(loader).parameters if name != "path"]
    for name in torch_kwargs:
        if name not in allowed:
            msg = (
                f"aoti_load_package got the keyword {name!r}, which torch {TORCH_RELEASE}'s "
                f"torch._inductor.aoti_load_package does not take; it takes {', '.join(map(repr, allowed))}."
            )
            raise TypeError(msg)


def aoti_load_package(
    path: str | os.PathLike[str],
    *,
    precision: Fp32Precision | _Recorded | None = RECORDED,
    **torch_kwargs: Any,
) -> ScopedAOTIModel:
    """Load an AOTInductor package; every call of what it returns runs in the package's precision.

    Returns a :class:`ScopedAOTIModel`: a transparent wrapper around torch's
    ``AOTICompiledModel`` (its ``__wrapped__``), loaded with
    ``torch._inductor.aoti_load_package(path, **torch_kwargs)``, whose every call runs
    inside ``fp32_precision_scope`` with the precision recorded by
    :func:`aoti_compile_and_package`, whatever this process's default;
    :func:`~fp32scope.precision_of` returns that precision.

    ``precision`` defaults to the recorded one. Refused with :class:`ValueError` (nothing
    returned): a package that records no precision, unless ``precision=`` says which one
    (None: the process default); a ``precision=`` that differs from the recorded one (the
    package's code was generated for that one). Where torch can read the record without
    loading the package's shared library (``load_metadata_from_package``: torch 2.13 and
    2.14 can, 2.8 cannot), a refused package is never loaded. Raises
    :class:`NotImplementedError` on a torch without AOTInductor packaging.
    """
    checked_path = _check_path(path, "path", exists=True)
    if precision is not RECORDED:
        check_precision(precision)
    _refuse_without_aoti("aoti_load_package")
    _torch_load_kwargs(torch_kwargs)
    where = f"the package {checked_path!r}"
    loader_class = torch._C._aoti.AOTIModelPackageLoader
    early = getattr(loader_class, "load_metadata_from_package", None)
    if early is not None:
        resolved = _resolve(read_record(early(checked_path, "model"), where), precision, where, "aoti_load_package")
        model = _inductor().aoti_load_package(checked_path, **torch_kwargs)
    else:
        model = _inductor().aoti_load_package(checked_path, **torch_kwargs)
        resolved = _resolve(read_record(model.get_metadata(), where), precision, where, "aoti_load_package")
    name = Path(checked_path).name
    return ScopedAOTIModel(model, resolved, name)


def _check_file(f: object, *, write: bool) -> str | os.PathLike[str] | Any:
    if isinstance(f, (str, os.PathLike)):
        return f
    method = "write" if write else "read"
    if not callable(getattr(f, method, None)) or not callable(getattr(f, "seek", None)):
        msg = (
            f"f must be a path (str or os.PathLike) or a binary file object with {method} and seek; "
            f"got {f!r} of type {type(f).__name__}."
        )
        raise TypeError(msg)
    return f


def _check_extra_files(extra_files: object) -> dict[str, Any]:
    if extra_files is None:
        return {}
    if not isinstance(extra_files, dict):
        msg = (
            f"extra_files must be a dict of file names to str, or None; got {extra_files!r} of type "
            f"{type(extra_files).__name__}."
        )
        raise TypeError(msg)
    check_not_reserved(extra_files, "extra_files")
    return extra_files


def save_exported_program(
    exported_program: ExportedProgram,
    f: str | os.PathLike[str] | Any,
    precision: Fp32Precision | None,
    *,
    extra_files: dict[str, Any] | None = None,
) -> None:
    """Save an exported node with ``torch.export.save``, recording the precision it runs in.

    The record is the extra file ``fp32scope_precision.json``, a JSON object with the same
    keys and values as a package's record (see :doc:`guide/exported`), saved beside the
    caller's own ``extra_files`` (not changed; names starting with ``fp32scope`` are
    reserved). ``f`` is a path or a writable binary file object. Every argument is checked
    before anything is written. Load it with :func:`load_exported_program`.
    """
    ep = _check_exported_program(exported_program)
    checked = check_precision(precision)
    target = _check_file(f, write=True)
    files = _check_extra_files(extra_files)
    if any(not isinstance(v, (str, bytes)) for v in files.values()):
        msg = "extra_files must map file names to str (or bytes) contents."
        raise TypeError(msg)
    torch.export.save(ep, target, extra_files={**files, EXTRA_FILE: record_file(checked)})


def load_exported_program(
    f: str | os.PathLike[str] | Any,
    *,
    precision: Fp32Precision | _Recorded | None = RECORDED,
    extra_files: dict[str, Any] | None = None,
) -> Fp32ScopedModule:
    """Load a saved exported node as an :class:`~fp32scope.Fp32ScopedModule` in its recorded precision.

    Returns ``Fp32ScopedModule(ep.module(), p)`` where ``ep`` is what ``torch.export.load``
    gives and ``p`` the precision :func:`save_exported_program` recorded. ``extra_files`` is
    filled as ``torch.export.load`` fills it (the record's own file left out). The same
    refusals as :func:`aoti_load_package`, with :class:`ValueError`: no record and no
    ``precision=``; a ``precision=`` that differs from the record. They come after the file
    is read and before anything runs.
    """
    source = _check_file(f, write=False)
    if isinstance(source, (str, os.PathLike)):
        _check_path(source, "f", exists=True)
    if precision is not RECORDED:
        check_precision(precision)
    requested = _check_extra_files(extra_files)
    files = {**requested, EXTRA_FILE: ""}
    ep = torch.export.load(source, extra_files=files)
    where = (
        f"the saved program {os.fspath(source)!r}" if isinstance(source, (str, os.PathLike)) else "the saved program"
    )
    text = files.pop(EXTRA_FILE, "")
    found = read_record_file(text, where) if text else None
    resolved = _resolve(found, precision, where, "load_exported_program")
    if extra_files is not None:
        extra_files.update(files)
    return Fp32ScopedModule(ep.module(), resolved)


# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
ScopedAOTIModel.__module__ = "fp32scope"
