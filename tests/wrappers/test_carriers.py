"""A plain object's round trip through the carriers, without a compile: flatten, rebuild, change, write back.

What a region does with an object argument, run eagerly: :func:`carriers.flatten` describes
it (its ``__dict__``: tensors, constants, tuples, lists, dicts, nested objects),
:func:`carriers.rebuild` makes a fresh object of the same classes around the same tensors,
the node changes that one, :func:`carriers.changes` finds what it changed by path, and
:func:`carriers.write_back` sets it on the caller's object. The property: whatever the
object and whatever the node changes, the caller's object ends as the node left the
rebuilt one, and an object the node did not change is left as it was (Hypothesis draws
both).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp32scope._wrappers import carriers

NAMES = ("a", "b", "c", "d")


class Box:
    """A plain object: its state is its __dict__."""

    def __init__(self, **state: Any) -> None:
        self.__dict__.update(state)


_constants = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(-2, 2, allow_nan=False, allow_subnormal=False, width=32),  # (none once a library set flush-to-zero)
    st.sampled_from(["x", "y", ""]),
)
_tensors = st.integers(1, 3).map(lambda n: torch.arange(n, dtype=torch.float32))  # a new tensor object each draw
_values = st.recursive(
    st.one_of(_constants, _tensors),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from(NAMES), inner, max_size=3),
        st.dictionaries(st.sampled_from(NAMES), inner, max_size=3).map(lambda state: Box(**state)),
    ),
    max_leaves=8,
)
boxes = st.dictionaries(st.sampled_from(NAMES), _values, max_size=4).map(lambda state: Box(**state))


def _same(got: Any, want: Any, where: str = "box") -> None:
    """Equal state: tensors are the same tensor objects, nested objects the same class with equal state."""
    if isinstance(want, torch.Tensor):
        assert got is want, where
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), where
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            _same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, Box):
        assert type(got) is Box, where
        assert got is not want, where  # rebuilt, not shared
        _same(vars(got), vars(want), where)
    else:
        assert type(got) is type(want), where
        assert got == want, where


def _owners(box: Box) -> list[Box]:
    """The box and every box nested in it (through containers too)."""
    found = [box]
    stack: list[Any] = list(vars(box).values())
    while stack:
        item = stack.pop()
        if isinstance(item, Box):
            found.append(item)
            stack.extend(vars(item).values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


@st.composite
def _edits(draw: st.DrawFn, box: Box) -> None:
    """Change the rebuilt ``box`` as a node could: set, rebind, add, count, edit a dict or a list."""
    for _ in range(draw(st.integers(1, 4))):
        owner = draw(st.sampled_from(_owners(box)))
        state = vars(owner)
        name = draw(st.sampled_from(NAMES))
        kind = draw(st.sampled_from(["set", "count", "dict", "list"]))
        current = state.get(name)
        if kind == "count" and type(current) is int:
            state[name] = current + draw(st.integers(1, 3))
        elif kind == "dict" and isinstance(current, dict):
            current[draw(st.sampled_from(NAMES))] = draw(st.one_of(_constants, _tensors))
        elif kind == "list" and isinstance(current, list) and current and not isinstance(current[0], (Box, list)):
            current[draw(st.integers(0, len(current) - 1))] = draw(st.one_of(_constants, _tensors))
        else:
            state[name] = draw(st.one_of(_constants, _tensors))


@settings(max_examples=150)
@given(box=boxes, data=st.data())
def test_what_a_node_changes_on_a_rebuilt_object_ends_on_the_callers(box: Box, data: st.DataObject) -> None:
    before = copy.copy(vars(box))
    marker = carriers.flatten(box)
    rebuilt = carriers.rebuild(marker)
    _same(vars(rebuilt), vars(box))  # the same state, around the same tensors
    data.draw(_edits(rebuilt))
    found, tensors = carriers.changes(marker, rebuilt, 0)
    assert all(t is carriers.tensors_of(rebuilt, found)[i] for i, t in enumerate(tensors))
    carriers.write_back(box, found, tensors)
    _same(vars(box), vars(rebuilt))
    assert list(vars(box)) == list(vars(rebuilt))  # attributes added in the node's order
    assert set(before) <= set(vars(box))


@given(box=boxes)
def test_an_object_the_node_leaves_alone_has_no_changes(box: Box) -> None:
    marker = carriers.flatten(box)
    rebuilt = carriers.rebuild(marker)
    found, tensors = carriers.changes(marker, rebuilt, 0)
    assert found == ()
    assert tensors == []
