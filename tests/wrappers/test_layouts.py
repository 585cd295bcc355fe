"""A region op's arguments rebuilt by the code made for their layout, against torch's pytree.

The op's kernel rebuilds a call from its tensors and ints with :func:`layouts.builder`'s
code at every run; torch's ``tree_unflatten`` is what it must equal, value for value and
type for type, for every structure the pytree flattens.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree

from fp32scope._wrappers import layouts


class Pair(NamedTuple):
    first: Any
    second: Any


@dataclasses.dataclass
class Holder:
    value: Any
    other: Any


_pytree.register_pytree_node(
    Holder,
    lambda h: ([h.value, h.other], None),
    lambda values, _: Holder(*values),
)

_LEAVES = st.one_of(
    st.just("tensor"),
    st.just("int"),
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False, allow_subnormal=False),  # (none can be drawn once a loaded library set flush-to-zero)
    st.text(max_size=3),
    st.sampled_from([torch.float32, torch.bfloat16, torch.device("cpu")]),
)


def _trees(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.lists(inner, max_size=3).map(tuple),
            st.dictionaries(st.text(max_size=2), inner, max_size=3),
            st.dictionaries(st.integers(0, 3), inner, max_size=3).map(collections.OrderedDict),
            st.tuples(inner, inner).map(lambda t: Pair(*t)),
            st.tuples(inner, inner).map(lambda t: Holder(*t)),
        ),
        max_leaves=12,
    )


def _materialise(tree: Any) -> tuple[Any, list[torch.Tensor], list[int]]:
    """The tree with its "tensor" and "int" leaves made real, and those values in order."""
    tensors: list[torch.Tensor] = []
    ints: list[int] = []

    def leaf(value: Any) -> Any:
        if value == "tensor":
            tensors.append(torch.full((1,), float(len(tensors))))
            return tensors[-1]
        if value == "int":
            ints.append(100 + len(ints))
            return ints[-1]
        return value

    leaves, spec = _pytree.tree_flatten(tree)
    made = [leaf(v) if isinstance(v, str) else v for v in leaves]
    return _pytree.tree_unflatten(made, spec), tensors, ints


def _slots(values: list[Any], int_values: list[int]) -> tuple[tuple[Any, ...], Any, list[Any]]:
    leaves, spec = _pytree.tree_flatten(values)
    ints = {id(v) for v in int_values}
    slots = tuple(
        layouts.TENSOR if isinstance(v, torch.Tensor) else layouts.SYMINT if id(v) in ints else v for v in leaves
    )
    return slots, spec, leaves


def _same(built: Any, expected: Any) -> None:
    """Equal, type for type, with the very tensors in the tensors' places."""
    assert type(built) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert built is expected
    elif isinstance(expected, dict):
        assert list(built) == list(expected)  # key order too
        for key in expected:
            _same(built[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(built) == len(expected)
        for b, e in zip(built, expected, strict=True):
            _same(b, e)
    elif isinstance(expected, Holder):
        _same(built.value, expected.value)
        _same(built.other, expected.other)
    else:
        assert built == expected


@settings(max_examples=150, deadline=None)
@given(st.lists(_trees(_LEAVES), min_size=1, max_size=4))
def test_the_built_arguments_equal_torchs_unflatten(trees: list[Any]) -> None:
    values, tensors, ints = _materialise(trees)
    slots, spec, leaves = _slots(values, ints)
    build = layouts.builder(slots, spec)
    _same(build(tensors, ints), _pytree.tree_unflatten(leaves, spec))


def test_each_argument_one_leaf_is_built_without_a_spec() -> None:
    tensor = torch.ones(2)
    build = layouts.builder((layouts.TENSOR, 3, layouts.SYMINT, None), None)
    built = build([tensor], [7])
    assert built == [tensor, 3, 7, None]
    assert built[0] is tensor


def test_every_run_gets_containers_of_its_own() -> None:
    # A node that appends to a list argument must not change what the next run is given.
    slots, spec, _ = _slots([[torch.ones(1)], {"k": [1]}], [])
    build = layouts.builder(slots, spec)
    first = build([torch.ones(1)], [])
    first[0].append("added")
    first[1]["k"].append("added")
    second = build([torch.zeros(1)], [])
    assert len(second[0]) == 1
    assert second[1]["k"] == [1]
    assert second[0] is not first[0]
