"""torch.export and AOTInductor: a node's precision is compiled into, recorded in, and applied around its artifact.

One AOTInductor package is compiled for the whole module (a CPU compile takes 8-70 s on
this machine kind) and shared by the tests; packages without a record, or with a bad one,
are copies of it with the record's metadata rewritten (what torch's packager writes
otherwise is untouched). The node has a probe custom op: its fake kernel runs while
Inductor compiles, its real kernel on every call of the loaded package, and each records
the flags it sees.
"""

# No ``from __future__ import annotations``: torch 2.4's custom_op reads the annotations as
# objects, not strings.
import copy
import inspect
import io
import json
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp32scope
from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    Fp32ScopeError,
    current_fp32_precision,
    fp32_precision_scope,
    precision_of,
    with_fp32_precision,
)
from fp32scope._export import export as _export
from fp32scope._export import record as _export_record
from fp32scope._flags import dynamo_exclude as _dynamo_exclude
from fp32scope._flags import torch_flags as _flags
from fp32scope._flags.precision import MatmulPrecision
from tests._support.common import ROOT
from tests._support.releases import TORCH_RELEASE, make_unusual_state

#: The node's precision, and the (different) default of the process that compiles and loads it.
PRECISION = Fp32Precision("highest", cudnn_allow_tf32=False)
DEFAULT = Fp32Precision("medium", cudnn_allow_tf32=True)
MATMULS: tuple[MatmulPrecision | None, ...] = (None, "highest", "high", "medium")
RECORD = {"fp32scope.version": "1", "fp32scope.matmul": "highest", "fp32scope.cudnn_allow_tf32": "False"}

FAKE: list[Fp32Precision] = []
REAL: list[Fp32Precision] = []


@torch.library.custom_op("fp32scope_tests::export_probe", mutates_args=())
def export_probe(x: torch.Tensor) -> torch.Tensor:
    """The identity; records the flags where it runs (eager, or a loaded package's call)."""
    REAL.append(current_fp32_precision())
    return x.clone()


@export_probe.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    # Runs while torch.export traces and while Inductor compiles: the compile-time flags.
    FAKE.append(current_fp32_precision())
    return torch.empty_like(x)


class Node(torch.nn.Module):
    """A node that needs full fp32: a matmul (precision-sensitive on CPU under "medium") and a probe."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = export_probe(self.proj(x))
        return out


_AOTI_MISSING = _export._aoti_missing()
needs_aoti = pytest.mark.skipif(_AOTI_MISSING is not None, reason=f"{_AOTI_MISSING}: nothing to package")
_EARLY = hasattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader") and hasattr(
    torch._C._aoti.AOTIModelPackageLoader, "load_metadata_from_package"
)
needs_early_metadata = pytest.mark.skipif(
    not _EARLY,
    reason=f"torch {TORCH_RELEASE} has no AOTIModelPackageLoader.load_metadata_from_package (reads the record "
    "without loading the package's library)",
)


def set_default(precision: Fp32Precision) -> None:
    """Put the process in ``precision`` the way an engine sets its default (legacy setters)."""
    torch.set_float32_matmul_precision(precision.matmul or "highest")
    torch.backends.cudnn.allow_tf32 = bool(precision.cudnn_allow_tf32)


@dataclass
class Compiled:
    """The shared package and what its compile showed."""

    node: Node
    x: torch.Tensor
    path: str
    fake_seen: list[Fp32Precision]
    default_before: Fp32Precision
    default_after: Fp32Precision
    configs: dict[str, Any]
    configs_copy: dict[str, Any]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compiled]:
    """Export the node and compile it once, in PRECISION, while the process default is DEFAULT."""
    if _AOTI_MISSING is not None:
        pytest.skip(_AOTI_MISSING)
    saved = _flags.save_raw_state()
    try:
        torch.manual_seed(0)
        node = Node()
        x = torch.randn(16, 256)
        ep = torch.export.export(node, (x,))
        configs: dict[str, Any] = {"aot_inductor.metadata": {"engine.node": "head"}}
        configs_copy = copy.deepcopy(configs)
        set_default(DEFAULT)
        before = current_fp32_precision()
        FAKE.clear()
        path = fp32scope.aoti_compile_and_package(
            ep, PRECISION, package_path=tmp_path_factory.mktemp("aoti") / "node.pt2", inductor_configs=configs
        )
        after = current_fp32_precision()
        yield Compiled(node, x, path, list(FAKE), before, after, configs, configs_copy)
    finally:
        _flags.restore_raw_state(saved)


def rewrite_metadata(source: str, target: Path, change: Callable[[dict[str, str]], dict[str, str]]) -> str:
    """Copy a package, passing its AOTInductor metadata (the ``*_metadata.json`` files) through ``change``."""
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("_metadata.json"):
                data = json.dumps(change(json.loads(data))).encode()
            zout.writestr(info, data)
    return str(target)


def without_record(metadata: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in metadata.items() if not k.startswith("fp32scope")}


MODES: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "grad": nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


# -- compile time ------------------------------------------------------------------------


@needs_aoti
def test_compiles_in_the_nodes_precision_and_restores_the_default(compiled: Compiled) -> None:
    assert compiled.fake_seen, "Inductor never ran the probe's fake kernel"
    assert set(compiled.fake_seen) == {PRECISION}
    assert compiled.default_before == compiled.default_after == DEFAULT


@needs_aoti
def test_the_callers_configs_are_not_changed(compiled: Compiled) -> None:
    assert compiled.configs == compiled.configs_copy


# -- the record --------------------------------------------------------------------------


@needs_aoti
@needs_early_metadata
def test_record_reads_without_loading_the_library(compiled: Compiled) -> None:
    metadata = torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(compiled.path, "model")  # type: ignore[attr-defined]
    assert {k: metadata[k] for k in RECORD} == RECORD
    assert metadata["engine.node"] == "head"  # the caller's own metadata is kept


@needs_aoti
def test_record_reads_with_torchs_loader(compiled: Compiled) -> None:
    metadata = torch._inductor.aoti_load_package(compiled.path).get_metadata()
    assert {k: metadata[k] for k in RECORD} == RECORD
    assert metadata["engine.node"] == "head"


@pytest.mark.parametrize(
    "precision",
    [None, *(Fp32Precision(m, c) for m, c in product(MATMULS, (None, True, False)))],
)
def test_every_precision_round_trips_through_its_record(precision: Fp32Precision | None) -> None:
    written = _export_record.record(precision)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in written.items())
    assert _export_record.read_record(written, "here") == (precision or Fp32Precision())
    assert _export_record.read_record_file(_export_record.record_file(precision), "here") == (
        precision or Fp32Precision()
    )


@given(st.dictionaries(st.sampled_from([*_export_record.KEYS, "fp32scope.other", "engine"]), st.text(max_size=8)))
def test_a_record_reads_back_as_written_or_is_refused(metadata: dict[str, str]) -> None:
    try:
        found = _export_record.read_record(metadata, "here")
    except ValueError as error:
        refusal = str(error)
        found = None
    else:
        refusal = ""
    if refusal:
        assert "fp32scope precision record in here" in refusal
    elif found is None:
        assert not any(k.startswith("fp32scope") for k in metadata)
    else:
        assert {k: metadata[k] for k in _export_record.KEYS} == _export_record.record(found)


# -- run time ----------------------------------------------------------------------------


@needs_aoti
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_call_runs_in_the_recorded_precision(compiled: Compiled, mode: str) -> None:
    loaded = fp32scope.aoti_load_package(compiled.path)
    set_default(DEFAULT)
    x = compiled.x.clone().requires_grad_(True)
    REAL.clear()
    with MODES[mode]():
        first = loaded(x)
        second = loaded(x)
    assert REAL == [PRECISION, PRECISION]
    assert current_fp32_precision() == DEFAULT
    assert torch.equal(first, second)
    REAL.clear()
    loaded.__wrapped__(x)  # the bare package runs in whatever the process holds
    assert REAL == [DEFAULT]


@needs_aoti
def test_flags_are_restored_when_a_call_fails(compiled: Compiled) -> None:
    loaded = fp32scope.aoti_load_package(compiled.path)
    make_unusual_state()
    state = _flags.save_raw_state()
    with pytest.raises(RuntimeError):
        loaded(torch.randn(3, 5))  # not the shape it was compiled for
    assert _flags.save_raw_state() == state


@needs_aoti
def test_the_wrapper_is_transparent(compiled: Compiled) -> None:
    from torch._inductor.package import AOTICompiledModel  # type: ignore[attr-defined]

    loaded = fp32scope.aoti_load_package(compiled.path)
    assert precision_of(loaded) == PRECISION
    assert type(loaded.__wrapped__) is AOTICompiledModel
    assert isinstance(loaded, AOTICompiledModel)
    assert {k: loaded.get_metadata()[k] for k in RECORD} == RECORD
    assert sorted(loaded.get_constant_fqns()) == ["proj.bias", "proj.weight"]
    # New weights through load_constants: the package computes with them, in its precision.
    weight = torch.randn(256, 256)
    loaded.load_constants({"proj.weight": weight, "proj.bias": torch.zeros(256)}, check_full_update=True)
    set_default(DEFAULT)
    with fp32_precision_scope(PRECISION):
        expected = compiled.x @ weight.T
    REAL.clear()
    torch.testing.assert_close(loaded(compiled.x), expected)
    assert REAL == [PRECISION]


@needs_aoti
def test_numerics_under_a_medium_default_equal_full_fp32(compiled: Compiled) -> None:
    loaded = fp32scope.aoti_load_package(compiled.path)
    x = compiled.x
    with fp32_precision_scope(PRECISION):
        eager = compiled.node(x)
    set_default(DEFAULT)
    scoped = loaded(x)
    bare = loaded.__wrapped__(x)
    if torch.equal(bare, scoped):
        pytest.skip("this CPU computes float32 matmuls under 'medium' as under 'highest': nothing to tell apart")
    torch.testing.assert_close(scoped, eager, rtol=1.3e-6, atol=1e-5)
    exact = x.double() @ compiled.node.proj.weight.double().T + compiled.node.proj.bias.double()
    assert (scoped.double() - exact).abs().max() < (bare.double() - exact).abs().max()
    assert current_fp32_precision() == DEFAULT


# -- refusals ----------------------------------------------------------------------------


@needs_aoti
def test_a_package_without_a_record_needs_a_precision(compiled: Compiled, tmp_path: Path) -> None:
    path = rewrite_metadata(compiled.path, tmp_path / "plain.pt2", without_record)
    with pytest.raises(ValueError, match="records no fp32scope precision") as info:
        fp32scope.aoti_load_package(path)
    assert "precision=Fp32Precision(...)" in str(info.value)
    given_one = fp32scope.aoti_load_package(path, precision=PRECISION)
    assert precision_of(given_one) == PRECISION
    set_default(DEFAULT)
    REAL.clear()
    given_one(compiled.x)
    assert REAL == [PRECISION]
    unscoped = fp32scope.aoti_load_package(path, precision=None)
    assert precision_of(unscoped) is None
    REAL.clear()
    unscoped(compiled.x)
    assert REAL == [DEFAULT]


@needs_aoti
@pytest.mark.parametrize("other", [Fp32Precision("high", cudnn_allow_tf32=False), Fp32Precision("highest"), None])
def test_a_precision_that_differs_from_the_record_is_refused(compiled: Compiled, other: Fp32Precision | None) -> None:
    with pytest.raises(ValueError, match="differs from the precision") as info:
        fp32scope.aoti_load_package(compiled.path, precision=other)
    assert repr(PRECISION) in str(info.value)
    assert precision_of(fp32scope.aoti_load_package(compiled.path, precision=PRECISION)) == PRECISION


@needs_aoti
@needs_early_metadata
def test_a_refused_package_is_never_loaded(compiled: Compiled, tmp_path: Path) -> None:
    # Its library is garbage: loading it would fail, so a ValueError shows it was refused first.
    broken = tmp_path / "broken.pt2"
    with zipfile.ZipFile(compiled.path) as zin, zipfile.ZipFile(broken, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, b"not a library" if info.filename.endswith(".so") else zin.read(info.filename))
    with pytest.raises(ValueError, match="differs from the precision"):
        fp32scope.aoti_load_package(broken, precision=Fp32Precision("medium"))


@needs_aoti
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: {**m, "fp32scope.matmul": "HIGHEST"}, "fp32scope.matmul='HIGHEST'"),
        (lambda m: {**m, "fp32scope.version": "2"}, "fp32scope.version='2'"),
        (lambda m: {k: v for k, v in m.items() if k != "fp32scope.cudnn_allow_tf32"}, "lacks"),
    ],
)
def test_a_bad_record_is_refused(
    compiled: Compiled, tmp_path: Path, change: Callable[[dict[str, str]], dict[str, str]], message: str
) -> None:
    path = rewrite_metadata(compiled.path, tmp_path / "bad.pt2", change)
    with pytest.raises(ValueError, match="fp32scope precision record") as info:
        fp32scope.aoti_load_package(path)
    assert message in str(info.value)


def _bad_compile_calls(tmp_path: Path) -> list[tuple[Callable[[], object], type[Exception], str]]:
    class Small(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    ep = torch.export.export(Small(), (torch.randn(2),))
    compile_ = fp32scope.aoti_compile_and_package
    return [
        (
            lambda: compile_(Small(), PRECISION),  # type: ignore[arg-type]
            TypeError,
            "exported_program must be a torch.export.ExportedProgram",
        ),
        (lambda: compile_(ep, "highest"), TypeError, "precision must be an fp32scope.Fp32Precision"),  # type: ignore[arg-type]
        (lambda: compile_(ep, Fp32Precision("HIGH")), ValueError, "precision.matmul"),  # type: ignore[arg-type]
        (lambda: compile_(ep, PRECISION, package_path=tmp_path / "x.zip"), ValueError, "must end in '.pt2'"),
        (lambda: compile_(ep, PRECISION, package_path=io.BytesIO()), TypeError, "package_path must be a path"),  # type: ignore[arg-type]
        (lambda: compile_(ep, PRECISION, inductor_configs=[]), TypeError, "inductor_configs must be a dict"),  # type: ignore[arg-type]
        (
            lambda: compile_(ep, PRECISION, inductor_configs={"aot_inductor.metadata": {"k": 1}}),
            TypeError,
            "dict of str to str",
        ),
        (
            lambda: compile_(ep, PRECISION, inductor_configs={"aot_inductor.metadata": {"fp32scope.matmul": "high"}}),
            ValueError,
            "reserved",
        ),
    ]


def test_compile_checks_its_arguments_before_acting(tmp_path: Path) -> None:
    make_unusual_state()
    for call, error, message in _bad_compile_calls(tmp_path):
        state = _flags.save_raw_state()
        with pytest.raises(error, match=None) as info:
            call()
        assert message in str(info.value)
        assert _flags.save_raw_state() == state
    assert list(tmp_path.iterdir()) == []


@needs_aoti
def test_flags_are_restored_when_compiling_fails() -> None:
    class Small(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    ep = torch.export.export(Small(), (torch.randn(2),))
    make_unusual_state()
    state = _flags.save_raw_state()
    with pytest.raises(AttributeError, match="no_such_inductor_option"):
        fp32scope.aoti_compile_and_package(ep, PRECISION, inductor_configs={"no_such_inductor_option": 1})
    assert _flags.save_raw_state() == state


@needs_aoti
def test_load_checks_its_arguments_before_acting(compiled: Compiled, tmp_path: Path) -> None:
    make_unusual_state()
    state = _flags.save_raw_state()
    with pytest.raises(FileNotFoundError, match="is not a file"):
        fp32scope.aoti_load_package(tmp_path / "missing.pt2")
    with pytest.raises(TypeError, match="path must be a path"):
        fp32scope.aoti_load_package(io.BytesIO())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="precision must be an fp32scope.Fp32Precision"):
        fp32scope.aoti_load_package(compiled.path, precision="highest")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'no_such_keyword'"):
        fp32scope.aoti_load_package(compiled.path, no_such_keyword=1)
    assert _flags.save_raw_state() == state


# -- errors written for export -----------------------------------------------------------


def _scoped_targets() -> dict[str, Callable[[], Any]]:
    @with_fp32_precision(PRECISION)
    def head(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    class WithChild(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Fp32ScopedModule(torch.nn.Linear(4, 4), PRECISION)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.child(x) + 1
            return out

    class WithFunction(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return head(x) + 1

    return {
        "child module": WithChild,
        "decorated function": WithFunction,
        "scoped node": lambda: Fp32ScopedModule(torch.nn.Linear(4, 4), PRECISION),
    }


#: Whether Dynamo reports why a function was excluded (torch.compiler.disable(reason=...), torch >= 2.8).
DYNAMO_SHOWS_REASONS = "reason" in inspect.signature(torch.compiler.disable).parameters
EXPORT_FIX = ("__wrapped__", "fp32scope.aoti_compile_and_package", "fp32scope.save_exported_program")


@pytest.mark.parametrize("target", sorted(_scoped_targets()))
def test_non_strict_export_of_scoped_code_says_what_to_do(target: str) -> None:
    model = _scoped_targets()[target]()
    make_unusual_state()
    state = _flags.save_raw_state()
    with pytest.raises(Fp32ScopeError) as info:
        torch.export.export(model, (torch.randn(2, 4),), strict=False)
    message = str(info.value)
    assert message.startswith("torch.export cannot export a scoped call")
    assert "one exported graph cannot carry a float32 precision change" in message
    assert all(fix in message for fix in EXPORT_FIX)
    assert "torch.compile" not in message
    assert _flags.save_raw_state() == state


@pytest.mark.parametrize("target", sorted(_scoped_targets()))
def test_strict_export_of_scoped_code_says_what_to_do(target: str) -> None:
    model = _scoped_targets()[target]()
    if _dynamo_exclude.dynamo_resets_medium():
        # torch 2.4-2.8: any Dynamo compile turns "medium" into "high" (torch's doing, with or
        # without fp32scope); start from another unusual state.
        set_default(Fp32Precision("high", cudnn_allow_tf32=False))
    else:
        make_unusual_state()
    state = _flags.save_raw_state()
    with pytest.raises(Exception) as info:
        torch.export.export(model, (torch.randn(2, 4),), strict=True)
    message = str(info.value)
    if DYNAMO_SHOWS_REASONS or "torch.export cannot export" in message:
        # Dynamo's refusal with fp32scope's reason, or the scope's or an in-graph region's own.
        assert "torch.export cannot export" in message
        assert "one exported graph cannot carry a" in message
        assert all(fix in message for fix in EXPORT_FIX)
    elif target != "scoped node":  # torch 2.4's Dynamo names the disabled function, without its reason
        assert "torch._dynamo.disable() wrapped function <function" in message
    # (torch 2.4's strict export of the proxy itself fails inside torch: "Unexpectedly found a
    # <class 'torch._subclasses.fake_tensor.FakeTensor'> in the outputs".)
    assert _flags.save_raw_state() == state


@pytest.mark.skipif(
    not hasattr(torch.compiler, "is_exporting"),
    reason=f"torch {TORCH_RELEASE} has no torch.compiler.is_exporting(): a scope cannot tell strict export from "
    "torch.compile there, and says what torch.compile needs",
)
def test_strict_export_of_a_scope_inside_forward_says_what_to_do() -> None:
    class WithScope(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with fp32_precision_scope(PRECISION):
                return x * 2

    if _dynamo_exclude.dynamo_resets_medium():
        # torch 2.4-2.8: any Dynamo compile turns "medium" into "high" (torch's doing, with or
        # without fp32scope); start from another unusual state.
        set_default(Fp32Precision("high", cudnn_allow_tf32=False))
    state = _flags.save_raw_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp32scope.Fp32EagerFallbackWarning)  # nothing runs eagerly: export fails
        with pytest.raises(Exception) as info:
            torch.export.export(WithScope(), (torch.randn(2, 4),), strict=True)
    message = str(info.value)
    assert "torch.export cannot export" in message
    assert "torch.compile is tracing" not in message
    assert _flags.save_raw_state() == state


# -- saved exported programs -------------------------------------------------------------


def _export_node() -> tuple[Node, torch.Tensor, Any]:
    torch.manual_seed(0)
    node = Node()
    x = torch.randn(4, 256)
    return node, x, torch.export.export(node, (x,))


def test_a_saved_program_loads_in_its_recorded_precision(tmp_path: Path) -> None:
    node, x, ep = _export_node()
    matmul_only = Fp32Precision("highest")  # the cuDNN field None: recorded as such, left to the process
    extra = {"engine.txt": "v3"}
    fp32scope.save_exported_program(ep, tmp_path / "node.pt2", matmul_only, extra_files=extra)
    assert extra == {"engine.txt": "v3"}
    asked = {"engine.txt": ""}
    loaded = fp32scope.load_exported_program(tmp_path / "node.pt2", extra_files=asked)
    assert asked == {"engine.txt": "v3"}
    assert isinstance(loaded, Fp32ScopedModule)
    assert precision_of(loaded) == matmul_only
    set_default(DEFAULT)
    REAL.clear()
    for mode in sorted(MODES):
        with MODES[mode]():
            out = loaded(x)
    assert [Fp32Precision("highest", cudnn_allow_tf32=True)] * 3 == REAL
    assert current_fp32_precision() == DEFAULT
    with fp32_precision_scope(matmul_only):
        torch.testing.assert_close(out, node(x))
    # The record is a plain extra file that torch.export.load gives anyone.
    files = {_export_record.EXTRA_FILE: ""}
    torch.export.load(tmp_path / "node.pt2", extra_files=files)
    assert json.loads(files[_export_record.EXTRA_FILE]) == _export_record.record(matmul_only)


def test_a_saved_program_round_trips_through_a_buffer() -> None:
    _, x, ep = _export_node()
    buffer = io.BytesIO()
    fp32scope.save_exported_program(ep, buffer, PRECISION)
    buffer.seek(0)
    loaded = fp32scope.load_exported_program(buffer)
    assert precision_of(loaded) == PRECISION
    REAL.clear()
    loaded(x)
    assert REAL == [PRECISION]


def test_saved_program_refusals(tmp_path: Path) -> None:
    _, _, ep = _export_node()
    torch.export.save(ep, tmp_path / "plain.pt2")
    with pytest.raises(ValueError, match="records no fp32scope precision") as info:
        fp32scope.load_exported_program(tmp_path / "plain.pt2")
    assert "load_exported_program(..., precision=Fp32Precision(...))" in str(info.value)
    assert precision_of(fp32scope.load_exported_program(tmp_path / "plain.pt2", precision=PRECISION)) == PRECISION
    fp32scope.save_exported_program(ep, tmp_path / "node.pt2", PRECISION)
    with pytest.raises(ValueError, match="differs from the precision"):
        fp32scope.load_exported_program(tmp_path / "node.pt2", precision=Fp32Precision("medium"))
    make_unusual_state()
    state = _flags.save_raw_state()
    with pytest.raises(ValueError, match="reserved"):
        fp32scope.save_exported_program(
            ep, tmp_path / "x.pt2", PRECISION, extra_files={_export_record.EXTRA_FILE: "{}"}
        )
    with pytest.raises(TypeError, match="exported_program must be"):
        fp32scope.save_exported_program(Node(), tmp_path / "x.pt2", PRECISION)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="precision must be"):
        fp32scope.save_exported_program(ep, tmp_path / "x.pt2", "highest")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="f must be a path"):
        fp32scope.save_exported_program(ep, 3, PRECISION)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        fp32scope.load_exported_program(tmp_path / "missing.pt2")
    assert not (tmp_path / "x.pt2").exists()
    assert _flags.save_raw_state() == state


# -- caches (what the guide says about them) ----------------------------------------------


@pytest.mark.skipif(
    not _flags.HAS_NEW_API,
    reason=f"torch {TORCH_RELEASE} has no torch.backends.cuda.matmul.fp32_precision, which the key the guide "
    "describes (torch 2.13's) reads",
)
def test_fx_graph_cache_key_has_the_cublas_precision_not_the_cudnn_one() -> None:
    codecache = pytest.importorskip("torch._inductor.codecache")
    parameters = list(inspect.signature(codecache.compiled_fx_graph_hash).parameters)
    if parameters != ["gm", "example_inputs", "fx_kwargs", "inputs_to_check"]:
        pytest.skip(f"torch {TORCH_RELEASE}'s compiled_fx_graph_hash takes {parameters}: another cache key")

    class MatmulNode(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ x

    graph = torch.fx.symbolic_trace(MatmulNode())
    x = torch.randn(2, 2)

    def key(precision: Fp32Precision) -> str:
        set_default(precision)
        found: str = codecache.compiled_fx_graph_hash(graph, [x], {}, [])[0]
        return found

    assert key(Fp32Precision("highest", cudnn_allow_tf32=True)) == key(Fp32Precision("highest", cudnn_allow_tf32=False))
    assert key(Fp32Precision("highest", cudnn_allow_tf32=True)) != key(Fp32Precision("high", cudnn_allow_tf32=True))


# -- the API -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["aoti_compile_and_package", "aoti_load_package", "save_exported_program", "load_exported_program"]
)
def test_public_and_documented(name: str) -> None:
    assert name in fp32scope.__all__
    assert getattr(fp32scope, name).__doc__
    docs = ROOT / "docs"
    assert f"autofunction:: {name}(" in (docs / "api.rst").read_text()


def test_the_exported_guide_shows_the_record_keys() -> None:
    page = (ROOT / "docs" / "guide" / "exported.rst").read_text()
    for key, value in RECORD.items():
        assert key in page
        assert value in page
    assert _export_record.EXTRA_FILE in page
    assert "AOTIModelPackageLoader" in page
    assert "get_metadata()" in page
