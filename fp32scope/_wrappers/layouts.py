"""Argument layouts rebuilt by code made once per layout.

A region op's kernel rebuilds its node's call from the op's tensors and ints at every run:
tuples, lists, dicts and every container torch's pytree knows, with the layout's constants
in place. :func:`builder` makes, once per layout, one Python expression that builds it
(``[t[0], (c0, t[1]), {k0: n[0]}]``), since walking the structure with the pytree spec
at every call is most of what a call carrying a Hugging Face cache costs beyond its node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Final

import torch
from torch.utils import _pytree

from fp32scope._compat import treespec_children

__all__ = ["SYMINT", "TENSOR", "builder"]


class _TensorSlot:
    """Stands for "the op's next tensor" in an argument or output layout."""

    def __repr__(self) -> str:
        return "<tensor>"


class _SymIntSlot:
    """Stands for "the op's next integer": an int Dynamo made symbolic (it varies between calls)."""

    def __repr__(self) -> str:
        return "<int>"


TENSOR: Final = _TensorSlot()
SYMINT: Final = _SymIntSlot()

Builder = Callable[[list[torch.Tensor], list[int]], list[Any]]


class _Source:
    """The expression being written, and the names it reads."""

    def __init__(self, slots: tuple[Any, ...]) -> None:
        self.slots: Iterator[Any] = iter(slots)
        self.names: dict[str, Any] = {}
        self.tensors = 0
        self.ints = 0

    def name(self, value: Any) -> str:
        name = f"c{len(self.names)}"
        self.names[name] = value
        return name

    def leaf(self) -> str:
        slot = next(self.slots)
        if slot is TENSOR:
            self.tensors += 1
            return f"t[{self.tensors - 1}]"
        if slot is SYMINT:
            self.ints += 1
            return f"n[{self.ints - 1}]"
        return self.name(slot)

    def node(self, spec: Any) -> str:
        if spec.is_leaf():
            return self.leaf()
        children = [self.node(child) for child in treespec_children(spec)]
        if spec.type is tuple:
            return f"({', '.join(children)},)" if children else "()"
        if spec.type is list:
            return f"[{', '.join(children)}]"
        if spec.type is dict:
            keys = [self.name(key) for key in spec.context]
            return "{" + ", ".join(f"{k}: {v}" for k, v in zip(keys, children, strict=True)) + "}"
        # Named tuples, ordered dicts, dataclasses, a ModelOutput: as the pytree builds them.
        unflatten = self.name(_pytree.SUPPORTED_NODES[spec.type].unflatten_fn)
        return f"{unflatten}([{', '.join(children)}], {self.name(spec.context)})"


def builder(slots: tuple[Any, ...], spec: Any) -> Builder:
    """A function of the op's tensors and ints that returns the call's values, laid out as ``spec`` says.

    ``slots`` holds, per leaf, :data:`TENSOR`, :data:`SYMINT` or the constant; ``spec`` is
    the pytree spec of the list of the call's values, or None where each value is one leaf.
    """
    source = _Source(slots)
    body = f"[{', '.join(source.leaf() for _ in slots)}]" if spec is None else source.node(spec)
    code = f"def build(t, n):\n    return {body}\n"
    namespace = dict(source.names)
    exec(compile(code, "<fp32scope layout>", "exec"), namespace)  # noqa: S102  (code made above from names only)
    built: Builder = namespace["build"]
    return built
