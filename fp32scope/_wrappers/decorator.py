"""``with_fp32_precision``: a decorator that runs every call of a callable inside its scope."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from fp32scope._flags import dynamo_exclude
from fp32scope._flags.precision import Fp32Precision, check_backward, check_precision
from fp32scope._flags.scope import fp32_precision_scope, split, wrapper_scope
from fp32scope._training.backward import call_recorded, grad_enabled, recording_scope
from fp32scope._wrappers.autocast import (
    AutocastPolicy,
    any_autocast,
    check_autocast,
    run_under_autocast,
    warn_cublas_override,
)
from fp32scope._wrappers.node import declared_autocast
from fp32scope._wrappers.proxy import Fp32ScopedModule
from fp32scope._wrappers.region import Region, check_in_graph, traced_region
from fp32scope._wrappers.trampoline import (
    active_callback,
    check_eager,
    compiled_call,
    eager_trampoline,
    refuse_compiled_eager,
    trampoline_for,
)

__all__ = ["with_fp32_precision"]

F = TypeVar("F", bound=Callable[..., Any])


def _refuse_suspending(target: Callable[..., Any], name: str) -> None:
    # The flags are process-wide: a scope held across a suspension point (await, yield)
    # would leak its precision into whatever runs while the coroutine or generator waits,
    # and restore at some unrelated later time.
    unwrapped = inspect.unwrap(target)
    kinds = (
        (inspect.iscoroutinefunction, "a coroutine function"),
        (inspect.isasyncgenfunction, "an async generator function"),
        (inspect.isgeneratorfunction, "a generator function"),
    )
    for test, kind in kinds:
        if test(target) or test(unwrapped):
            msg = (
                f"with_fp32_precision cannot wrap {name!r}: it is {kind}. The float32 precision flags "
                "are process-wide, so a scope held across an await or yield would apply to whatever "
                "else runs while it is suspended. Scope the synchronous calls inside it instead "
                "(with fp32_precision_scope(...): around each model call)."
            )
            raise TypeError(msg)


def with_fp32_precision(  # noqa: PLR0913  (keyword-only options)
    precision: Fp32Precision | None,
    *,
    name: str | None = None,
    backward: bool = True,
    autocast: bool | None = None,
    in_graph: bool | None = None,
    eager: bool = False,
) -> Callable[[F], F]:
    """A decorator that runs every call of its target inside ``fp32_precision_scope(precision)``.

    ``precision`` is checked now, so a bad one fails when the decorator is made, not at
    the first call. With None, or both fields None, the decorator returns its target
    unchanged (unless ``autocast`` is False). A ``torch.nn.Module`` (a
    ``torch.compile``'d one included) becomes an :class:`~fp32scope.Fp32ScopedModule`. Any other callable (a function, a
    ``torch.compile``'d function, a method in a class body, a callable object) becomes a
    function that keeps ``__wrapped__``, ``__name__``, ``__qualname__``, ``__doc__`` and the
    signature, and binds as a method. Coroutine, async generator and generator functions are
    refused with :class:`TypeError`, as are non-callables. ``name`` (default: the target's
    qualified name) appears in errors and warnings.

    When a call records autograd history (grad mode on and an output requires grad), the
    backward of every autograd node that call created runs in the same precision too,
    including nodes that use tensors the function reaches by closure (leaves such as
    parameters; see the training guide for the limits); ``backward=False`` keeps the
    wrapper forward-only.

    ``autocast`` says what a call under ``torch.autocast`` does, as for
    :class:`~fp32scope.Fp32ScopedModule`: False runs the target with autocast off and its
    floating-point tensor arguments cast to float32; True keeps the caller's autocast;
    None (the default) keeps it, warning once (:class:`~fp32scope.Fp32AutocastWarning`)
    if ``precision`` asks for full float32. A module target's own ``autocast``
    declaration counts where the argument is None.

    Apply it to the compiled callable, never inside it: Dynamo cannot trace a flag change.
    By default (``in_graph`` None or True) a compiling caller traces the call as one region
    of its own graph: no graph break, ``fullgraph=True`` works, and the target runs inside
    the scope (compiled by Inductor inside the region where the caller's graph goes to
    Inductor, else eagerly: see the compiled guide); a function target then takes every tensor
    that needs a gradient as an argument (a method reaching its module through ``self`` is a
    graph break instead: wrap the module with :class:`~fp32scope.Fp32ScopedModule`). With
    ``in_graph=False``, a target that is not compiled already and is called from compiled
    code is compiled as a graph of its own, inside the scope (a graph break in the caller).
    A wrapper handed to ``torch.compile`` itself compiles its target that way too.
    ``eager=True`` keeps the target as eager runs it, never compiled (an in-graph region
    unless ``in_graph=False``, where the caller graph-breaks and the target runs eagerly),
    as for :class:`~fp32scope.Fp32ScopedModule`; ``precision`` may then be None.

    >>> import torch
    >>> @with_fp32_precision(Fp32Precision("highest"))
    ... def head(x):
    ...     return torch.get_float32_matmul_precision()
    >>> torch.set_float32_matmul_precision("high")
    >>> head(None), torch.get_float32_matmul_precision()
    ('highest', 'high')
    """
    checked = check_precision(precision)
    if name is not None and not isinstance(name, str):
        msg = f"name must be a str or None; got {name!r} of type {type(name).__name__}."
        raise TypeError(msg)
    check_backward(backward)
    check_eager(eager)
    region = True if in_graph is None else check_in_graph(in_graph)
    mode = check_autocast(autocast)
    fields = split(checked)

    def decorate(target: F) -> F:
        if not callable(target):
            msg = f"with_fp32_precision(...) must decorate a callable; got {target!r} of type {type(target).__name__}."
            raise TypeError(msg)
        label = name if name is not None else getattr(target, "__qualname__", type(target).__qualname__)
        is_module = isinstance(target, torch.nn.Module)
        effective = declared_autocast(label, target) if is_module and mode is None else mode
        if fields is None and effective is not False and not eager:
            return target  # no scope, so nothing can leak across a suspension point
        _refuse_suspending(target, label)
        if is_module:
            return Fp32ScopedModule(  # type: ignore[return-value]
                target, checked, name=label, backward=backward, autocast=mode, in_graph=region, eager=eager
            )
        if eager:
            refuse_compiled_eager(target, label)
        dynamo_exclude.ensure()
        trampoline = eager_trampoline() if eager else trampoline_for(target, label)
        policy = AutocastPolicy(mode, checked, label)
        warn_cublas_override(checked, label)
        regions: list[Region] = []
        scoped = _scoped_function(target, wrapper_scope(checked, label), checked, backward, trampoline, policy, regions)
        if region:
            kept = Region(target, policy, label, compiled=not eager)
            kept.fallback = scoped  # a call it cannot carry: this wrapper's graph break
            regions.append(kept)
            # Never a target's own Dynamo mark, which update_wrapper copied (another wrapper's):
            # a compiling caller must inline this function to trace the region.
            for mark in ("_torchdynamo_disable", "_torchdynamo_disable_msg"):
                vars(scoped).pop(mark, None)
        else:
            dynamo_exclude.mark_function(scoped)  # a compiled caller graph-breaks at the call
        return scoped  # type: ignore[return-value]

    return decorate


def _scoped_function(  # noqa: PLR0913, PLR0917  (private; built once per wrapper)
    target: Callable[..., Any],
    scope: fp32_precision_scope,
    precision: Fp32Precision | None,
    backward: bool,
    trampoline: Callable[..., Any] | None,
    policy: AutocastPolicy,
    regions: list[Region],
) -> Callable[..., Any]:
    record_scope = recording_scope(scope)

    def scoped(*args: Any, **kwargs: Any) -> Any:
        # A compiling caller's Dynamo tracing an in-graph wrapper's call (``regions`` holds
        # its region; the function is then not marked, so Dynamo inlines it): one op of the
        # caller's graph.
        if regions and _is_compiling():
            return traced_region(regions[0], args, kwargs)
        # Under torch.autocast: warn, or call again with autocast off (one C call outside).
        if policy.action is not None and any_autocast():  # nothing to do under autocast: no C call
            return run_under_autocast(policy, scoped, args, kwargs)
        if grad_enabled() and backward:
            fn = compiled_call(target, trampoline) if active_callback() else target
            return call_recorded(record_scope, fn, args, kwargs)
        with scope:
            # A compiling caller's Dynamo is active: compile the target here, in the scope.
            if not active_callback():  # (one C call; eager calls stop here)
                return target(*args, **kwargs)
            return compiled_call(target, trampoline)(*args, **kwargs)

    try:
        functools.update_wrapper(scoped, target)
    except AttributeError:  # pragma: no cover  (objects without __dict__ on a callable)
        scoped.__wrapped__ = target  # type: ignore[attr-defined]
    scoped.__fp32scope_precision__ = precision  # type: ignore[attr-defined]
    return scoped


# Dynamo tracing (torch.compile, strict export): a region. torch.export's non-strict tracer
# instead traces the scoped call, as for a graph-break wrapper (a node with only an
# autocast action exports; one with a precision is refused, saying what to do).
_is_compiling = torch.compiler.is_dynamo_compiling


# Every closure made by _scoped_function shares one code object: skip it once.
dynamo_exclude.exclude(
    _scoped_function(print, fp32_precision_scope(None), None, False, None, AutocastPolicy(True, None, ""), []),
    graph_break=False,
)
