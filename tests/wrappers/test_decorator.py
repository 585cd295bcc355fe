"""with_fp32_precision: scoped calls, metadata and signature kept, binding, refusals."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Iterator

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from fp32scope import Fp32Precision, Fp32ScopedModule, precision_of, with_fp32_precision
from fp32scope._flags import torch_flags as _flags
from tests._support.common import FULL, BoomError


def current() -> tuple[str, bool]:
    return torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32


@pytest.fixture(autouse=True)
def default_high() -> None:
    torch.set_float32_matmul_precision("high")


def test_function_calls_run_inside_the_scope_and_keep_their_metadata() -> None:
    def head(x: int, *, scale: float = 2.0) -> tuple[str, bool]:
        """Docstring of head."""
        return current()

    wrapped = with_fp32_precision(FULL)(head)
    assert wrapped(1) == ("highest", False)
    assert current() == ("high", True)
    assert wrapped.__wrapped__ is head  # type: ignore[attr-defined]
    assert wrapped.__name__ == "head"
    assert wrapped.__qualname__ == head.__qualname__
    assert wrapped.__doc__ == "Docstring of head."
    assert inspect.signature(wrapped) == inspect.signature(head)
    assert precision_of(wrapped) == FULL


def test_methods_bind() -> None:
    class Node:
        @with_fp32_precision(Fp32Precision("medium"))
        def run(self, x: int) -> tuple[object, int, str]:
            return self, x, torch.get_float32_matmul_precision()

    node = Node()
    assert node.run(3) == (node, 3, "medium")
    assert Node.run(node, 4) == (node, 4, "medium")
    assert list(inspect.signature(node.run).parameters) == ["x"]


def test_callable_objects_and_bound_methods() -> None:
    class Callable:
        def __call__(self, x: int) -> str:
            return torch.get_float32_matmul_precision()

        def method(self) -> str:
            return torch.get_float32_matmul_precision()

    obj = Callable()
    assert with_fp32_precision(FULL)(obj)(1) == "highest"
    assert with_fp32_precision(FULL)(obj.method)() == "highest"


def test_a_module_becomes_a_scoped_proxy() -> None:
    module = torch.nn.Linear(2, 2)
    wrapped = with_fp32_precision(FULL, name="head")(module)
    assert isinstance(wrapped, Fp32ScopedModule)
    assert wrapped.__wrapped__ is module
    assert precision_of(wrapped) == FULL
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert isinstance(with_fp32_precision(FULL)(compiled), Fp32ScopedModule)


@pytest.mark.parametrize("precision", [None, Fp32Precision()])
def test_none_returns_the_target_unchanged(precision: Fp32Precision | None) -> None:
    def fn() -> None:
        pass

    module = torch.nn.Linear(1, 1)
    assert with_fp32_precision(precision)(fn) is fn
    assert with_fp32_precision(precision)(module) is module


def test_bad_precision_fails_when_the_decorator_is_made() -> None:
    with pytest.raises(ValueError, match="precision.matmul"):
        with_fp32_precision(Fp32Precision("full"))  # type: ignore[arg-type]


async def coroutine() -> None:
    await asyncio.sleep(0)


async def async_generator() -> AsyncIterator[int]:
    yield 1


def generator() -> Iterator[int]:
    yield 1


@pytest.mark.parametrize(
    ("target", "kind"),
    [
        (coroutine, "a coroutine function"),
        (async_generator, "an async generator function"),
        (generator, "a generator function"),
    ],
)
def test_suspending_functions_are_refused_at_decoration_time(target: object, kind: str) -> None:
    with pytest.raises(TypeError) as info:
        with_fp32_precision(FULL)(target)  # type: ignore[type-var]
    message = str(info.value)
    assert kind in message
    assert target.__qualname__ in message  # type: ignore[attr-defined]
    assert "process-wide" in message
    assert "await or yield" in message


def test_refusal_sees_through_wrappers_and_names_the_given_name() -> None:
    @functools.wraps(coroutine)
    def inner() -> object:
        return coroutine()

    assert inner is not coroutine
    with pytest.raises(TypeError, match="'decode'"):
        with_fp32_precision(FULL, name="decode")(inner)


def test_the_name_appears_in_warnings() -> None:
    @with_fp32_precision(FULL, name="decode-step")
    def flips() -> None:
        torch.set_float32_matmul_precision("medium")

    with pytest.warns(Warning, match="around 'decode-step'") as record:
        flips()
    assert record[0].filename == __file__  # points at the caller of the wrapper
    assert current() == ("high", True)


calls = st.lists(
    st.tuples(
        st.sampled_from(["highest", "high", "medium", None]),
        st.sampled_from([True, False, None]),
        st.booleans(),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(
    calls,
    st.sampled_from(["highest", "high", "medium"]),
    st.booleans(),
)
def test_flags_after_each_call_equal_those_before_it(
    sequence: list[tuple[str | None, bool | None, bool]], default: str, cudnn: bool
) -> None:
    torch.set_float32_matmul_precision(default)
    torch.backends.cudnn.allow_tf32 = cudnn
    for matmul, allow, raises in sequence:
        precision = Fp32Precision(matmul, allow)  # type: ignore[arg-type]

        @with_fp32_precision(precision)
        def node(raises: bool = raises) -> tuple[str, bool]:
            seen = current()
            if raises:
                raise BoomError
            return seen

        before, raw = _flags.read_all(), _flags.save_raw_state()
        try:
            seen = node()
        except BoomError:
            assert raises
        else:
            assert not raises
            assert seen == (
                matmul or before[_flags.LEGACY_MATMUL],
                before[_flags.LEGACY_CUDNN] if allow is None else allow,
            )
        assert _flags.read_all() == before
        assert _flags.save_raw_state() == raw
