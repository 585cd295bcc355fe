"""Bad input: a clear error naming the field, the value and what is allowed, before anything changes."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

import fp32scope
from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    fp32_precision_scope,
    node_fp32_precision,
    set_process_default,
    with_fp32_precision,
)
from fp32scope._flags import torch_flags as _flags
from fp32scope._flags.precision import MATMUL_PRECISIONS
from tests._support.releases import make_unusual_state


def fn() -> None:
    pass


ENTRY_POINTS = {
    "fp32_precision_scope": fp32_precision_scope,
    "set_process_default": set_process_default,
    "with_fp32_precision": with_fp32_precision,
    "Fp32ScopedModule": lambda p: Fp32ScopedModule(torch.nn.Linear(1, 1), p),
}


@pytest.fixture(params=sorted(ENTRY_POINTS))
def entry(request: pytest.FixtureRequest) -> Any:
    return ENTRY_POINTS[request.param]


@pytest.mark.parametrize(
    ("precision", "error", "fragments"),
    [
        (
            Fp32Precision("HIGH"),  # type: ignore[arg-type]
            ValueError,
            ["precision.matmul", "'HIGH'", "'highest', 'high', 'medium'", "lower case"],
        ),
        (Fp32Precision("fast"), ValueError, ["precision.matmul", "'fast'", "'highest', 'high', 'medium'"]),  # type: ignore[arg-type]
        (Fp32Precision("tf32"), ValueError, ["precision.matmul", "'tf32'"]),  # type: ignore[arg-type]
        (Fp32Precision(3), TypeError, ["precision.matmul", "3", "int", "'highest'"]),  # type: ignore[arg-type]
        (Fp32Precision(None, 1), TypeError, ["precision.cudnn_allow_tf32", "1", "int", "True, False or None"]),  # type: ignore[arg-type]
        (Fp32Precision("high", "yes"), TypeError, ["precision.cudnn_allow_tf32", "'yes'", "str"]),  # type: ignore[arg-type]
        (Fp32Precision(["high"]), TypeError, ["precision.matmul", "['high']", "list"]),  # type: ignore[arg-type]
        (("high", True), TypeError, ["precision", "Fp32Precision", "tuple"]),
        ("high", TypeError, ["precision", "'high'", "str", "Fp32Precision"]),
        ({"matmul": "high"}, TypeError, ["precision", "dict"]),
    ],
)
def test_bad_precision_is_refused_before_anything_changes(
    entry: Any, precision: object, error: type[Exception], fragments: list[str]
) -> None:
    make_unusual_state()  # to be left exactly as it is (a mixed state where torch allows one)
    before_readings, before_raw = _flags.read_all(), _flags.save_raw_state()
    with pytest.raises(error) as info:
        entry(precision)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message
    assert _flags.read_all() == before_readings
    assert _flags.save_raw_state() == before_raw


def test_numpy_like_bools_are_refused() -> None:
    # torch would take 0/1; a scope that silently took 0 for False is a mix-up waiting to happen.
    with pytest.raises(TypeError, match="cudnn_allow_tf32"):
        fp32_precision_scope(Fp32Precision("high", 0))  # type: ignore[arg-type]


TORCH_TAKES_HIGH = """
import warnings
import torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.set_float32_matmul_precision("HIGH")
print(torch.get_float32_matmul_precision(), any("HIGH is not one of" in str(w.message) for w in caught))
"""


def test_torch_itself_only_warns_where_we_refuse() -> None:
    # torch's call runs in a child process: on torch 2.4 (wheels built with the pre-C++11
    # string ABI) it also corrupts the C++ runtime's shared empty string, after which e.g.
    # the first import of torch._dynamo fails with "could not parse dispatch key: high".
    result = subprocess.run(  # noqa: S603
        [sys.executable, "-c", TORCH_TAKES_HIGH], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["highest", "True"]  # only a warning; the state is unchanged
    with pytest.raises(ValueError, match="lower case: 'high'"):
        set_process_default(Fp32Precision("HIGH"))  # type: ignore[arg-type]


class Declares(torch.nn.Module):
    def __init__(self, matmul: object = None, cudnn: object = None) -> None:
        super().__init__()
        if matmul is not None:
            self.float32_matmul_precision = matmul
        if cudnn is not None:
            self.cudnn_allow_tf32 = cudnn


@pytest.mark.parametrize(
    ("module", "error", "fragments"),
    [
        (Declares("fp32"), ValueError, ["node 'head'", "float32_matmul_precision", "'fp32'", "'highest'"]),
        (Declares("Highest"), ValueError, ["node 'head'", "use lower case: 'highest'"]),
        (Declares(None, "no"), TypeError, ["node 'head'", "cudnn_allow_tf32", "'no'", "True, False or None"]),
        (Declares(32), TypeError, ["node 'head'", "float32_matmul_precision", "32", "int"]),
    ],
)
def test_node_declaration_errors_name_the_node(
    module: torch.nn.Module, error: type[Exception], fragments: list[str]
) -> None:
    with pytest.raises(error) as info:
        node_fp32_precision("head", module)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_node_name_must_be_a_str() -> None:
    with pytest.raises(TypeError, match="node_name must be a str; got 3"):
        node_fp32_precision(3, torch.nn.Linear(1, 1))  # type: ignore[arg-type]


def test_wrapper_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="name must be a str or None; got 5"):
        with_fp32_precision(Fp32Precision("high"), name=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must decorate a callable; got 3"):
        with_fp32_precision(Fp32Precision("high"))(3)  # type: ignore[type-var]
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        Fp32ScopedModule(fn, Fp32Precision("high"))
    with pytest.raises(TypeError, match="name must be a str or None"):
        Fp32ScopedModule(torch.nn.Linear(1, 1), Fp32Precision("high"), name=1)  # type: ignore[arg-type]


def test_public_names_are_exported_and_documented() -> None:
    for name in fp32scope.__all__:
        obj = getattr(fp32scope, name)
        assert obj.__doc__, name
    # Every public object that lives in the package is exported (module-level helpers such
    # as TYPE_CHECKING or importlib are not fp32scope's own).
    own = {
        name
        for name in dir(fp32scope)
        if name.isidentifier()
        and not name.startswith("_")
        and getattr(getattr(fp32scope, name), "__module__", "").startswith("fp32scope")
    }
    assert own == set(fp32scope.__all__)
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        _ = fp32scope.missing


@pytest.mark.parametrize(
    ("word", "meant"),
    [
        ("ieee", "highest"),
        ("fp32", "highest"),
        ("float32", "highest"),
        ("tf32", "high"),
        ("TF32", "high"),
        ("bf16", "medium"),
        ("bfloat16", "medium"),
    ],
)
def test_the_per_backend_apis_words_get_a_hint(entry: Any, word: str, meant: str) -> None:
    before = _flags.save_raw_state()
    allowed = ", ".join(map(repr, MATMUL_PRECISIONS))  # 'bfx9' too where torch has it
    with pytest.raises(ValueError, match=f"must be one of {allowed} or None") as caught:
        entry(Fp32Precision(word))  # type: ignore[arg-type]
    assert f"for {word!r} write {meant!r}" in str(caught.value)
    assert "set_float32_matmul_precision" in str(caught.value)
    assert _flags.save_raw_state() == before


def test_a_node_declaring_the_per_backend_words_gets_the_hint() -> None:
    class Head(torch.nn.Linear):
        float32_matmul_precision = "ieee"

    with pytest.raises(ValueError, match="of node 'head' must be one of .*for 'ieee' write 'highest'"):
        node_fp32_precision("head", Head(1, 1))


def test_string_none_and_cudnn_words_get_a_hint() -> None:
    with pytest.raises(ValueError, match=r"got 'none' \(to leave the flag as it is, pass None"):
        fp32_precision_scope(Fp32Precision("none"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got 'tf32' of type str \(for 'tf32' write True"):
        fp32_precision_scope(Fp32Precision(None, "tf32"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got 'ieee' of type str \(for 'ieee' write False"):
        fp32_precision_scope(Fp32Precision(None, "ieee"))  # type: ignore[arg-type]


def test_exceptions_and_warnings_show_as_the_package_names_them() -> None:
    classes = [getattr(fp32scope, n) for n in fp32scope.__all__ if n.endswith(("Error", "Warning"))]
    assert classes, "the package has public exception and warning classes"
    for cls in classes:
        assert issubclass(cls, (Exception, Warning))
        assert cls.__module__ == "fp32scope", cls
    # As a traceback's last line shows it.
    done = subprocess.run(
        [sys.executable, "-c", "import fp32scope; raise fp32scope.Fp32ScopeError('x')"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.stderr.rstrip().splitlines()[-1] == "fp32scope.Fp32ScopeError: x"
