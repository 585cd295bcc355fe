"""``Fp32ScopedModule``: a transparent proxy that runs every call of a module inside its scope."""

from __future__ import annotations

import copy
import functools
import gc
import types
from collections.abc import Callable
from types import MethodType
from typing import TYPE_CHECKING, Any, cast

import torch
import wrapt

from fp32scope._compat import dynamo_isinstance_as_python
from fp32scope._flags import dynamo_exclude
from fp32scope._flags.precision import Fp32Precision, check_backward, check_precision
from fp32scope._flags.scope import fp32_precision_scope, wrapper_scope
from fp32scope._training.backward import call_recorded, grad_enabled, recording_scope
from fp32scope._wrappers.autocast import (
    AutocastPolicy,
    any_autocast,
    asks_full_float32,
    check_autocast,
    run_under_autocast,
    warn_cublas_override,
)
from fp32scope._wrappers.node import declared_autocast
from fp32scope._wrappers.param_dtype import warn_low_precision_parameters
from fp32scope._wrappers.region import Region, check_in_graph, traced_region, warn_break
from fp32scope._wrappers.trampoline import (
    active_callback,
    check_eager,
    compiled_call,
    eager_trampoline,
    refuse_compiled_eager,
    trampoline_for,
)

__all__ = ["SELF_RETURNING_METHODS", "Fp32ScopedModule", "precision_of"]


def _self_returning_methods() -> tuple[str, ...]:
    # torch annotates the methods that return the module itself with ``Self``; ``to`` is
    # overloaded and carries no annotation on its implementation. Reading the annotations
    # keeps the list right for the installed torch (xpu, mtia, ... come and go).
    names = {"to"}
    for name, member in vars(torch.nn.Module).items():
        annotations = getattr(member, "__annotations__", None)
        if name.startswith("_") or not annotations or "return" not in annotations:
            continue
        # typing.Self, typing_extensions.Self, a bound TypeVar ~T, or their string forms.
        returned = str(annotations["return"]).rsplit(".", 1)[-1].lstrip("~")
        if returned in {"Self", "T"}:
            names.add(name)
    return tuple(sorted(names))


#: The ``torch.nn.Module`` methods that return the module itself; on a proxy they return the proxy.
SELF_RETURNING_METHODS: tuple[str, ...] = _self_returning_methods()


def _rebuild(  # noqa: PLR0913, PLR0917  (positional: what pickles from every release carry)
    module: torch.nn.Module,
    precision: Fp32Precision | None,
    name: str,
    backward: bool = True,  # noqa: FBT002  (pickles from fp32scope 0.1 carry three arguments)
    autocast: bool | None = None,  # (and four, before autocast)
    in_graph: bool = False,  # noqa: FBT002  (and five, before in-graph regions)
    eager: bool = False,  # noqa: FBT002  (and six, before eager nodes)
) -> Fp32ScopedModule:
    return Fp32ScopedModule(
        module, precision, name=name, backward=backward, autocast=autocast, in_graph=in_graph, eager=eager
    )


def _default_name(module: object) -> str:
    inner = getattr(module, "_orig_mod", module)
    return type(inner).__qualname__


if TYPE_CHECKING:
    _ProxyBase = wrapt.BaseObjectProxy[Any]
else:  # subscripting at run time needs a newer wrapt than the 2.0 this library supports
    _ProxyBase = wrapt.BaseObjectProxy


class Fp32ScopedModule(_ProxyBase):
    """A ``torch.nn.Module`` (typically ``torch.compile``'d) whose every call runs in a scope.

    The proxy is transparent: ``isinstance`` against the wrapped module's classes holds,
    attribute reads, writes and deletes reach the wrapped module, and ``state_dict``,
    ``load_state_dict``, ``parameters``, hooks and buffers are the wrapped module's. Calling
    the proxy, or its ``forward``, runs the call inside
    :class:`~fp32scope.fp32_precision_scope` with ``precision``; this covers the first
    (compiling) call, warmup, and CUDA graph capture. Methods that return the module itself
    (``to``, ``eval``, ``cuda``, ...; see ``SELF_RETURNING_METHODS``) return the proxy, so
    ``model = scoped.to(device).eval()`` keeps the precision. ``copy.copy``,
    ``copy.deepcopy`` and pickling keep the proxy around a copy of the module.

    Under ``torch.compile`` a flag change cannot be traced. By default (``in_graph`` None or
    True) a parent compiled as a whole holds the proxy's call as one in-graph region of its
    graph (no graph break, ``fullgraph=True`` compiles): the node runs at run time inside
    its scope, forward and backward, and the rest of the parent at the process default (see
    the compiled guide). Where the parent's graph goes to Inductor the node is compiled by
    Inductor inside the region, in its precision; with another backend, and where its code
    cannot be held exactly (hooks, buffers it updates, outputs that are views of its
    inputs, nested scoped nodes, caches), it runs eagerly inside it. With ``in_graph=False``
    the parent graph-breaks at the proxy, and the wrapped module, whatever its class
    (``torch.nn`` built-ins included), is compiled as a graph of its own by the parent's
    backend, inside the scope, once.
    ``torch.compile(proxy)`` compiles the module inside the scope that way, whatever
    ``in_graph`` says. A module compiled already (``torch.compile(module)``) is called as
    it is, never compiled again.

    Training: when a call records autograd history (grad mode on and an output requires
    grad), the backward of every autograd node that call created runs in the same
    precision, exactly bracketed like the forward (see the training guide);
    ``backward=False`` keeps the proxy forward-only. Under ``torch.no_grad()`` and
    ``torch.inference_mode()`` nothing is recorded.

    Under ``torch.autocast`` (see the mixed precision guide): ``autocast=False`` runs
    each call with autocast off on every device type where the caller has it on, the
    call's floating-point tensor arguments of those device types cast to float32 first (as
    ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` does), and the caller's autocast
    back afterwards; ``autocast=True`` keeps the caller's autocast; None (the default)
    takes what the wrapped module declares with an ``autocast`` attribute (a bool, beside
    ``float32_matmul_precision``), and where it declares nothing keeps the caller's
    autocast, warning once (:class:`~fp32scope.Fp32AutocastWarning`) if ``precision`` asks
    for full float32 (matmul ``"highest"`` or ``cudnn_allow_tf32=False``). Outside
    autocast none of this costs more than one check.

    ``eager=True`` keeps the node as eager runs it, never compiled: its own kernels,
    unfused, forward and backward, bit for bit the node called eagerly on the same inputs
    (Inductor's fusions and math routines change low-precision results: see the compiled
    guide). Inside a compiled parent it is one in-graph region; with ``in_graph=False`` the
    parent graph-breaks at it and it runs eagerly there.
    ``precision`` may then be None: the flags stay as the caller has them.

    ``precision`` is checked here; None or an all-None precision makes a proxy that adds
    no scope (with ``autocast=False`` it still turns autocast off). ``name`` (default: the
    wrapped module's class name) appears in errors and warnings. Read the precision back
    with :func:`precision_of`; the bare module is ``__wrapped__``.
    """

    def __new__(cls, /, *_args: Any, **kwargs: Any) -> Fp32ScopedModule:  # noqa: PYI034  (may make a subclass)
        # A region (in_graph True or None) is the subclass whose call Dynamo traces (see _InGraphScopedModule).
        region = kwargs.get("in_graph") is not False
        kind = _InGraphScopedModule if cls is Fp32ScopedModule and region else cls
        proxy: Fp32ScopedModule = super().__new__(kind)
        return proxy

    def __init__(  # noqa: PLR0913  (keyword-only options)
        self,
        # torch.compile(module) is typed as returning a plain callable; it is an nn.Module
        # at run time, which is checked below.
        module: torch.nn.Module | Callable[..., Any],
        precision: Fp32Precision | None,
        *,
        name: str | None = None,
        backward: bool = True,
        autocast: bool | None = None,
        in_graph: bool | None = None,
        eager: bool = False,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            msg = (
                f"module must be a torch.nn.Module (a torch.compile'd one included); got {module!r} "
                f"of type {type(module).__name__}. Wrap other callables with with_fp32_precision."
            )
            raise TypeError(msg)
        checked = check_precision(precision)
        if name is not None and not isinstance(name, str):
            msg = f"name must be a str or None; got {name!r} of type {type(name).__name__}."
            raise TypeError(msg)
        check_backward(backward)
        check_eager(eager)
        in_graph = True if in_graph is None else check_in_graph(in_graph)
        label = name if name is not None else _default_name(module)
        if eager:
            refuse_compiled_eager(module, label)
        mode = check_autocast(autocast)
        if mode is None:
            mode = declared_autocast(label, module)
        dynamo_exclude.ensure()
        dynamo_isinstance_as_python(Fp32ScopedModule)  # a compiling parent asks as eager does
        super().__init__(module)
        self._self_precision = checked
        self._self_eager = eager
        self._self_name = label
        self._self_scope = wrapper_scope(checked, self._self_name)
        # Whether calls that record autograd history also scope their backward.
        self._self_backward = backward and self._self_scope._fields is not None
        self._self_record_scope = recording_scope(self._self_scope)
        # What a compiling caller's Dynamo converts instead of the module (see _trampoline).
        # (An eager node's runs it with Dynamo off instead: never compiled.)
        self._self_trampoline = eager_trampoline() if eager else trampoline_for(module, self._self_name)
        # What a call under torch.autocast does (see _autocast).
        self._self_autocast = AutocastPolicy(mode, checked, label)
        warn_cublas_override(checked, label)
        # Whether the first call still has to check the node's parameter dtypes (see _param_dtype).
        self._self_check_parameters = asks_full_float32(checked)
        # What a compiling parent traces in place of the call (see _region), or None: a graph break.
        self._self_region = Region(module, self._self_autocast, label, compiled=not eager) if in_graph else None
        if self._self_region is not None:  # a call it cannot carry: this wrapper's graph break
            self._self_region.fallback = functools.partial(_scoped_call, self)
        own = _own_dict(self)  # what ``__dict__`` returns (see there)
        if in_graph and "forward" in own:
            # A compiling parent's ``child.forward(x)``: a region too, of the forward alone.
            region = Region(module, self._self_autocast, label, forward=True, compiled=not eager)
            region.fallback = functools.partial(_call_scoped_forward, self)
            own["forward"] = _region_forward(self, region)

    # Attribute reads: Python's own lookup, then wrapt's __getattr__ (the wrapped module's
    # attribute), which is what wrapt's C __getattribute__ does. A Python subclass of a
    # proxy type that has __getattr__ gets CPython's generic attribute hook, which calls a
    # C __getattribute__ through a bound method object on every read (about 80 ns; each call
    # reads the proxy's own state); object's __getattribute__ it calls directly (about 25 ns).
    __getattribute__ = object.__getattribute__

    # ``self`` is positional-only so that a keyword argument named "self" still reaches
    # the module (wrapt's CallableObjectProxy gets the same by unpacking *args, which costs
    # a list on every call).
    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        # A compiling parent's Dynamo tracing a region's call (it inlines the unmarked copy of
        # this function that _InGraphScopedModule has): one op of the parent's graph.
        if self._self_region is not None and _is_compiling():
            return traced_region(self._self_region, args, kwargs)
        if self._self_check_parameters:  # the first call of a node asking for full float32
            self._self_check_parameters = False
            warn_low_precision_parameters(self.__wrapped__, self._self_precision, self._self_name)
        # Under torch.autocast: warn, or call again with autocast off (one C call outside).
        if self._self_autocast.action is not None and any_autocast():  # nothing to do under autocast: no C call
            return run_under_autocast(self._self_autocast, self, args, kwargs)
        if grad_enabled() and self._self_backward:  # no_grad / inference_mode: one C call
            fn = self.__wrapped__
            if active_callback():
                fn = self._compiled_here(args, kwargs)
            return call_recorded(self._self_record_scope, fn, args, kwargs)
        with self._self_scope:
            # Dynamo's frame callback is active while a compiled caller runs its eager parts
            # (this call among them): compile the module here, inside the scope.
            if not active_callback():  # (one C call; eager calls stop here)
                return self.__wrapped__(*args, **kwargs)
            return self._compiled_here(args, kwargs)(*args, **kwargs)

    def _compiled_here(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
        # A region's call reaches here from a compiled caller where the caller graph-broke
        # at it, with an argument the region cannot carry: say so, once.
        if self._self_region is not None:
            warn_break(self._self_region, args, kwargs)
        return compiled_call(self.__wrapped__, self._self_trampoline)

    # How Dynamo reaches the call when the proxy is a child of a compiled parent. torch 2.4's
    # Dynamo (nn-module inlining off) treats any nn.Module attribute as a static module: it
    # guards the child's ``training`` through the ``__dict__`` it sees from Python, which on a
    # wrapt proxy is the wrapped module's, while the C++ guard reads the proxy's own instance
    # dict (its ``_self_*`` attributes): "KeyError on L['self'].child.training", a recompile
    # on every call. It then inlines ``_call_impl``, which reaches ``__wrapped__`` (a graph
    # break on the descriptor, not on the mark) or, for a torch.nn class, puts the child
    # into the parent's graph as a call_module, outside its scope. torchdynamo_force_dynamic
    # makes it treat the proxy as an unspecialized module (what later releases do by
    # default), which it calls through ``type(proxy)._call_impl``: this call, whose Dynamo
    # mark makes a clean graph break. (On a proxy, _call_impl is the scoped call, as a call
    # of the proxy is.) Later releases call ``type(proxy).__call__`` instead.
    torchdynamo_force_dynamic = True
    _call_impl = __call__

    @property
    def forward(self) -> Callable[..., Any]:
        """The wrapped module's ``forward``, run inside the scope."""
        policy = self._self_autocast
        if (
            (self._self_precision is None or self._self_precision.is_noop)
            and policy.action is None
            and not self._self_eager
        ):
            forward: Callable[..., Any] = self.__wrapped__.forward
            return forward
        if torch.compiler.is_compiling():
            # Dynamo tracing this property (torch 2.15 does): the marked forward of the
            # proxy's own dict (see __dict__), so that the caller graph-breaks at its call.
            marked: Callable[..., Any] = self._self_own.dict["forward"]
            return marked
        return _scoped_forward(
            self.__wrapped__.forward,
            self._self_scope,
            self._self_backward,
            self._self_record_scope,
            policy,
            self._self_trampoline,
        )

    @forward.setter
    def forward(self, value: Callable[..., Any]) -> None:
        # Assignments such as torch.cuda.make_graphed_callables' ``module.forward = graphed``
        # must land on the wrapped module, whose __call__ the proxy's __call__ runs;
        # otherwise calls would keep running the eager forward, silently.
        self.__wrapped__.forward = value

    @forward.deleter
    def forward(self) -> None:
        del self.__wrapped__.forward

    # ``parent.child.forward(x)`` in a compiled parent. Dynamo resolves an attribute of the
    # proxy the way Python would for an object of ``proxy.__class__`` (the wrapped module's
    # class, on torch 2.13) whose instance dict is ``proxy.__dict__``, and guards what it read
    # through the proxy's own instance dict (its ``_self_*`` attributes). With wrapt's
    # ``__dict__`` (the wrapped module's) the two disagree: Dynamo found the wrapped class's
    # ``forward``, inlined it into the parent's graph outside the scope, and failed building
    # its guards ("Guard failed on the same frame it was created ... KeyError on
    # ...['child']._modules"). So ``proxy.__dict__`` is the proxy's own dict, which holds a
    # scoped ``forward``: Dynamo finds it there and graph-breaks cleanly at its call, which
    # then runs eagerly through the property above (a property wins over the instance dict
    # in Python). Other attributes Dynamo reads through wrapt, and guards the same way.
    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        """The proxy's own attributes; the wrapped module's are ``vars(proxy.__wrapped__)``."""
        own: dict[str, Any] = self._self_own.dict
        return own

    def __bool__(self) -> bool:
        # Truth is the wrapped module's (wrapt forwards it), with one exception: torch 2.10's
        # OptimizedModule has a __len__ that raises TypeError for a module without a length,
        # so bool() of a compiled module raises there, and Dynamo 2.10 takes bool() of a
        # callable it is about to call: a compiled parent with this proxy around a compiled
        # child failed with "InternalTorchDynamoError: TypeError: ... does not support len()".
        # An object without a length is true.
        try:
            return bool(self.__wrapped__)
        except TypeError:
            return True

    def __repr__(self) -> str:
        return (
            f"Fp32ScopedModule(precision={self._self_precision!r}, name={self._self_name!r}, "
            f"backward={self._self_backward!r}, autocast={self._self_autocast.mode!r}, "
            f"in_graph={self._self_region is not None!r}, eager={self._self_eager!r},\n"
            f"  module={self.__wrapped__!r})"
        )

    def __copy__(self) -> Fp32ScopedModule:
        return _rebuild(
            copy.copy(self.__wrapped__),
            self._self_precision,
            self._self_name,
            self._self_backward,
            self._self_autocast.mode,
            self._self_region is not None,
            self._self_eager,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Fp32ScopedModule:
        return _rebuild(
            copy.deepcopy(self.__wrapped__, memo),
            self._self_precision,
            self._self_name,
            self._self_backward,
            self._self_autocast.mode,
            self._self_region is not None,
            self._self_eager,
        )

    def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
        return (
            _rebuild,
            (
                self.__wrapped__,
                self._self_precision,
                self._self_name,
                self._self_backward,
                self._self_autocast.mode,
                self._self_region is not None,
                self._self_eager,
            ),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__reduce_ex__(2)


class _InGraphScopedModule(Fp32ScopedModule):
    """A scoped module made with ``in_graph=True``: one region of a compiling parent's graph."""

    _self_region: Region

    # Attributes of the wrapped module, as wrapt's C __getattr__ reads them, but in Python:
    # a compiling parent that reads ``child.weight`` or ``child.training`` traces through it
    # (Dynamo refuses a "non-function __getattr__"). Reached only where the proxy's own
    # lookup fails, so its own state reads cost nothing more.
    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    # Container protocol of the wrapped module (``child[0]``, ``for m in child``), which
    # wrapt implements in C, where a compiling parent's Dynamo cannot follow.
    def __getitem__(self, key: Any) -> Any:
        return self.__wrapped__[key]

    def __iter__(self) -> Any:
        return iter(self.__wrapped__)

    def __len__(self) -> int:
        return len(self.__wrapped__)

    def __contains__(self, key: object) -> bool:
        return key in self.__wrapped__

    @property
    def forward(self) -> Callable[..., Any]:
        """The wrapped module's ``forward``, run inside the scope; under Dynamo, a region of its own."""
        # One object in and out of tracing: Dynamo's guards read ``.forward`` again, eagerly.
        # (So, eagerly, it calls the wrapped module's ``forward`` as found at each call.)
        found: Callable[..., Any] | None = self._self_own.dict.get("forward")
        if found is None:  # nothing to scope (a no-op precision, no autocast action)
            return _forward_getter(self)
        return found

    @forward.setter
    def forward(self, value: Callable[..., Any]) -> None:
        self.__wrapped__.forward = value

    @forward.deleter
    def forward(self) -> None:
        del self.__wrapped__.forward


# Dynamo tracing (torch.compile, strict export): a region. torch.export's non-strict tracer
# instead traces the scoped call, as for a graph-break wrapper (a node with only an
# autocast action exports; one with a precision is refused, saying what to do).
_is_compiling = torch.compiler.is_dynamo_compiling
_scoped_call = Fp32ScopedModule.__call__


def _unmarked_copy(fn: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    # The same code as a new function object: Dynamo's mark (on the object) stays off it,
    # and its frame skip (on the code) applies to both.
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = qualname
    copy.__doc__ = fn.__doc__
    return copy


# A region's call: the scoped call itself, without an extra frame for eager calls, which a
# compiling parent's Dynamo inlines (it graph-breaks at the marked original): see __call__.
# ``torch.compile(proxy)`` starts its frame in it: skipped, as the original's code is, so the
# scoped call compiles the wrapped module as a graph of its own, inside the scope.
_InGraphScopedModule.__call__ = _InGraphScopedModule._call_impl = _unmarked_copy(  # type: ignore[method-assign]
    _scoped_call, "_InGraphScopedModule.__call__"
)


def _call_scoped_forward(proxy: Fp32ScopedModule, /, *args: Any, **kwargs: Any) -> Any:
    return _forward_getter(proxy)(*args, **kwargs)


def _region_forward(proxy: Fp32ScopedModule, region: Region) -> Callable[..., Any]:
    # What Dynamo finds as an in-graph proxy's ``forward`` (its own dict, or the property
    # while compiling): inlined, unlike the marked forward of a graph-break proxy.
    def region_forward(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return traced_region(region, args, kwargs)
        return _forward_getter(proxy)(*args, **kwargs)  # not compiling: the scoped forward

    return region_forward


def _make_self_returning(name: str) -> Callable[..., Any]:
    def method(self: Fp32ScopedModule, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.__wrapped__, name)(*args, **kwargs)
        return self if result is self.__wrapped__ else result

    original = getattr(torch.nn.Module, name)
    method.__name__ = name
    method.__qualname__ = f"Fp32ScopedModule.{name}"
    method.__doc__ = f"``{name}`` of the wrapped module; returns the proxy where torch returns the module."
    method.__wrapped__ = original  # type: ignore[attr-defined]  # so inspect.signature shows torch's
    return method


for _name in SELF_RETURNING_METHODS:
    setattr(Fp32ScopedModule, _name, _make_self_returning(_name))
del _name


def _scoped_forward(  # noqa: PLR0913, PLR0917  (one closure per property read: its state as arguments)
    forward: Callable[..., Any],
    scope: fp32_precision_scope,
    backward: bool,
    record_scope: fp32_precision_scope,
    policy: AutocastPolicy,
    trampoline: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    def scoped_forward(*args: Any, **kwargs: Any) -> Any:
        if policy.action is not None and any_autocast():  # nothing to do under autocast: no C call
            return run_under_autocast(policy, scoped_forward, args, kwargs)
        fn = forward
        if active_callback():  # a compiled caller: compile the forward here, inside the scope
            if type(forward) is MethodType:
                # Each read of ``.forward`` binds a new method object, and torch 2.4's Dynamo
                # guards the trampoline on its id (a recompile per call): pass its function
                # and module, which stay the same.
                fn = functools.partial(compiled_call(forward.__func__, trampoline), forward.__self__)
            else:
                fn = compiled_call(fn, trampoline)
        if grad_enabled() and backward:
            return call_recorded(record_scope, fn, args, kwargs)
        with scope:
            return fn(*args, **kwargs)

    dynamo_exclude.mark_function(scoped_forward)
    scoped_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return scoped_forward


class _OwnDict:
    """Holds a proxy's own instance dict (see ``Fp32ScopedModule.__dict__``)."""

    __slots__ = ("dict",)

    def __init__(self, own: dict[str, Any]) -> None:
        self.dict = own


def _own_dict(proxy: Fp32ScopedModule) -> dict[str, Any]:
    # The proxy's instance dict, where wrapt keeps its ``_self_*`` attributes (Python reaches
    # it only through the garbage collector: ``__dict__`` is overridden); found when the
    # proxy is made.
    own: dict[str, Any] = next(
        found for found in gc.get_referents(proxy) if type(found) is dict and "_self_precision" in found
    )
    # Held through an object, not as a value of itself: a dict that contains itself makes
    # pytree flattening recurse forever (torch 2.4's non-strict export flattens it).
    own["_self_own"] = _OwnDict(own)
    precision = own["_self_precision"]
    if (
        (precision is not None and not precision.is_noop)
        or own["_self_autocast"].action is not None
        or own["_self_eager"]
    ):
        # What Dynamo finds as the proxy's ``forward``: a scoped forward as the property
        # makes them (one code object, which Dynamo's guard checks), marked, so that a
        # compiled caller graph-breaks at its call and then calls the property's.
        own["forward"] = proxy.forward
    # What Dynamo finds as the proxy's ``named_modules`` (it looks attributes up in the
    # proxy's type and this dict, never through wrapt): the wrapped module's, so that a
    # traced ``parameters()`` of a module holding this proxy (an in-graph region's node)
    # walks into the wrapped module as Python does, instead of failing on the proxy's type.
    own["named_modules"] = proxy.__wrapped__.named_modules
    return own


# Every closure of _scoped_forward shares one code object: marking one covers them all.
dynamo_exclude.exclude(Fp32ScopedModule.__call__)
dynamo_exclude.rename_where_no_reason(Fp32ScopedModule.__call__)
dynamo_exclude.exclude(
    _scoped_forward(
        print, fp32_precision_scope(None), False, fp32_precision_scope(None), AutocastPolicy(True, None, "")
    ),
    graph_break=False,
)
# Where a compiled caller resumes after a graph break and reads ``child.forward`` (torch 2.4
# starts a frame in the property's getter, and fails it): frames only, so that a Dynamo that
# inlines the property (torch 2.15) still does.
_forward_getter = cast("Callable[[Fp32ScopedModule], Callable[..., Any]]", vars(Fp32ScopedModule)["forward"].fget)
dynamo_exclude.exclude(_forward_getter, graph_break=False)
# Reached from the eager __call__ while Dynamo's callback is active (torch 2.8's strict export
# converts its frame, and fails to return the function it makes): frames only.
dynamo_exclude.exclude(Fp32ScopedModule._compiled_here, graph_break=False)
dynamo_exclude.exclude(vars(_InGraphScopedModule)["forward"].fget, graph_break=False)


def precision_of(obj: object) -> Fp32Precision | None:
    """The precision a wrapper from this library applies to ``obj``'s calls, or None.

    ``obj`` is an :class:`Fp32ScopedModule` or a callable returned by
    :func:`~fp32scope.with_fp32_precision`; anything else (a bare module, a plain function)
    gives None. The bare callable of either is ``obj.__wrapped__``.
    """
    if isinstance(obj, Fp32ScopedModule):
        precision: Fp32Precision | None = obj._self_precision
        return precision
    found = getattr(obj, "__fp32scope_precision__", None)
    return found if isinstance(found, Fp32Precision) else None


# Pickles name the public home, which stays when private modules move: the class as
# fp32scope.Fp32ScopedModule, its rebuilder as fp32scope.Fp32ScopedModule._rebuild (old
# pickles name fp32scope._wrappers.proxy._rebuild, which stays too).
Fp32ScopedModule.__module__ = _rebuild.__module__ = "fp32scope"
_rebuild.__qualname__ = "Fp32ScopedModule._rebuild"
Fp32ScopedModule._rebuild = staticmethod(_rebuild)  # type: ignore[attr-defined]
