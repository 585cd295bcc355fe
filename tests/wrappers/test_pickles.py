"""Pickles name the public home (``fp32scope.<name>``), and pickles made by fp32scope 0.1 still load."""

from __future__ import annotations

import inspect
import io
import pickle
import pickletools
import warnings
from typing import cast

import pytest
import torch

import fp32scope
from fp32scope import Fp32Precision, Fp32ScopedModule, precision_of
from tests._support import pickles

PUBLIC_CLASSES = sorted(n for n in fp32scope.__all__ if inspect.isclass(getattr(fp32scope, n)))


def globals_named(data: bytes) -> set[str]:
    """The ``module`` of every global the pickle names, for the modules of this package."""
    out = io.StringIO()
    pickletools.dis(data, out)
    words = [w.strip("'\"") for line in out.getvalue().splitlines() for w in line.split()]
    return {w for w in words if w == "fp32scope" or w.startswith("fp32scope.")}


def test_every_public_class_names_the_package_as_its_module() -> None:
    assert PUBLIC_CLASSES  # the filter found the classes
    assert {n: getattr(fp32scope, n).__module__ for n in PUBLIC_CLASSES} == dict.fromkeys(PUBLIC_CLASSES, "fp32scope")


def scoped() -> Fp32ScopedModule:
    return Fp32ScopedModule(torch.nn.Linear(2, 2), Fp32Precision("highest", cudnn_allow_tf32=False), name="head")


@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("which", ["precision", "event", "trace", "error", "proxy"])
def test_public_objects_pickle_under_the_package(which: str, protocol: int) -> None:
    obj = scoped() if which == "proxy" else pickles.objects()[which]
    data = pickle.dumps(obj, protocol=protocol)
    assert globals_named(data) == {"fp32scope"}
    back: object = pickle.loads(data)  # noqa: S301  (our own bytes)
    assert type(back) is type(obj)
    if which == "proxy":
        assert precision_of(back) == precision_of(obj)
    elif isinstance(obj, Exception):
        assert isinstance(back, Exception)
        assert back.args == obj.args
    else:
        assert back == obj


def test_torch_save_of_a_scoped_model_names_the_package() -> None:
    buffer = io.BytesIO()
    torch.save(torch.nn.Sequential(cast("torch.nn.Module", scoped())), buffer)
    assert b"fp32scope._" not in buffer.getvalue()
    assert b"fp32scope" in buffer.getvalue()


def test_a_proxy_still_shows_the_wrapped_modules_module() -> None:
    assert scoped().__module__ == torch.nn.Linear.__module__


def test_the_fixture_pickle_of_fp32scope_0_1_loads() -> None:
    data = pickles.OBJECTS.read_bytes()
    assert "fp32scope._precision" in globals_named(data)  # made with the private paths
    loaded = pickle.loads(data)  # noqa: S301  (the repository's own fixture)
    made = pickles.objects()
    error, made_error = loaded.pop("error"), made.pop("error")
    assert isinstance(error, Exception)
    assert isinstance(made_error, Exception)
    assert (type(error), error.args) == (type(made_error), made_error.args)  # exceptions compare by identity
    assert loaded == made


def test_the_fixture_torch_save_of_fp32scope_0_1_loads_and_runs_as_made() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.4's weights_only notice
        loaded = cast("torch.nn.Sequential", torch.load(pickles.MODEL, weights_only=False))
    made = pickles.model()
    head: object = loaded[1]
    assert type(head) is Fp32ScopedModule
    assert precision_of(head) == precision_of(made[1])
    assert head._self_name == "head"
    x = torch.ones(1, 3)
    torch.testing.assert_close(loaded(x), made(x), rtol=0, atol=0)
