"""A compiled-inside entry's graphs, each compiled by Inductor on its first run in the node's scope.

:class:`_Graph` (one traced graph, the layouts it is compiled for, and its runs: inputs and
outputs laid out as compiled for, no output aliasing an input or another output), the
helpers on layouts and aliasing it uses, and :func:`wants_inductor`: whether the graph being
traced goes to Inductor (where a region call may be compiled inside).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import torch

from fp32scope._compat import graph_callable
from fp32scope._flags import dynamo_exclude

_INDUCTOR_FILE: Final = "_inductor/compile_fx.py"


def wants_inductor() -> bool:
    """Whether the graph being traced goes to Inductor (its ``compile_fx`` is on the stack)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith(_INDUCTOR_FILE):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _Graph:
    """One of an entry's graphs, compiled on its first run inside the node's scope."""

    __slots__ = (
        "compiled",
        "copies",
        "example",
        "fast",
        "gm",
        "inputs",
        "is_backward",
        "is_inference",
        "lock",
        "outputs",
        "relayout",
        "strides",
    )

    def __init__(self, gm: torch.fx.GraphModule, *, is_backward: bool = False, is_inference: bool = False) -> None:
        self.gm = gm
        self.is_backward = is_backward
        self.is_inference = is_inference
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.example = [n.meta["val"] for n in placeholders]
        # The layouts it is compiled for: inputs and outputs are made to match at run time.
        self.inputs = [_layout(v) for v in self.example]
        self.outputs = [None if v is None else _layout(v.meta["val"]) for v in _output_nodes(gm)]
        self.strides = [None if layout is None else layout[1] for layout in self.inputs]
        self.compiled: Callable[[list[Any]], Sequence[Any]] | None = None
        self.lock = threading.Lock()
        # Set by the first run: the compiled code to call from then on, and the outputs it
        # lays out otherwise than declared or hands back aliasing an input or another
        # output. Both are properties of the generated code, the same at every call.
        self.fast: Callable[[list[Any]], Sequence[Any]] | None = None
        self.relayout: tuple[int, ...] = ()
        self.copies: tuple[int, ...] = ()

    def run(self, values: list[torch.Tensor]) -> list[Any]:
        """The graph's outputs for ``values``, laid out as declared, none aliasing an input or another output."""
        fast = self.fast
        if fast is None:
            return self._first_run(values)
        if [v.stride() for v in values] == self.strides:
            out = list(fast(list(values)))  # the compiled code empties the list it is given
        else:
            out = list(fast([_as_layout(v, layout) for v, layout in zip(values, self.inputs, strict=True)]))
        outputs = self.outputs
        for i in self.relayout:
            out[i] = _as_layout(out[i], outputs[i])
        for i in self.copies:
            out[i] = _copy(out[i])
        return out

    def _first_run(self, values: list[torch.Tensor]) -> list[Any]:
        compiled = self.compiled if self.compiled is not None else self._compile()
        args = [_as_layout(v, layout) for v, layout in zip(values, self.inputs, strict=True)]
        given = [*values, *args]  # an output aliasing either would alias the input at a later call
        out = list(compiled(args))
        relayout = tuple(
            i
            for i, (o, layout) in enumerate(zip(out, self.outputs, strict=True))
            if o is not None and layout is not None and o.stride() != layout[1]
        )
        for i in relayout:
            out[i] = _as_layout(out[i], self.outputs[i])
        copies = _aliased(out, given)
        for i in copies:
            out[i] = _copy(out[i])
        with self.lock:
            self.relayout, self.copies = relayout, copies
            self.fast = graph_callable(compiled)
        return out

    def _compile(self) -> Callable[[list[Any]], Sequence[Any]]:
        import torch._inductor.config
        from torch._inductor.compile_fx import compile_fx_inner

        with self.lock:
            if self.compiled is None:
                kwargs: dict[str, Any] = {"is_backward": self.is_backward}
                if self.is_inference:
                    kwargs["is_inference"] = True
                # No size assertions on its inputs: run() lays them out as compiled for.
                with torch._guards.tracing(None), torch._inductor.config.patch(size_asserts=False):
                    self.compiled = cast(
                        "Callable[[list[Any]], Sequence[Any]]", compile_fx_inner(self.gm, self.example, **kwargs)
                    )
            return self.compiled


def _layout(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(value.shape), tuple(value.stride())


def _as_layout(value: torch.Tensor, layout: tuple[tuple[int, ...], tuple[int, ...]] | None) -> torch.Tensor:
    # The compiled graph assumes the strides it was compiled for (compiled without its size
    # assertions, see _compile): an incoming gradient may be an expanded one, an output of
    # the compiled code laid out otherwise than the op's fake kernel declared.
    if layout is None or value.stride() == layout[1]:
        return value
    out = torch.empty_strided(layout[0], layout[1], dtype=value.dtype, device=value.device)
    out.copy_(value)
    return out


def _copy(value: torch.Tensor) -> torch.Tensor:
    # Laid out as the original (strides, gaps), which the op's fake kernel declared.
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).copy_(value)


def _aliased(outputs: list[Any], inputs: Sequence[torch.Tensor]) -> tuple[int, ...]:
    # An op's output may alias neither its inputs nor another output (AOTAutograd and
    # Inductor assume it): a compiled graph hands back an input, or one buffer as two views.
    seen = {t.untyped_storage()._cdata for t in inputs}
    found = []
    for i, o in enumerate(outputs):
        if o is None:
            continue
        storage = o.untyped_storage()._cdata
        if storage in seen:
            found.append(i)
        else:
            seen.add(storage)
    return tuple(found)


def _output_nodes(gm: torch.fx.GraphModule) -> list[Any]:
    return list(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])


dynamo_exclude.exclude(
    _aliased,
    _as_layout,
    _copy,
    _Graph.run,
    _Graph._first_run,
    _Graph._compile,
    graph_break=False,
)
