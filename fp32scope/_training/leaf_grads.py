"""Accumulating the caller's leaves inside a scoped call's nested backward.

The boundary node's edges (see ``_backward``) lead to the leaves of the call's subgraph:
the originals of argument aliases, and the caller's own leaves (parameters, leaf
arguments). A leaf's ``AccumulateGrad`` node is one object, in the call's subgraph and in
the caller's graph alike. Code inside the subgraph may read a parameter's ``.grad`` right
after its ``AccumulateGrad`` would have run in plain torch (FSDP2's post-backward does, then
reduce-scatters it), so each leaf whose ``AccumulateGrad`` the caller's backward will run
(``torch._C._will_engine_execute_node``) is accumulated **the moment the nested engine
reaches it**, and the boundary hands ``None`` back for it. The caller's engine still runs
that node with the ``None``: its node hooks (DDP's reducer, FSDP1's post-backward) fire
there, once, with ``.grad`` set, and nothing more is accumulated.

Why not let the nested engine run the leaves' ``AccumulateGrad`` nodes itself
(``accumulate_grad=True`` with ``inputs=`` restricted)? Their node hooks would then fire in
both engines: DDP's reducer, a C++ post hook that Python cannot mute, fails on the second
call ("Expected to mark a variable ready only once"). So the nested engine captures the
leaves (``accumulate_grad=False``) and a temporary tensor hook, the last one on the leaf,
accumulates what it is handed, as ``AccumulateGrad`` would:

* ``.grad`` unset and the gradient stealable by torch's rules (dense, obeying the gradient
  layout contract, referenced by nothing but the engine): ``.grad`` becomes the engine's
  buffer itself (detached, as torch does), no copy. The reference counts an unshared
  gradient shows inside the hook are measured once per process (:func:`_unshared_counts`),
  so that the test is torch's own: a gradient that anything else holds (another edge, a
  hook that kept it) is not stolen;
* otherwise the leaf's own ``AccumulateGrad`` node is called from Python (``node(grad)``):
  an in-place add into an existing ``.grad``, or torch's own copy where torch copies too.
  (A leaf with tensor hooks of its own is also accumulated this way, with a copy where
  ``.grad`` is unset: a hook may hand on a tensor whose references cannot be told apart
  from the engine's.)

Each kind of hook still fires once, as unwrapped:

* tensor hooks (``leaf.register_hook``): in the nested engine, on the real gradient, before
  it is accumulated; the caller's engine then calls them with ``None``, which
  :class:`_SkipNone` passes over;
* post-accumulate-grad hooks: where the caller's engine fires them for a ``None`` gradient
  (torch 2.13), not in the nested engine, so that they fire there, once, after ``.grad``
  is final; elsewhere (torch 2.4) as the nested engine accumulates
  (:func:`outer_fires_post_accumulate_hooks`, probed once per process);
* ``AccumulateGrad`` node hooks: only the caller's engine runs them.

A leaf the caller captures instead (``torch.autograd.grad`` with it among the inputs:
``_will_engine_execute_node`` raises) has its gradient handed back to the caller's graph,
its tensor hooks muted in the nested engine (the caller's capture runs them). A leaf the
caller's backward does not need is left out.

Boundaries nest (a scoped node inside a scoped node): the innermost running boundary sees
its caller, the enclosing boundary's engine, capture the leaves that boundary accumulates.
A stack of those sets tells it: it then lets the enclosing boundary's hook, still on the
leaf, accumulate as its own engine reaches the leaf, so that code inside it sees ``.grad``
too, and hands ``None`` on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FunctionType
from typing import Any, Final

import torch
from torch.utils.hooks import RemovableHandle

from fp32scope._compat import ENGINE_RUN_BACKWARD
from fp32scope._flags import dynamo_exclude

__all__ = [
    "ACCUMULATE",
    "CAPTURE",
    "LEAVE_OUT",
    "LeafAccumulation",
    "engine_grad",
    "mute_tensor_hooks",
    "outer_fires_post_accumulate_hooks",
    "unmute",
]

#: How the nested engine treats a leaf of the call's subgraph (see :func:`leaf_role`).
CAPTURE: Final = 1  # its gradient goes back through the boundary
ACCUMULATE: Final = 2  # accumulated into .grad as the nested engine reaches it; None goes back
LEAVE_OUT: Final = 0  # the caller's backward does not need it: not an engine input

_run_engine: Callable[..., Any] | None = ENGINE_RUN_BACKWARD


def engine_grad(
    outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], *, keep: bool
) -> Any:
    """The gradients of ``outputs`` for ``inputs`` (None where unreached), as autograd.grad computes them."""
    # The gradients come from autograd itself (right shapes, dtypes and devices), so
    # torch.autograd.grad's checks and conversions (a quarter of a small node's backward)
    # are skipped. keep: retain_graph as the caller's backward has it; allow_unused: a
    # leaf may get no gradient.
    if _run_engine is None:  # pragma: no cover
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=keep, allow_unused=True)
    return _run_engine(outputs, grads, keep, False, inputs, True, False)


_will_execute = torch._C._will_engine_execute_node
_getrefcount = sys.getrefcount
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided


class _SkipNone:
    """A tensor hook of the caller's that the boundary's None does not reach (see above)."""

    __slots__ = ("hook",)

    def __init__(self, hook: Callable[[torch.Tensor], Any]) -> None:
        self.hook = hook

    def __call__(self, grad: torch.Tensor | None) -> Any:
        return None if grad is None else self.hook(grad)


class _NoneToLeaf(torch.autograd.Function):
    """Hands None back to its leaf, as the boundary does for a gradient accumulated already."""

    @staticmethod
    def forward(_ctx: Any, leaf: torch.Tensor) -> torch.Tensor:
        return leaf.detach() * 1

    @staticmethod
    def backward(_ctx: Any, _grad: torch.Tensor) -> None:
        return None


_outer_fires_post_hooks: list[bool] = []


def outer_fires_post_accumulate_hooks() -> bool:
    """Whether the engine runs a leaf's post-accumulate-grad hooks when its gradient is None.

    torch 2.13 does (the caller's engine, running the leaf's AccumulateGrad after the
    boundary handed it None, fires them with .grad as the nested engine left it); torch 2.4
    does not. Found out once, by trying it, so that either way they fire exactly once.
    """
    if not _outer_fires_post_hooks:
        leaf = torch.zeros(1, requires_grad=True)
        fired: list[bool] = []
        leaf.register_post_accumulate_grad_hook(lambda _: fired.append(True))  # type: ignore[no-untyped-call]
        with torch.enable_grad():  # (called from inside a backward, where grad mode is off)
            out = _NoneToLeaf.apply(leaf) + torch.zeros(1, requires_grad=True)  # type: ignore[no-untyped-call]
            torch.autograd.backward(out.sum())
        _outer_fires_post_hooks.append(bool(fired))
    return _outer_fires_post_hooks[0]


def _obeys_layout_contract(grad: torch.Tensor, leaf: torch.Tensor) -> bool:
    # torch's utils::obeys_layout_contract for a dense leaf (the only kind stolen here):
    # strides equal the leaf's wherever a size is not 1, and no stride 0 where it is.
    grad_strides = grad.stride()
    contiguous = leaf.is_contiguous()
    if contiguous and grad_strides == leaf.stride() and 0 not in grad_strides:
        return True  # the usual case, at once
    if not contiguous and not _non_overlapping_and_dense(leaf):
        return grad.is_contiguous()
    for size, grad_stride, leaf_stride in zip(grad.shape, grad_strides, leaf.stride(), strict=True):
        if size != 1:
            if grad_stride != leaf_stride:
                return False
        elif grad_stride == 0:
            return False
    return True


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    # A permutation of a contiguous tensor (channels_last and the like), as torch decides it.
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


# The (use count, Python reference count) an unshared gradient shows in the accumulating
# hook: measured once (None until then; () where stealing is off: a torch whose counts
# could not be measured).
_unshared: list[tuple[int, int] | tuple[()]] = []


def _accumulate_now(
    node: Any, leaf: torch.Tensor, *, may_steal: bool, probe: list[tuple[int, int]] | None = None
) -> Callable[[torch.Tensor | None], None]:
    """The hook that accumulates one leaf's gradient the moment the nested engine reaches it.

    ``may_steal``: the hook is the leaf's only one, so the gradient it gets is the
    engine's own tensor (another hook may hand on a tensor of its own, whose reference
    counts differ). ``probe`` (for :func:`_unshared_counts` only) collects the counts.
    """

    def accumulate(grad: torch.Tensor | None) -> None:
        if grad is None:  # a scoped node inside this one accumulated it already
            return
        # Read first, in this frame, so that the probe measures what every call sees.
        counts = (grad._use_count(), _getrefcount(grad))  # type: ignore[attr-defined]
        if probe is not None:
            probe.append(counts)
            return
        if (
            may_steal
            and leaf.grad is None
            and counts == (_unshared[0] if _unshared else _unshared_counts())
            and type(grad) is _Tensor
            and (type(leaf) is _Tensor or isinstance(leaf, _Parameter))
            and grad.layout is _strided
            and not grad.requires_grad
            and _obeys_layout_contract(grad, leaf)
        ):
            # What AccumulateGrad does with a stealable gradient: .grad is its buffer.
            leaf.grad = grad.detach()
            if not outer_fires_post_accumulate_hooks():
                _fire_post_accumulate_hooks(leaf)
            return
        post = getattr(leaf, "_post_accumulate_grad_hooks", None)
        if not post or not outer_fires_post_accumulate_hooks():
            node(grad)
            return
        saved = list(post.items())
        post.clear()
        try:
            node(grad)
        finally:
            post.update(saved)

    return accumulate


def _fire_post_accumulate_hooks(leaf: torch.Tensor) -> None:
    # As AccumulateGrad does after accumulating, where the caller's engine will not.
    hooks = getattr(leaf, "_post_accumulate_grad_hooks", None)
    for hook in list(hooks.values()) if hooks else ():
        if hook(leaf) is not None:
            msg = "Tensor post accumulate grad hooks should return None."
            raise RuntimeError(msg)


def _unshared_counts() -> tuple[int, int] | tuple[()]:
    """The counts a gradient that only the engine holds shows in the accumulating hook.

    Measured once per process, through the same hook and the same engine call as a
    scoped backward's; a torch whose two probes disagree gets () and no stealing.
    """
    if not _unshared:
        seen: list[tuple[int, int]] = []
        leaf = torch.zeros(4, 4, requires_grad=True)
        with torch.enable_grad():
            for out in (leaf * 2, leaf.exp()):
                hook = _accumulate_now(None, leaf, may_steal=True, probe=seen)
                handle = leaf.register_hook(hook)  # type: ignore[no-untyped-call]
                try:
                    engine_grad((out,), (leaf,), (torch.ones_like(out),), keep=False)
                finally:
                    handle.remove()
        _unshared.append(seen[0] if len(seen) == 2 and seen[0] == seen[1] else ())
    return _unshared[0]


def _mute(hooks: Any, muted: list[tuple[Any, list[Any]]]) -> None:
    muted.append((hooks, list(hooks.items())))
    hooks.clear()


def mute_tensor_hooks(inputs: list[torch.Tensor], nodes: list[Any]) -> list[tuple[Any, list[Any]]]:
    """Clear the tensor hooks of the caller's leaves among ``inputs``; :func:`unmute` restores them."""
    muted: list[tuple[Any, list[Any]]] = []
    for leaf, node in zip(inputs, nodes, strict=True):
        hooks = leaf._backward_hooks if node is not None else None
        if hooks:
            _mute(hooks, muted)
    return muted


def unmute(muted: list[tuple[Any, list[Any]]]) -> None:
    """Put back the hooks :func:`mute_tensor_hooks` (or a :class:`LeafAccumulation`) cleared."""
    for hooks, items in muted:
        hooks.update(items)


# The AccumulateGrad nodes each running boundary accumulates into as its engine reaches
# them, innermost last (see the module docstring).
_accumulating: list[set[Any]] = []
_NOTHING: frozenset[Any] = frozenset()


def leaf_role(node: Any, enclosing: set[Any] | frozenset[Any]) -> int:
    """How the nested engine treats one of the caller's leaves: CAPTURE, ACCUMULATE or LEAVE_OUT.

    ``node`` is the leaf's AccumulateGrad node; ``enclosing`` the nodes the enclosing
    boundary accumulates.
    """
    try:
        will_run = _will_execute(node)
    except RuntimeError:  # the caller captures this leaf's gradient (autograd.grad, or a boundary)
        # A leaf the enclosing boundary accumulates: its hook is on the leaf still and
        # fires as this engine reaches the leaf.
        return ACCUMULATE if node in enclosing else CAPTURE
    return ACCUMULATE if will_run else LEAVE_OUT


class LeafAccumulation:
    r"""One scoped backward's leaves: which the nested engine takes in, and their hooks.

    Made right before the nested engine call, :meth:`close`\ d right after it (also on
    an error), which removes the temporary hooks and puts muted ones back.
    """

    __slots__ = ("_accumulating", "_added", "_muted", "_positions", "engine_inputs")

    def __init__(self, inputs: list[torch.Tensor], nodes: list[Any]) -> None:
        self.engine_inputs: list[torch.Tensor] = []
        # For each engine input, its boundary position, or -1: accumulated now.
        self._positions: list[int] = []
        self._added: list[tuple[Any, int]] = []  # (hook dict, key) of each temporary hook
        self._muted: list[tuple[Any, list[Any]]] = []
        enclosing = _accumulating[-1] if _accumulating else _NOTHING
        accumulating: set[Any] = set()
        self._accumulating = accumulating
        _accumulating.append(accumulating)
        try:
            for i, (leaf, node) in enumerate(zip(inputs, nodes, strict=True)):
                # An argument's alias (node None): its gradient continues in the caller's graph.
                role = CAPTURE if node is None else leaf_role(node, enclosing)
                if role == LEAVE_OUT:
                    continue
                self.engine_inputs.append(leaf)
                if role == CAPTURE:
                    self._positions.append(i)
                    hooks = leaf._backward_hooks if node is not None else None
                    if hooks:  # the caller's capture runs them
                        _mute(hooks, self._muted)
                    continue
                self._positions.append(-1)
                accumulating.add(node)
                if node not in enclosing:
                    self._add_accumulating_hook(leaf, node)
        except BaseException:
            self.close()
            raise

    def _add_accumulating_hook(self, leaf: torch.Tensor, node: Any) -> None:
        hooks = leaf._backward_hooks
        if hooks:
            for key, hook in list(hooks.items()):
                if not isinstance(hook, _SkipNone):
                    hooks[key] = _SkipNone(hook)
        hook = _accumulate_now(node, leaf, may_steal=not hooks)
        if hooks is None:  # the leaf's first tensor hook: torch sets up the dict
            handle = leaf.register_hook(hook)  # type: ignore[no-untyped-call]
            self._added.append((leaf._backward_hooks, handle.id))
            return
        # The dict torch calls is the leaf's: a new key there is a new hook, called last.
        key = _next_key()
        hooks[key] = hook
        self._added.append((hooks, key))

    def close(self) -> None:
        """Remove the temporary hooks, put muted ones back, leave the stack."""
        if _accumulating and _accumulating[-1] is self._accumulating:
            _accumulating.pop()
        for hooks, key in self._added:
            hooks.pop(key, None)
        self._added = []
        unmute(self._muted)
        self._muted = []

    def for_boundary(self, computed: tuple[torch.Tensor | None, ...], size: int) -> list[torch.Tensor | None]:
        """The boundary's gradients: the captured ones in place, None for the rest."""
        result: list[torch.Tensor | None] = [None] * size
        for position, grad in zip(self._positions, computed, strict=True):
            if position >= 0:
                result[position] = grad
        return result


def _next_key() -> int:
    # torch.utils.hooks.RemovableHandle's ids: one counter for every hook dict, so that a
    # key added here never meets a handle's of torch's.
    key: int = RemovableHandle.next_id
    RemovableHandle.next_id += 1
    return key


# Frames only, as _backward's: all of this runs inside a scoped backward, as plain Python.
dynamo_exclude.exclude(
    *(fn for fn in list(globals().values()) if isinstance(fn, FunctionType) and fn.__module__ == __name__),
    _SkipNone.__call__,
    LeafAccumulation.__init__,
    LeafAccumulation._add_accumulating_hook,
    LeafAccumulation.close,
    LeafAccumulation.for_boundary,
    graph_break=False,
)
