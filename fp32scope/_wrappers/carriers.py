"""Objects an in-graph region carries across its op: Hugging Face's key-value caches, and plain objects.

A region's op takes tensors and constants only. A cache argument (transformers >= 5:
``DynamicCache`` and ``StaticCache`` of ``DynamicLayer``, ``DynamicSlidingWindowLayer``,
``StaticLayer`` and ``StaticSlidingWindowLayer`` layers, and ``EncoderDecoderCache`` of two
of those) crosses it as a marker tuple describing its state
(:func:`flatten`, traced by Dynamo): each carried object's attributes, listed per class in
:data:`_STATE`, walked recursively: tensors, constants, lists of carried objects (a cache's
layers), dicts of constants (an ``EncoderDecoderCache``'s ``is_updated``), nested carried
objects (its two caches), a class (a cache's ``layer_class_to_replicate``), and which
attributes are not set yet. The op's kernel builds a fresh object of the same classes
around the op's tensors (:func:`rebuild`), runs the node with it, and reports what the node
changed (:func:`changes`), each change by its path from the carried object: attributes
rebound to new tensors (a dynamic layer's ``torch.cat``, a static layer's first allocation)
leave the op as outputs, constants (``is_initialized``, ``device``, a static layer's sizes,
an ``is_updated`` entry) as the layout's constants, and an int the node moved by a fixed
step (a sliding layer's ``cumulative_length``, every decode step) as that step, added to the
caller's value (symbolic where Dynamo made it dynamic, so no recompile per step); :func:`write_back`, traced by Dynamo
after the op, sets them on the caller's object. Tensors the node updates in place (a static
layer's ``keys``, ``values`` and ``cumulative_length``) are the region's to write back
(``copy_``), but for the keys and values a compiled-inside graph writes where they are
(:func:`storage`); a cache that grows (``DynamicCache()`` adds a layer on its first update of
that layer) grows the caller's cache the same way.

Of transformers' cache module, the classes of :data:`_STATE` are carried, by name, and on
torch >= 2.13 any other layer class but the quantized ones, by its ``__dict__`` as a plain
object is (:func:`_generic_layer`); offloaded caches, quantized caches and layers and any
other class of it are refused (:func:`refusal` says why). Any other object whose state is its
``__dict__`` (a config, a dataclass, an object holding tensors: :func:`_why_object` says
which are not) is carried the same way, its attributes read from its ``__dict__`` (so
torch >= 2.13, whose Dynamo traces that) and its class named by :func:`_class_key`. Its
constants are constants of the graph, guarded by Dynamo: a change compiles again. An int
Dynamo made symbolic (it changed between calls) stays symbolic, as in plain torch; where
the node then does different things to the object for different values, Dynamo guards
the int and keeps a graph per branch, each op reading the plan of its own traced call
(``region/eager.py``). A float is read exactly, through ints, so that it stays a constant:
the op takes no symbolic float.

A ``StaticSlidingWindowLayer``'s update branches on its int length (filling, filling up,
full): one layout of its region's arguments, three plans of what the node does to the
cache, a graph per branch (Dynamo guards the int), each graph's op reading the plan its own
call's fake run found. transformers is never imported here (a cache exists only where it was).
"""

from __future__ import annotations

import enum
import sys
import types
from typing import Any, Final

import torch

from fp32scope._compat import DYNAMO_READS_OBJECT_DICTS, TORCH_RELEASE

__all__ = [
    "MARK",
    "can_carry",
    "changes",
    "flatten",
    "is_cache_class",
    "is_marker",
    "rebuild",
    "refusal",
    "storage",
    "tensors_of",
    "write_back",
]

MARK: Final = "fp32scope carrier"
_MODULE: Final = "transformers.cache_utils"
#: The classes a region carries as an argument: the caches.
_CACHES: Final = ("DynamicCache", "StaticCache", "EncoderDecoderCache")
_CACHE_STATE: Final = ("layers", "layer_class_to_replicate", "offloading")
_STATIC_STATE: Final = (
    "keys",
    "values",
    "cumulative_length",
    "is_initialized",
    "device",
    "max_cache_len",
    "batch_size",
    "num_heads",
    "k_head_dim",
    "v_head_dim",
)
#: Per carried class, the attributes its methods read or set (update, lazy initialisation,
#: lengths), in the order a marker holds them.
_STATE: Final = {
    "DynamicCache": _CACHE_STATE,
    "StaticCache": _CACHE_STATE,
    "EncoderDecoderCache": ("self_attention_cache", "cross_attention_cache", "is_updated"),
    "DynamicLayer": ("keys", "values", "is_initialized", "device"),
    "DynamicSlidingWindowLayer": (
        "keys",
        "values",
        "is_initialized",
        "device",
        "sliding_window",
        "cumulative_length",
        "_sliding_window_tensor",
        "record_past",
    ),
    "StaticLayer": _STATIC_STATE,
    # Its update branches on its int length (filling, filling up, full): a graph per branch,
    # each op reading its own call's plan (``Region.plans``).
    "StaticSlidingWindowLayer": (*_STATIC_STATE, "cumulative_length_int", "_is_croppable"),
}
#: The cache layers a region carries, as a refusal names them.
LAYERS: Final = "DynamicLayer, DynamicSlidingWindowLayer, StaticLayer and StaticSlidingWindowLayer"
#: The other cache layers a region carries (:func:`_generic_layer`), as a refusal names them.
OTHER_LAYERS: Final = "on torch >= 2.13 of any other layer class of transformers' cache module too"
#: What a region carries, as a refusal says it.
CARRIED: Final = (
    f"a region carries DynamicCache and StaticCache objects of {LAYERS} layers "
    f"(not offloaded, not quantized; {OTHER_LAYERS}), and EncoderDecoderCache objects of two of those"
)
#: What a region carries of other objects, as a refusal says it.
OBJECTS: Final = (
    "plain objects (a config, a dataclass) whose __dict__ holds tensors, constants, tuples, lists and dicts "
    "of those, and plain objects (torch >= 2.13)"
)
# A marker's descriptions: a tensor, an int or a constant as itself, anything else a tuple
# tagged by its first item.
_OBJECT: Final = "object"  # ("object", class key, (attribute names...), (attribute descriptions...))
_LIST: Final = "list"  # ("list", (item descriptions...))
_TUPLE: Final = "tuple"  # ("tuple", (item descriptions...))
_DICT: Final = "dict"  # ("dict", (keys...), (value descriptions...))
_CLASS: Final = "class"  # ("class", name)
_UNSET: Final = ("unset",)  # an attribute not set yet
_PLAIN: Final = (type(None), bool, int, float, str, torch.dtype, torch.device)
#: Values no object a region carries is: they cross the op as they are, or not at all.
_NOT_OBJECTS: Final = (torch.Tensor, torch.SymInt, torch.SymFloat, tuple, list, dict, *_PLAIN)
#: A plain object's class key starts with this; a cache's is its class name.
_PLAIN_KEY: Final = "object:"
#: How deep plain objects may nest in a carried one (a cycle would never end).
_DEPTH: Final = 4
_INF: Final = float("inf")
#: Plain objects' classes by key (:func:`_class_key`).
_CLASSES: dict[str, type] = {}


def _known(cls: type) -> bool:
    return cls.__module__ == _MODULE and cls.__name__ in _STATE


def _generic_layer(cls: type) -> bool:
    """Whether ``cls`` is a layer of transformers' cache module carried by its ``__dict__``, as a plain object is.

    Any layer class but those of :data:`_STATE` (named there, for torch before 2.13) and
    the quantized ones (their state is a quantization library's): an indexed layer, a
    linear-attention layer, a hybrid of those, and next release's. Dynamo inlines this.
    """
    name = cls.__name__
    return (
        DYNAMO_READS_OBJECT_DICTS
        and cls.__module__ == _MODULE
        and name.endswith("Layer")
        and name not in _STATE
        and "Quantized" not in name
    )


def is_cache_class(cls: type) -> bool:
    """Whether ``cls`` is one of the cache classes a region carries (a node's own cache, refused in its output)."""
    return cls.__module__ == _MODULE and cls.__name__ in _CACHES


def _why(value: Any) -> str:
    """Why a region does not carry ``value``, an object of transformers' cache module, as a predicate; "" where it does.

    ("offloads its layers", "holds QuantizedLayer layers", ...: :func:`refusal` says of what.)
    Dynamo inlines this (class names and attributes it reads as constants, and guards).
    """
    name = type(value).__name__
    if name not in _STATE:
        return "is not carried"
    if getattr(value, "offloading", False):
        return "offloads its layers"
    replicate = getattr(value, "layer_class_to_replicate", None)
    if replicate is not None and replicate.__name__ != "DynamicLayer":
        return f"adds {replicate.__name__} layers"
    for field in _STATE[name]:
        if field not in ("layer_class_to_replicate", "offloading"):
            found = _why_value(field, getattr(value, field, None))
            if found:
                return found
    return ""


def _why_value(field: str, value: Any) -> str:  # noqa: PLR0911  (a return per reason)
    """Why a region does not carry ``value``, a carried object's ``field``, as a predicate; "" where it does."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return ""
    if isinstance(value, list):
        for item in value:
            found = _why_listed(field, item)
            if found:
                return found
        return ""
    if isinstance(value, dict):
        for item in value.values():
            if not isinstance(item, _PLAIN):
                return f"holds {type(item).__name__} values in its {field}"
        return ""
    if type(value).__module__ == _MODULE:
        found = _why(value)
        return f"has a {field} ({type(value).__name__}) that {found}" if found else ""
    return f"holds a {type(value).__name__} in its {field}"


def _why_listed(field: str, item: Any) -> str:
    """Why a region does not carry ``item`` of a carried object's list ``field`` (a cache's layers); "" if it does."""
    kind = type(item).__name__
    if _generic_layer(type(item)):
        found = _why_object(item, 1)
    elif _known(type(item)):
        found = _why(item)
    else:
        return f"holds {kind} layers" if field == "layers" else f"holds {kind} objects in its {field}"
    return f"holds a {kind} that {found}" if found else ""


def can_carry(value: object) -> bool:
    """Whether a region carries ``value``: a cache of :data:`_CACHES` whose state it carries, or a plain object.

    Dynamo inlines this (class names and attributes it reads as constants, and guards).
    """
    # Tensors, constants and containers first: torch 2.4's Dynamo cannot compare a builtin
    # type's ``__module__``.
    if isinstance(value, _NOT_OBJECTS):
        return False
    cls = type(value)
    if cls.__module__ == _MODULE:
        return cls.__name__ in _CACHES and not _why(value)
    return not _why_object(value, 0)


def refusal(value: object) -> str:
    """Why a region does not carry ``value``, an object, in words; "" for a tensor, constant or container.

    Dynamo inlines this where a call cannot be a region (its words are constants of the trace).
    """
    if isinstance(value, _NOT_OBJECTS):
        return ""
    cls = type(value)
    if cls.__module__ != _MODULE:
        found = _why_object(value, 0)
        return f"this {cls.__name__} {found} (a region carries {OBJECTS})" if found else ""
    if cls.__name__ not in _CACHES:
        return f"{cls.__name__} is not carried ({CARRIED})"
    found = _why(value)
    return f"this {cls.__name__} {found} ({CARRIED})" if found else ""


def _why_object(value: Any, depth: int) -> str:  # noqa: PLR0911  (a return per reason)
    """Why a region does not carry ``value``, a plain object, as a predicate; "" where it does.

    Dynamo inlines this (what it reads of the object are constants of the trace, and guards).
    """
    if not DYNAMO_READS_OBJECT_DICTS:
        return f"is an object, which a region carries on torch >= 2.13 only (this is torch {TORCH_RELEASE})"
    if isinstance(value, torch.nn.Module):
        return "is a module (make it a submodule of the node, or pass its tensors)"
    if isinstance(value, (type, enum.Enum, types.ModuleType)) or callable(value):
        return "is a class, a function, a module or an enum member (a region carries none)"
    if not hasattr(value, "__dict__"):
        return "keeps its state outside a __dict__ (__slots__, or a C type)"
    if isinstance(value, (set, frozenset, bytes, bytearray, complex)):
        return "subclasses a builtin type"
    for field, item in value.__dict__.items():
        found = _why_item(field, item, depth)
        if found:
            return found
    return ""


def _why_item(field: str, item: Any, depth: int) -> str:  # noqa: C901, PLR0911  (a return per reason)
    """Why a region does not carry ``item`` (a plain object's ``field``, or in it), as a predicate; "" where it does."""
    if isinstance(item, torch.SymFloat):
        return (
            f"holds a float in its {field!r} that changed between calls, which torch.compile made symbolic "
            "(a region carries an object's floats as constants: set torch._dynamo.config.specialize_float = True, "
            "a graph per value, or hold the value in a tensor)"
        )
    if isinstance(item, (torch.Tensor, torch.SymInt, *_PLAIN)):
        return ""
    if isinstance(item, (list, tuple)):
        for part in item:
            found = _why_item(field, part, depth)
            if found:
                return found
        return ""
    if isinstance(item, dict):
        for key, part in item.items():
            if not isinstance(key, (str, int)):
                return f"holds a dict with a key that is not a str or an int in its {field!r}"
            found = _why_item(field, part, depth)
            if found:
                return found
        return ""
    kind = type(item).__name__
    if isinstance(item, _NOT_OBJECTS) or type(item).__module__ == _MODULE:
        return f"holds a {kind} in its {field!r} (pass it as an argument of its own)"
    if depth >= _DEPTH:
        return f"nests objects deeper than {_DEPTH} levels (in its {field!r})"
    found = _why_object(item, depth + 1)
    return f"holds a {kind} in its {field!r} that {found}" if found else ""


def _class_key(cls: type) -> str:
    """A plain object's class as a marker names it: the same in every process, one class per key in this one.

    Dynamo calls this while it traces (its result a constant) rather than inlining it.
    """
    key = f"{_PLAIN_KEY}{cls.__module__}.{cls.__qualname__}"
    found, n = key, 0
    while _CLASSES.setdefault(found, cls) is not cls:  # two classes of one name (made by one function twice)
        n += 1
        found = f"{key}#{n}"
    return found


# torch._dynamo.assume_constant_result's mark, set without importing Dynamo.
_class_key._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _describe(value: Any) -> Any:  # noqa: PLR0911  (a return per kind)
    # Dynamo inlines this while it traces the node's call, and guards on the constants.
    # (value == value: not NaN; Dynamo cannot trace math.isnan of a symbolic float)
    if isinstance(value, float) and value == value and value not in (_INF, -_INF):  # noqa: PLR0124
        # Its exact value, read through ints: a guard on it (a recompile per value), where
        # Dynamo would make a float that changed between calls symbolic, which the op cannot take.
        numerator, denominator = value.as_integer_ratio()
        return numerator / denominator
    if isinstance(value, (torch.Tensor, torch.SymInt, *_PLAIN)):
        return value
    if isinstance(value, list):
        return (_LIST, tuple(_describe(item) for item in value))
    if isinstance(value, tuple):
        return (_TUPLE, tuple(_describe(item) for item in value))
    if isinstance(value, dict):
        return (_DICT, tuple(value.keys()), tuple(_describe(item) for item in value.values()))
    if isinstance(value, type):
        return (_CLASS, value.__name__)
    cls = type(value)
    if cls.__module__ != _MODULE or _generic_layer(cls):
        fields = tuple(value.__dict__)
        return (_OBJECT, _class_key(cls), fields, tuple(_describe(value.__dict__[f]) for f in fields))
    name = cls.__name__
    return (
        _OBJECT,
        name,
        _STATE[name],
        tuple(_describe(getattr(value, field)) if hasattr(value, field) else _UNSET for field in _STATE[name]),
    )


def flatten(value: Any) -> tuple[Any, ...]:
    """A carried object as the op takes it: ``(MARK, description)``, its state's tensors and constants.

    Dynamo inlines this while it traces the node's call, and guards on the constants.
    """
    return (MARK, _describe(value))


def is_marker(value: object) -> bool:
    """Whether ``value`` is a cache as :func:`flatten` made it (or as the op's kernel rebuilt it)."""
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and value[0] == MARK


def _tag(description: Any) -> Any:
    return description[0] if isinstance(description, tuple) else None


def _is_plain(description: Any) -> bool:
    # An object description of a plain object (not a cache).
    return str(description[1]).startswith(_PLAIN_KEY)


_STORAGE: Final = ("keys", "values")


def storage(marker: tuple[Any, ...]) -> list[bool]:
    """For each tensor of a marker, in order: whether it is a cache layer's keys or values.

    Those are the cache's storage, which transformers' models read only in their attentions:
    a region may update them where they are. Anything else (a static layer's ``cumulative_length``, which a model
    reads for its mask before its layers run; a plain object's tensors) leaves the op as a new tensor.
    """
    found: list[bool] = []
    _storage(marker[1], "", found)
    return found


def _storage(description: Any, field: str, found: list[bool]) -> None:
    # In the order torch's pytree flattens the marker (its tensors, depth first).
    if isinstance(description, torch.Tensor):
        found.append(field in _STORAGE)
    elif _tag(description) == _OBJECT:
        plain = _is_plain(description)
        for name, item in zip(description[2], description[3], strict=True):
            _storage(item, "" if plain else name, found)
    elif _tag(description) in (_LIST, _TUPLE):
        for item in description[1]:
            _storage(item, field, found)
    elif _tag(description) == _DICT:
        for item in description[2]:
            _storage(item, "", found)


def rebuild(marker: tuple[Any, ...]) -> Any:
    """A fresh object of the marker's classes holding its tensors (in the op's kernel, real or fake)."""
    return _build(sys.modules.get(_MODULE), marker[1])


def _build(module: Any, description: Any) -> Any:  # noqa: PLR0911  (a return per kind)
    tag = _tag(description)
    if tag == _OBJECT:
        if _is_plain(description):
            built: Any = object.__new__(_CLASSES[description[1]])
            # (its __dict__ as it was: a frozen dataclass's __setattr__ would refuse)
            built.__dict__.update(
                (field, _build(module, item)) for field, item in zip(description[2], description[3], strict=True)
            )
            return built
        built = object.__new__(getattr(module, description[1]))
        for field, item in zip(description[2], description[3], strict=True):
            if _tag(item) != _UNSET[0]:  # an attribute not set yet stays unset
                setattr(built, field, _build(module, item))
        return built
    if tag == _LIST:
        return [_build(module, item) for item in description[1]]
    if tag == _TUPLE:
        return tuple(_build(module, item) for item in description[1])
    if tag == _DICT:
        return dict(zip(description[1], (_build(module, item) for item in description[2]), strict=True))
    if tag == _CLASS:
        return getattr(module, description[1])
    return description


#: A step of a path from a carried object: an attribute's name, ``("index", i)`` (a list's
#: item) or ``("item", key)`` (a dict's entry).
Step = Any
Change = tuple[
    tuple[Step, ...], Step, bool, Any
]  # (path to the owner, step, is a tensor, the constant or output index)
_ABSENT: Final = object()
_DELTA: Final = "delta"  # a changed int written back as the caller's value plus a step: (_DELTA, step)
_CONSTANT: Final = "constant"  # a changed constant, written back as it is: (_CONSTANT, value)


def changes(marker: tuple[Any, ...], obj: Any, first: int) -> tuple[tuple[Change, ...], list[torch.Tensor]]:
    """What the node changed on a rebuilt object: the changes, and the tensors newly bound.

    A tensor attribute still holding the tensor it had (updated in place or not) is no
    change; a new one is, numbered from ``first`` among the op's carried outputs.
    """
    found: list[Change] = []
    tensors: list[torch.Tensor] = []
    _diff_object(marker[1], obj, (), found, tensors, first)
    return tuple(found), tensors


def _diff_object(  # noqa: PLR0913, PLR0917  (the walk's state)
    old: Any, obj: Any, path: tuple[Step, ...], found: list[Change], tensors: list[torch.Tensor], first: int
) -> None:
    if old is not None and _is_plain(old):
        # Its attributes as they were, then any the node added.
        before = dict(zip(old[2], old[3], strict=True))
        state = obj.__dict__
        for field in (*old[2], *(f for f in state if f not in before)):
            _diff(before.get(field, _UNSET), state.get(field, _ABSENT), path, field, found, tensors, first)
        return
    name = type(obj).__name__
    if not _known(type(obj)):
        msg = f"A scoped node added a {name} to a Hugging Face cache inside a compiled graph (not carried)."
        raise RuntimeError(msg)
    before_items = old[3] if old is not None else (_UNSET,) * len(_STATE[name])
    for field, was in zip(_STATE[name], before_items, strict=True):
        _diff(was, getattr(obj, field, _ABSENT), path, field, found, tensors, first)


def _same_class(old: Any, new: Any) -> bool:
    if _is_plain(old):
        return _CLASSES.get(old[1]) is type(new)
    return bool(type(new).__name__ == old[1])


def _diff(  # noqa: PLR0913, PLR0917  (the walk's state)
    old: Any,
    new: Any,
    path: tuple[Step, ...],
    step: Step,
    found: list[Change],
    tensors: list[torch.Tensor],
    first: int,
) -> None:
    tag = _tag(old)
    if isinstance(new, torch.Tensor):
        if new is not old:
            found.append((path, step, True, first + len(tensors)))
            tensors.append(new)
    elif tag == _OBJECT and _same_class(old, new):
        _diff_object(old, new, (*path, step), found, tensors, first)
    elif tag == _LIST and isinstance(new, list):
        _diff_list(old, new, (*path, step), found, tensors, first)
    elif tag == _TUPLE and isinstance(new, tuple):
        _diff_tuple(old, new, path, step, found, tensors, first)
    elif tag == _DICT and isinstance(new, dict):
        _diff_dict(old, new, (*path, step), found, tensors, first)
    elif not (tag == _CLASS and isinstance(new, type) and new.__name__ == old[1]):
        _diff_constant(old, new, path, step, found)


def _diff_tuple(  # noqa: PLR0913, PLR0917  (the walk's state)
    old: Any,
    new: tuple[Any, ...],
    path: tuple[Step, ...],
    step: Step,
    found: list[Change],
    tensors: list[torch.Tensor],
    first: int,
) -> None:
    items = old[1]
    if len(new) == len(items) and not any(_replaced(was, item) for was, item in zip(items, new, strict=True)):
        # The tuple it was given: what changed is inside its mutable items.
        for index, (was, item) in enumerate(zip(items, new, strict=True)):
            if _tag(was) in (_OBJECT, _LIST, _TUPLE, _DICT):
                _diff(was, item, (*path, step), ("index", index), found, tensors, first)
    elif all(isinstance(item, _PLAIN) for item in new):  # a tuple of constants bound anew
        found.append((path, step, False, (_CONSTANT, new)))
    else:
        msg = f"A scoped node set {step!r} of an object it was given to a new tuple of tensors or objects."
        raise RuntimeError(msg)


def _replaced(old: Any, new: Any) -> bool:
    """Whether ``new`` is not the item ``old`` describes (so that its tuple was bound anew)."""
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        return new is not old
    tag = _tag(old)
    if tag == _OBJECT:
        return not _same_class(old, new)
    if tag in (_LIST, _TUPLE, _DICT):
        return not isinstance(new, {_LIST: list, _TUPLE: tuple, _DICT: dict}[tag])
    if tag == _CLASS:
        return not (isinstance(new, type) and new.__name__ == old[1])
    return type(new) is not type(old) or new != old


def _diff_list(  # noqa: PLR0913, PLR0917  (the walk's state)
    old: Any, new: list[Any], path: tuple[Step, ...], found: list[Change], tensors: list[torch.Tensor], first: int
) -> None:
    if len(new) < len(old[1]):
        msg = "A scoped node removed items from a list of an object it was given inside a compiled graph (not carried)."
        raise RuntimeError(msg)
    for index, item in enumerate(new):
        if index < len(old[1]):
            _diff(old[1][index], item, path, ("index", index), found, tensors, first)
        elif _known(type(item)):  # a layer added: a cache grown, each of the layer's attributes a change
            _diff_object(None, item, (*path, ("index", index)), found, tensors, first)
        else:
            msg = "A scoped node added items to a list of an object it was given inside a compiled graph (not carried)."
            raise RuntimeError(msg)


def _diff_dict(  # noqa: PLR0913, PLR0917  (the walk's state)
    old: Any, new: dict[Any, Any], path: tuple[Step, ...], found: list[Change], tensors: list[torch.Tensor], first: int
) -> None:
    entries = dict(zip(old[1], old[2], strict=True))
    if any(key not in new for key in entries):
        msg = (
            "A scoped node removed entries from a dict of an object it was given inside a compiled graph (not carried)."
        )
        raise RuntimeError(msg)
    for key, value in new.items():
        _diff(entries.get(key, _UNSET), value, path, ("item", key), found, tensors, first)


def _diff_constant(old: Any, new: Any, path: tuple[Step, ...], step: Step, found: list[Change]) -> None:
    if isinstance(new, (torch.SymBool, torch.SymFloat)):
        # Computed from an int Dynamo made symbolic: specialise it (a guard), as the
        # attribute holds a plain value.
        new = bool(new) if isinstance(new, torch.SymBool) else float(new)
    if new is _ABSENT:
        if _tag(old) != _UNSET[0]:
            msg = f"A scoped node deleted {step!r} of an object it was given inside a compiled graph (not carried)."
            raise RuntimeError(msg)
    elif not isinstance(new, (torch.SymInt, *_PLAIN)):
        msg = f"A scoped node set {step!r} of an object it was given to a {type(new).__name__} (not carried)."
        raise RuntimeError(msg)
    elif type(new) is not type(old) or new != old:
        delta = _delta(old, new)
        if delta is not None:
            # A count the node moved by a fixed step (a sliding layer's cumulative_length):
            # written back as the caller's value plus the step, which stays symbolic where
            # Dynamo made the count dynamic (a constant would guard, a recompile per step).
            found.append((path, step, False, (_DELTA, delta)))
        else:
            # A size the fake run computed symbolically is still a size of this call's
            # tensors: specialise it (a guard), as the attribute holds a plain int.
            found.append((path, step, False, (_CONSTANT, int(new) if isinstance(new, torch.SymInt) else new)))


def _delta(old: Any, new: Any) -> int | None:
    """``new - old`` where both are ints (or symbolic ones) and it is a plain int; else None."""
    ints = (int, torch.SymInt)
    if not isinstance(old, ints) or not isinstance(new, ints) or isinstance(old, bool) or isinstance(new, bool):
        return None
    step = new - old
    if isinstance(step, torch.SymInt):
        expr = step.node.expr
        if not expr.is_number:  # (it depends on a size of this call: no fixed step)
            return None
        return int(expr)
    return step


def _walk(obj: Any, path: tuple[Step, ...], *, grow: bool = False) -> Any:
    """The object at ``path`` from ``obj``; traced by Dynamo in :func:`write_back`."""
    owner = obj
    for step in path:
        if isinstance(step, str):
            owner, obj = obj, getattr(obj, step)
        else:
            kind, index = step  # ("index", i) of a list or tuple, ("item", key) of a dict
            while grow and kind == "index" and len(obj) <= index:  # a DynamicCache() grows by a layer
                obj.append(owner.layer_class_to_replicate())
            owner, obj = obj, obj[index]
    return obj


def _get(owner: Any, step: Step) -> Any:
    return getattr(owner, step) if isinstance(step, str) else owner[step[1]]


def tensors_of(obj: Any, found: tuple[Change, ...]) -> list[torch.Tensor]:
    """The tensors :func:`changes` found newly bound, read again by their places (a real run)."""
    return [_get(_walk(obj, path), step) for path, step, is_tensor, _ in found if is_tensor]


def write_back(obj: Any, found: tuple[Change, ...], tensors: list[torch.Tensor]) -> None:
    """Set what the node changed on the caller's object (traced by Dynamo after the op)."""
    for path, step, is_tensor, value in found:
        owner = _walk(obj, path, grow=True)
        if is_tensor:
            new = tensors[value]
        elif value[0] == _DELTA:
            new = _get(owner, step) + value[1]
        else:
            new = value[1]
        if isinstance(step, str):
            setattr(owner, step, new)
        else:
            owner[step[1]] = new
