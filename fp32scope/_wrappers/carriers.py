"""Objects an in-graph region carries across its op: Hugging Face's key-value caches.

A region's op takes tensors and constants only. A cache argument (transformers >= 5:
``DynamicCache`` and ``StaticCache`` of ``DynamicLayer``, ``DynamicSlidingWindowLayer`` and
``StaticLayer`` layers, and ``EncoderDecoderCache`` of two of those) crosses it as a marker tuple describing its state
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

Only the classes of :data:`_STATE` are carried, by name; offloaded caches, quantized caches
and layers, static sliding-window layers and any other class are refused (:func:`refusal`
says why). A ``StaticSlidingWindowLayer``'s update branches on its int length (full or not):
its region's layout is the same both ways while what the node does to the cache (the plan
a graph's op reads at run time) is not, so a graph kept for one branch would read the
other's plan. transformers is never imported here (a cache exists only where it was).
"""

from __future__ import annotations

import sys
from typing import Any, Final

import torch

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
    "StaticLayer": (
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
    ),
}
#: What a region carries, as a refusal says it.
CARRIED: Final = (
    "a region carries DynamicCache and StaticCache objects of DynamicLayer, DynamicSlidingWindowLayer and "
    "StaticLayer layers "
    "(not offloaded, not quantized), and EncoderDecoderCache objects of two of those"
)
# A marker's descriptions: a tensor or a constant as itself, anything else a tuple tagged
# by its first item.
_OBJECT: Final = "object"  # ("object", class name, (attribute descriptions...))
_LIST: Final = "list"  # ("list", (item descriptions...))
_DICT: Final = "dict"  # ("dict", (keys...), (value descriptions...))
_CLASS: Final = "class"  # ("class", name)
_UNSET: Final = ("unset",)  # an attribute not set yet
_PLAIN: Final = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _known(cls: type) -> bool:
    return cls.__module__ == _MODULE and cls.__name__ in _STATE


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
            kind = type(item).__name__
            if not _known(type(item)):
                return f"holds {kind} layers" if field == "layers" else f"holds {kind} objects in its {field}"
            found = _why(item)
            if found:
                return f"holds a {kind} that {found}"
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


def can_carry(value: object) -> bool:
    """Whether a region carries ``value``: a cache of :data:`_CACHES` whose state it carries.

    Dynamo inlines this (class names and attributes it reads as constants, and guards).
    """
    # Tensors, constants and containers first: torch 2.4's Dynamo cannot compare a builtin
    # type's ``__module__``.
    if isinstance(value, (torch.Tensor, tuple, list, dict, type(None), bool, int, float, str)):
        return False
    cls = type(value)
    if cls.__module__ != _MODULE or cls.__name__ not in _CACHES:
        return False
    return not _why(value)


def refusal(value: object) -> str:
    """Why a region does not carry ``value``, a Hugging Face cache, in words; "" for any other object.

    Dynamo inlines this where a call cannot be a region (its words are constants of the trace).
    """
    if isinstance(value, (torch.Tensor, tuple, list, dict, type(None), bool, int, float, str)):
        return ""
    cls = type(value)
    if cls.__module__ != _MODULE:
        return ""
    if cls.__name__ not in _CACHES:
        return f"{cls.__name__} is not carried ({CARRIED})"
    found = _why(value)
    return f"this {cls.__name__} {found} ({CARRIED})" if found else ""


def _describe(value: Any) -> Any:
    # Dynamo inlines this while it traces the node's call, and guards on the constants.
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return value
    if isinstance(value, list):
        return (_LIST, tuple(_describe(item) for item in value))
    if isinstance(value, dict):
        return (_DICT, tuple(value.keys()), tuple(value.values()))
    if isinstance(value, type):
        return (_CLASS, value.__name__)
    name = type(value).__name__
    return (
        _OBJECT,
        name,
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


_STORAGE: Final = ("keys", "values")


def storage(marker: tuple[Any, ...]) -> list[bool]:
    """For each tensor of a marker, in order: whether it is a layer's keys or values.

    Those are the cache's storage, which transformers' models read only in their attentions:
    a region may update them where they are. Anything else (a static layer's ``cumulative_length``, which a model
    reads for its mask before its layers run) leaves the op as a new tensor.
    """
    found: list[bool] = []
    _storage(marker[1], "", found)
    return found


def _storage(description: Any, field: str, found: list[bool]) -> None:
    # In the order torch's pytree flattens the marker (its tensors, depth first).
    if isinstance(description, torch.Tensor):
        found.append(field in _STORAGE)
    elif _tag(description) == _OBJECT:
        for name, item in zip(_STATE[description[1]], description[2], strict=True):
            _storage(item, name, found)
    elif _tag(description) == _LIST:
        for item in description[1]:
            _storage(item, field, found)


def rebuild(marker: tuple[Any, ...]) -> Any:
    """A fresh object of the marker's classes holding its tensors (in the op's kernel, real or fake)."""
    return _build(sys.modules[_MODULE], marker[1])


def _build(module: Any, description: Any) -> Any:
    tag = _tag(description)
    if tag == _OBJECT:
        built = object.__new__(getattr(module, description[1]))
        for field, item in zip(_STATE[description[1]], description[2], strict=True):
            if _tag(item) != _UNSET[0]:  # an attribute not set yet stays unset
                setattr(built, field, _build(module, item))
        return built
    if tag == _LIST:
        return [_build(module, item) for item in description[1]]
    if tag == _DICT:
        return dict(zip(description[1], description[2], strict=True))
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
    name = type(obj).__name__
    if not _known(type(obj)):
        msg = f"A scoped node added a {name} to a Hugging Face cache inside a compiled graph (not carried)."
        raise RuntimeError(msg)
    before = old[2] if old is not None else (_UNSET,) * len(_STATE[name])
    for field, was in zip(_STATE[name], before, strict=True):
        _diff(was, getattr(obj, field, _ABSENT), path, field, found, tensors, first)


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
    elif tag == _OBJECT and type(new).__name__ == old[1]:
        _diff_object(old, new, (*path, step), found, tensors, first)
    elif tag == _LIST and isinstance(new, list):
        if len(new) < len(old[1]):
            msg = "A scoped node removed layers from a Hugging Face cache it was given inside a compiled graph."
            raise RuntimeError(msg)
        for index, item in enumerate(new):
            # (an item added: a layer grown, each of its attributes a change)
            before = old[1][index] if index < len(old[1]) else None
            _diff_object(before, item, (*path, step, ("index", index)), found, tensors, first)
    elif tag == _DICT and isinstance(new, dict):
        _diff_dict(old, new, (*path, step), found)
    elif not (tag == _CLASS and isinstance(new, type) and new.__name__ == old[1]):
        _diff_constant(old, new, path, step, found)


def _diff_dict(old: Any, new: dict[Any, Any], path: tuple[Step, ...], found: list[Change]) -> None:
    entries = dict(zip(old[1], old[2], strict=True))  # (constants only: can_carry refuses any other value)
    if any(key not in new for key in entries):
        msg = "A scoped node removed entries from a Hugging Face cache's dict inside a compiled graph."
        raise RuntimeError(msg)
    for key, value in new.items():
        _diff_constant(entries.get(key, _UNSET), value, path, ("item", key), found)


def _diff_constant(old: Any, new: Any, path: tuple[Step, ...], step: Step, found: list[Change]) -> None:
    if new is _ABSENT:
        if _tag(old) != _UNSET[0]:
            msg = f"A scoped node deleted a Hugging Face cache's {step!r} inside a compiled graph (not carried)."
            raise RuntimeError(msg)
    elif not isinstance(new, (torch.SymInt, *_PLAIN)):
        msg = f"A scoped node set a Hugging Face cache's {step!r} to a {type(new).__name__} inside a compiled graph."
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
            found.append((path, step, False, int(new) if isinstance(new, torch.SymInt) else new))


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
            _, index = step
            while grow and len(obj) <= index:  # a DynamicCache() grows by a layer on its first update of it
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
        elif isinstance(value, tuple):  # (_DELTA, step)
            new = _get(owner, step) + value[1]
        else:
            new = value
        if isinstance(step, str):
            setattr(owner, step, new)
        else:
            owner[step[1]] = new
