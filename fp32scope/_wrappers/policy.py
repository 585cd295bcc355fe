"""Scoping a model one did not write: ``scope_modules``, ``unscope_modules``, ``scoped_modules``."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import torch

from fp32scope._flags.precision import Fp32Precision, check_backward, check_cudnn, check_matmul, check_precision
from fp32scope._wrappers.autocast import check_autocast
from fp32scope._wrappers.node import node_fp32_precision
from fp32scope._wrappers.proxy import Fp32ScopedModule, precision_of
from fp32scope._wrappers.region import check_in_graph

__all__ = ["scope_modules", "scoped_modules", "unscope_modules"]

_PATTERN_PREFIX = "re:"
_PRECISION_KEYS = ("matmul", "cudnn_allow_tf32")
#: Keys a rule's mapping may hold besides the precision: per-rule wrapper options.
_OPTION_KEYS = ("in_graph", "eager")
#: The policy value that keeps a node eager without changing its flags.
_EAGER = "eager"
_ORIG_MOD = "_orig_mod"


class _Slot(NamedTuple):
    """One place in the module tree: ``parent._modules[key]`` holds ``stored``."""

    name: str
    parent: torch.nn.Module
    key: str
    stored: torch.nn.Module


def _optimized_module() -> type | None:
    # Imported on demand: importing Dynamo is slow, and a model nobody compiled has none.
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover  (a torch built without Dynamo)
        return None
    return OptimizedModule


def _bare(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` without the proxies and ``torch.compile`` wrappers around it."""
    optimized = _optimized_module()
    while True:
        if isinstance(module, Fp32ScopedModule):
            module = module.__wrapped__
        elif optimized is not None and isinstance(module, optimized):
            module = cast("torch.nn.Module", module._orig_mod)
        else:
            return module


def _root(model: object) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        msg = (
            f"model must be a torch.nn.Module (a torch.compile'd one included); got {model!r} of type "
            f"{type(model).__name__}."
        )
        raise TypeError(msg)
    # Through a torch.compile'd model to what it compiles, and through a hand-made wrapper
    # of the whole model: their submodules are the model's.
    return _bare(model)


def _walk(root: torch.nn.Module) -> list[_Slot]:
    """Every submodule slot under ``root``, parents before children, named as in ``named_modules``.

    A proxy's or a compiled module's own children are visited through the module they wrap,
    so that a name is the one ``state_dict`` uses; the ``_orig_mod`` of a compiled submodule
    is one node with it (its slot is not listed, its children are). A module shared by
    several parents has a slot in each; its children are visited once, under the first.
    """
    optimized = _optimized_module()
    slots: list[_Slot] = []
    visited: set[int] = {id(root)}

    def visit(parent: torch.nn.Module, prefix: str) -> None:
        for key, stored in parent._modules.items():
            if stored is None:
                continue
            name = f"{prefix}.{key}" if prefix else key
            if optimized is not None and isinstance(parent, optimized) and key == _ORIG_MOD:
                inner: torch.nn.Module = stored
            else:
                slots.append(_Slot(name, parent, key, stored))
                inner = stored
            # Through proxies (their _modules are the wrapped module's) and compiled modules.
            while isinstance(inner, Fp32ScopedModule):
                inner = inner.__wrapped__
            if id(inner) in visited:
                continue
            visited.add(id(inner))
            visit(inner, name)

    visit(root, "")
    return slots


# -- the policy -----------------------------------------------------------------------------


class _Rule(NamedTuple):
    selector: object
    precision: Fp32Precision | None  # None: matched modules stay unscoped
    in_graph: bool | None = None  # None: scope_modules' own in_graph argument
    eager: bool = False  # the node runs as eager runs it (see Fp32ScopedModule's eager)


def _show(selector: object) -> str:
    if isinstance(selector, type):
        return f"{selector.__module__}.{selector.__qualname__}"
    return repr(selector)


def _check_value(selector: object, value: object) -> Fp32Precision | None:
    """The precision ``policy[selector]`` stands for (None: leave unscoped); raise if it is bad."""
    where = f"policy[{_show(selector)}]"
    if value is None or isinstance(value, Fp32Precision):
        checked = check_precision(value, argument=where)
    elif value == _EAGER:
        checked = None
    elif isinstance(value, str):
        checked = Fp32Precision(check_matmul(value, field=where))
    elif isinstance(value, Mapping):
        unknown = [key for key in value if key not in _PRECISION_KEYS and key not in _OPTION_KEYS]
        if unknown:
            msg = (
                f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; a precision mapping takes "
                f"{', '.join(map(repr, _PRECISION_KEYS + _OPTION_KEYS))} (got {dict(value)!r})."
            )
            raise ValueError(msg)
        checked = Fp32Precision(
            check_matmul(value.get("matmul"), field=f"{where}['matmul']"),
            check_cudnn(value.get("cudnn_allow_tf32"), field=f"{where}['cudnn_allow_tf32']"),
        )
    else:
        msg = (
            f"{where} must be an fp32scope.Fp32Precision, a matmul precision ('highest', 'high' or "
            f"'medium'), 'eager', a mapping with keys 'matmul', 'cudnn_allow_tf32', 'in_graph' and 'eager', "
            f"or None; got {value!r} of type {type(value).__name__}."
        )
        raise TypeError(msg)
    return None if checked is None or checked.is_noop else checked


#: What True and False mean for each of a rule's bool keys, as its error message says.
_RULE_FLAGS = {
    "in_graph": "True (an in-graph region under torch.compile) or False (a graph break)",
    "eager": "True (the node runs as eager runs it, never compiled) or False",
}


def _check_rule_flag(selector: object, value: object, key: str) -> bool | None:
    """A rule's own bool ``key`` (a mapping's key of that name), or None where it has none."""
    if not isinstance(value, Mapping) or key not in value:
        return None
    found = value[key]
    if type(found) is not bool:
        msg = (
            f"policy[{_show(selector)}][{key!r}] must be {_RULE_FLAGS[key]}; "
            f"got {found!r} of type {type(found).__name__}."
        )
        raise TypeError(msg)
    return found


def _check_rule_eager(selector: object, value: object) -> bool:
    """Whether a rule keeps its nodes eager: the value ``"eager"``, or a mapping's ``"eager"`` key."""
    return value == _EAGER or _check_rule_flag(selector, value, "eager") is True


class _Policy:
    """A checked policy, its selectors sorted by kind, in the order the mapping gave them."""

    def __init__(self, policy: object) -> None:
        if not isinstance(policy, Mapping):
            msg = (
                f"policy must be a mapping from selectors to precisions, or None (scope the modules "
                f"that declare a precision); got {policy!r} of type {type(policy).__name__}."
            )
            raise TypeError(msg)
        self.exact: dict[str, _Rule] = {}
        self.patterns: list[tuple[re.Pattern[str], _Rule]] = []
        self.classes: list[tuple[type, _Rule]] = []
        self.callables: list[tuple[Callable[..., Any], _Rule]] = []
        self.rules: list[_Rule] = []
        for selector, value in policy.items():
            rule = _Rule(
                selector,
                _check_value(selector, value),
                _check_rule_flag(selector, value, "in_graph"),
                _check_rule_eager(selector, value),
            )
            self._add(selector, rule)
            self.rules.append(rule)

    def _add(self, selector: object, rule: _Rule) -> None:
        if isinstance(selector, str):
            if selector.startswith(_PATTERN_PREFIX):
                try:
                    pattern = re.compile(selector[len(_PATTERN_PREFIX) :])
                except re.error as error:
                    msg = f"policy selector {selector!r} is not a valid regular expression: {error}."
                    raise ValueError(msg) from error
                self.patterns.append((pattern, rule))
            else:
                self.exact[selector] = rule
        elif isinstance(selector, type):
            if not issubclass(selector, torch.nn.Module):
                msg = (
                    f"policy selector {_show(selector)} is a class but not a torch.nn.Module subclass; a "
                    "selector is a qualified name, 're:<pattern>', a torch.nn.Module subclass or a "
                    "callable (name, module) -> bool."
                )
                raise TypeError(msg)
            self.classes.append((selector, rule))
        elif callable(selector):
            self.callables.append((selector, rule))
        else:
            msg = (
                f"policy selector {selector!r} of type {type(selector).__name__} is not a selector; a "
                "selector is a qualified name (str), 're:<pattern>', a torch.nn.Module subclass or a "
                "callable (name, module) -> bool."
            )
            raise TypeError(msg)

    def decide(self, name: str, module: torch.nn.Module, matched: set[int]) -> _Rule | None:
        """The rule that decides ``module`` (exact, pattern, class, callable; first of a kind)."""
        found: list[_Rule] = []
        exact = self.exact.get(name)
        if exact is not None:
            found.append(exact)
        found += [rule for pattern, rule in self.patterns if pattern.fullmatch(name)]
        found += [rule for cls, rule in self.classes if isinstance(module, cls)]
        for fn, rule in self.callables:
            verdict = fn(name, module)
            if type(verdict) is not bool:
                msg = (
                    f"policy selector {_show(fn)} must return True or False; for module {name!r} it "
                    f"returned {verdict!r} of type {type(verdict).__name__}."
                )
                raise TypeError(msg)
            if verdict:
                found.append(rule)
        matched.update(id(rule) for rule in found)
        return found[0] if found else None


def _root_error(model: torch.nn.Module, what: str) -> ValueError:
    return ValueError(
        f"{what} the root module ({type(model).__name__}), which cannot be replaced in place: it has no "
        "parent. Wrap it instead: model = fp32scope.Fp32ScopedModule(model, precision)."
    )


def _decide(root: torch.nn.Module, slots: list[_Slot], policy: object) -> list[_Rule | None]:
    """The rule each slot gets (None: none), checked; raises on the root or an unmatched selector."""
    if policy is None:
        if node_fp32_precision("<root>", root) is not None:
            raise _root_error(root, "policy=None selects")
        return [_Rule(None, node_fp32_precision(slot.name, _bare(slot.stored))) for slot in slots]
    checked = _Policy(policy)
    matched: set[int] = set()
    root_rule = checked.decide("", root, matched)
    if root_rule is not None:
        raise _root_error(root, f"policy selector {_show(root_rule.selector)} selects")
    rules = [checked.decide(slot.name, _bare(slot.stored), matched) for slot in slots]
    unmatched = [_show(rule.selector) for rule in checked.rules if id(rule) not in matched]
    if unmatched:
        examples = ", ".join(repr(slot.name) for slot in slots[:3]) or "none: the model has no submodules"
        msg = (
            f"policy selector(s) {', '.join(unmatched)} match no submodule of {type(root).__name__}; names "
            f"are those of model.named_modules() (e.g. {examples})."
        )
        raise ValueError(msg)
    return rules


class _Step(NamedTuple):
    """One node to scope: where it is, its precision, whether it is a region, whether it is eager."""

    slot: _Slot
    precision: Fp32Precision
    region: bool
    eager: bool


def _region_of(rule: _Rule | None, in_graph: bool | None) -> bool:
    """Whether a node is an in-graph region.

    Its rule's own ``in_graph``, else scope_modules' argument, else a region.
    """
    if rule is not None and rule.in_graph is not None:
        return rule.in_graph
    if in_graph is not None:
        return in_graph
    return True


def _plan(root: torch.nn.Module, policy: object, in_graph: bool | None) -> list[_Step]:
    """What to scope: each slot, its precision, whether it is an in-graph region and eager, checked first."""
    slots = _walk(root)
    rules = _decide(root, slots, policy)
    decided = [
        (slot, rule.precision if rule is not None else None, rule is not None and rule.eager)
        for slot, rule in zip(slots, rules, strict=True)
    ]
    regions = {id(slot): _region_of(rule, in_graph) for slot, rule in zip(slots, rules, strict=True)}
    # One module in several places gets one decision.
    by_module: dict[int, tuple[str, Fp32Precision | None, bool]] = {}
    for slot, precision, eager in decided:
        first = by_module.setdefault(id(slot.stored), (slot.name, precision, eager))
        if first[1:] != (precision, eager):
            msg = (
                f"module {slot.name!r} is the same module as {first[0]!r}, but the policy gives them "
                f"different precisions ({_describe(precision, eager)} and {_describe(first[1], first[2])})."
            )
            raise ValueError(msg)
    plan: list[_Step] = []
    for slot, precision, eager in decided:
        if precision is None and not eager:
            continue
        if isinstance(slot.stored, Fp32ScopedModule):
            existing = precision_of(slot.stored)
            if existing == precision and slot.stored._self_eager == eager:
                continue
            msg = (
                f"module {slot.name!r} is scoped already with "
                f"{_describe(existing, slot.stored._self_eager)}; the policy gives it {_describe(precision, eager)}. "
                "Remove that wrapper first (fp32scope.unscope_modules(model)) or change the policy."
            )
            raise ValueError(msg)
        plan.append(_Step(slot, precision or Fp32Precision(), regions[id(slot)], eager))
    return plan


def _describe(precision: Fp32Precision | None, eager: bool) -> str:
    if not eager:
        return repr(precision)
    return "'eager'" if precision is None or precision.is_noop else f"{precision!r}, eager"


def scope_modules(
    model: torch.nn.Module,
    policy: Mapping[Any, Any] | None = None,
    *,
    autocast: bool | None = None,
    backward: bool = True,
    in_graph: bool | None = None,
) -> dict[str, Fp32Precision]:
    """Scope the selected submodules of ``model`` in place; returns {qualified name: precision}.

    Each selected submodule is replaced, in its parent, by an
    :class:`~fp32scope.Fp32ScopedModule` named by its qualified name (the name
    ``model.named_modules()`` gives it), so that every call of it runs in its precision;
    parameters, buffers, ``state_dict`` keys and their order stay as they were.

    ``policy`` maps selectors to precisions. A selector is a qualified name (exact match),
    ``"re:<pattern>"`` (``re.fullmatch`` on qualified names), a ``torch.nn.Module``
    subclass (``isinstance``), or a callable ``(name, module) -> bool``. Where several match
    one module, an exact name decides, then a pattern, then a class, then a callable; among
    selectors of one kind, the first in the mapping. A precision is an
    :class:`~fp32scope.Fp32Precision`, a matmul precision (``"highest"``, ``"high"``,
    ``"medium"``), or a mapping with the keys ``"matmul"`` and ``"cudnn_allow_tf32"`` (as
    loaded from JSON or TOML, which may also hold ``"in_graph"``: that rule's own
    ``in_graph``, and ``"eager": true``), or ``"eager"``: the node runs as eager runs it,
    never compiled, its flags as the caller has them (see ``eager`` on
    :class:`~fp32scope.Fp32ScopedModule`; such a node is an in-graph region unless its rule
    says ``"in_graph": false``, and reads ``Fp32Precision()`` in the result); None (or no
    field set, without ``"eager"``) leaves the modules it selects unscoped,
    which excludes them from a broader selector. With ``policy=None``, every submodule that
    declares a precision (the attributes :func:`~fp32scope.node_fp32_precision` reads) is
    scoped with it.

    Selecting a module and one inside it nests their scopes. A module scoped already with
    the same precision is left as it is (and not in the result); with another, a
    :class:`ValueError`. A ``torch.compile``'d model is walked through to the module it
    compiles. The root module cannot be replaced in place: wrap it with
    ``Fp32ScopedModule(model, precision)``.

    All or nothing: a bad selector or precision, a selector that matches no submodule, or a
    bad declaration raises :class:`TypeError` or :class:`ValueError` naming it before
    anything changes. ``backward`` and ``autocast`` (None: each module's own ``autocast``
    declaration, else keep the caller's autocast and warn for a full-float32 node; True;
    False: the node runs without the caller's autocast) are passed to each wrapper, and so
    is ``in_graph`` (True: under ``torch.compile`` each node is one region of the compiled
    parent's graph, no graph break; see the compiled guide; False: a graph break; None,
    the default: a region) where a rule gives none.
    Undo with :func:`unscope_modules`; list with :func:`scoped_modules`.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> scope_modules(model, {"1": "highest"})
    {'1': Fp32Precision(matmul='highest', cudnn_allow_tf32=None)}
    >>> unscope_modules(model)
    ['1']
    """
    root = _root(model)
    checked_autocast = check_autocast(autocast)
    check_backward(backward)
    if in_graph is not None:
        check_in_graph(in_graph)
    plan = _plan(root, policy, in_graph)
    options: dict[str, Any] = {"backward": backward, "autocast": checked_autocast}
    proxies: dict[int, Fp32ScopedModule] = {}
    for slot, precision, region, eager in plan:
        if id(slot.stored) not in proxies:
            proxies[id(slot.stored)] = Fp32ScopedModule(
                slot.stored, precision, name=slot.name, in_graph=region, eager=eager, **options
            )
    done: list[_Slot] = []
    try:
        for slot, _, _, _ in plan:
            setattr(slot.parent, slot.key, proxies[id(slot.stored)])
            done.append(slot)
    except BaseException:
        for slot in reversed(done):
            setattr(slot.parent, slot.key, slot.stored)
        raise
    return {step.slot.name: step.precision for step in plan}


def unscope_modules(model: torch.nn.Module) -> list[str]:
    """Put back the modules that :class:`~fp32scope.Fp32ScopedModule` wrappers hold, in place.

    Every wrapper below ``model`` (made by :func:`scope_modules` or by hand, nested ones
    included) is replaced in its parent by the module it wraps. Returns the qualified names,
    parents before children. The root itself is not unwrapped: it has no parent.
    """
    root = _root(model)
    names: list[str] = []
    for slot in _walk(root):
        if isinstance(slot.stored, Fp32ScopedModule):
            bare: torch.nn.Module = slot.stored
            while isinstance(bare, Fp32ScopedModule):
                bare = bare.__wrapped__
            setattr(slot.parent, slot.key, bare)
            names.append(slot.name)
    return names


def scoped_modules(model: torch.nn.Module) -> dict[str, Fp32Precision]:
    """The :class:`~fp32scope.Fp32ScopedModule` wrappers below ``model``: {qualified name: precision}.

    Wrappers made by :func:`scope_modules` and by hand are listed alike, parents before
    children; a wrapper made with no precision reads ``Fp32Precision()``.
    """
    root = _root(model)
    return {
        slot.name: precision_of(slot.stored) or Fp32Precision()
        for slot in _walk(root)
        if isinstance(slot.stored, Fp32ScopedModule)
    }
