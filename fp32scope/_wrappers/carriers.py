"""Objects an in-graph region carries across its op: Hugging Face's key-value caches.

A region's op takes tensors and constants only. A cache argument (transformers >= 5:
``DynamicCache`` of ``DynamicLayer``, ``StaticCache`` of ``StaticLayer``) crosses it as a
marker tuple of its state, constants and tensors (:func:`flatten`, traced by Dynamo); the
op's kernel builds a fresh cache of the same classes around the op's tensors
(:func:`rebuild`), runs the node with it, and reports what the node changed
(:func:`changes`): attributes rebound to new tensors (a dynamic layer's ``torch.cat``, a
static layer's first allocation) leave the op as outputs, constants (``is_initialized``,
``device``, a static layer's sizes) as the layout's constants; :func:`write_back`, traced
by Dynamo after the op, sets them on the caller's cache. Tensors the node updates in place
(a static layer's ``keys``, ``values`` and ``cumulative_length``) are the region's to write
back (``copy_``), but for the keys and values a compiled-inside graph writes where they are
(:func:`storage`); a cache that grows (``DynamicCache()`` adds a layer on its first update of
that layer) grows the caller's cache the same way.

Only these exact classes are carried, by name, each with the attributes its methods read,
listed below; transformers is never imported here (a cache exists only where it was).
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
    "write_back",
]

MARK: Final = "fp32scope carrier"
_MODULE: Final = "transformers.cache_utils"
_CACHES: Final = ("DynamicCache", "StaticCache")
# Per layer class, the attributes its update, lazy initialisation and length methods read
# or set, in the order a marker holds them (tensors, or constants; None where not set yet).
_FIELDS: Final = {
    "DynamicLayer": ("keys", "values", "is_initialized", "device"),
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
_ALWAYS: Final = ("keys", "values", "is_initialized")  # set by every layer's __init__, None or not


def _known(cls: type) -> bool:
    return cls.__module__ == _MODULE and cls.__name__ in _FIELDS


def is_cache_class(cls: type) -> bool:
    """Whether ``cls`` is one of the cache classes a region carries (a node's own cache, refused in its output)."""
    return cls.__module__ == _MODULE and cls.__name__ in _CACHES


def can_carry(value: object) -> bool:
    """Whether a region carries ``value``: a dynamic or static cache of plain layers, not offloaded.

    Dynamo inlines this (class names and attributes it reads as constants, and guards).
    """
    # Tensors, constants and containers first: torch 2.4's Dynamo cannot compare a builtin
    # type's ``__module__``.
    if isinstance(value, (torch.Tensor, tuple, list, dict, type(None), bool, int, float, str)):
        return False
    cls = type(value)
    if cls.__module__ != _MODULE or cls.__name__ not in _CACHES:
        return False
    replicate = getattr(value, "layer_class_to_replicate", None)
    if getattr(value, "offloading", True) or (replicate is not None and replicate.__name__ != "DynamicLayer"):
        return False
    return all(_known(type(layer)) for layer in getattr(value, "layers", ()))


def refusal(value: object) -> str:  # noqa: PLR0911  (a return per reason)
    """Why a region does not carry ``value``, a Hugging Face cache, in words; "" for any other object.

    Dynamo inlines this where a call cannot be a region (its words are constants of the trace).
    """
    if isinstance(value, (torch.Tensor, tuple, list, dict, type(None), bool, int, float, str)):
        return ""
    cls = type(value)
    if cls.__module__ != _MODULE:
        return ""
    carried = "a region carries DynamicCache and StaticCache objects of DynamicLayer and StaticLayer layers"
    if cls.__name__ not in _CACHES:
        return f"{cls.__name__} is not carried ({carried})"
    if getattr(value, "offloading", True):
        return f"this {cls.__name__} offloads its layers ({carried}, not offloaded)"
    replicate = getattr(value, "layer_class_to_replicate", None)
    if replicate is not None and replicate.__name__ != "DynamicLayer":
        return f"this {cls.__name__} adds {replicate.__name__} layers ({carried})"
    for layer in getattr(value, "layers", ()):
        if not _known(type(layer)):
            return f"this {cls.__name__} holds {type(layer).__name__} layers ({carried})"
    return ""


def flatten(value: Any) -> tuple[Any, ...]:
    """A carried cache as the op takes it: ``(MARK, class, replicated layer class, layers)``.

    Each layer is ``(class, *fields)``, its attributes' tensors and constants. Dynamo
    inlines this while it traces the node's call, and guards on the constants.
    """
    replicate = value.layer_class_to_replicate
    layers = tuple(
        (type(layer).__name__, *(getattr(layer, field, None) for field in _FIELDS[type(layer).__name__]))
        for layer in value.layers
    )
    return (MARK, type(value).__name__, None if replicate is None else replicate.__name__, layers)


def is_marker(value: object) -> bool:
    """Whether ``value`` is a cache as :func:`flatten` made it (or as the op's kernel rebuilt it)."""
    return isinstance(value, tuple) and len(value) == 4 and isinstance(value[0], str) and value[0] == MARK


_STORAGE: Final = ("keys", "values")


def storage(marker: tuple[Any, ...]) -> list[bool]:
    """For each tensor of a marker, in order: whether it is a layer's keys or values.

    Those are the cache's storage, which transformers' models read only in their attentions:
    a region may update them where they are. Anything else (a static layer's ``cumulative_length``, which a model
    reads for its mask before its layers run) leaves the op as a new tensor.
    """
    _, _, _, layers = marker
    return [
        field in _STORAGE
        for name, *values in layers
        for field, value in zip(_FIELDS[name], values, strict=True)
        if isinstance(value, torch.Tensor)
    ]


def rebuild(marker: tuple[Any, ...]) -> Any:
    """A fresh cache of the marker's classes holding its tensors (in the op's kernel, real or fake)."""
    module = sys.modules[_MODULE]
    _, cache_name, replicate, layers = marker
    cache = object.__new__(getattr(module, cache_name))
    cache.layers = [_layer(module, entry) for entry in layers]
    cache.layer_class_to_replicate = None if replicate is None else getattr(module, replicate)
    cache.offloading = False
    return cache


def _layer(module: Any, entry: tuple[Any, ...]) -> Any:
    name, *values = entry
    layer = object.__new__(getattr(module, name))
    for field, value in zip(_FIELDS[name], values, strict=True):
        if value is not None or field in _ALWAYS:  # an attribute not set yet stays unset
            setattr(layer, field, value)
    return layer


Change = tuple[int, str, bool, Any]  # (layer, attribute, is a tensor, the constant or the tensor's output index)


def changes(marker: tuple[Any, ...], cache: Any, first: int) -> tuple[tuple[Change, ...], list[torch.Tensor]]:
    """What the node changed on a rebuilt cache: the changes, and the tensors newly bound.

    A tensor attribute still holding the tensor it had (updated in place or not) is no
    change; a new one is, numbered from ``first`` among the op's carried outputs.
    """
    _, _, _, layers = marker
    if len(cache.layers) < len(layers):
        msg = "A scoped node removed layers from a Hugging Face cache it was given inside a compiled graph."
        raise RuntimeError(msg)
    found: list[Change] = []
    tensors: list[torch.Tensor] = []
    for index, layer in enumerate(cache.layers):
        name = type(layer).__name__
        if not _known(type(layer)):
            msg = f"A scoped node added a {name} to a Hugging Face cache inside a compiled graph (not carried)."
            raise RuntimeError(msg)
        before = layers[index][1:] if index < len(layers) else (None,) * len(_FIELDS[name])
        for field, old in zip(_FIELDS[name], before, strict=True):
            new = getattr(layer, field, None)
            if isinstance(new, torch.Tensor):
                if new is not old:
                    found.append((index, field, True, first + len(tensors)))
                    tensors.append(new)
            elif type(new) is not type(old) or new != old:
                # A size the fake run computed symbolically is still a size of this call's
                # tensors: specialise it (a guard), as the attribute holds a plain int.
                found.append((index, field, False, int(new) if isinstance(new, torch.SymInt) else new))
    return tuple(found), tensors


def tensors_of(cache: Any, found: tuple[Change, ...]) -> list[torch.Tensor]:
    """The tensors :func:`changes` found newly bound, read again by their places (a real run)."""
    return [getattr(cache.layers[index], field) for index, field, is_tensor, _ in found if is_tensor]


def write_back(cache: Any, found: tuple[Change, ...], tensors: list[torch.Tensor]) -> None:
    """Set what the node changed on the caller's cache (traced by Dynamo after the op)."""
    for index, field, is_tensor, value in found:
        while len(cache.layers) <= index:  # a DynamicCache() grows by a layer on its first update of it
            cache.layers.append(cache.layer_class_to_replicate())
        setattr(cache.layers[index], field, tensors[value] if is_tensor else value)
