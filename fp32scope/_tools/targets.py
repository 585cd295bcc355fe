"""``MODULE:ATTR`` targets of the command line: ``doctor --model``, ``advise``'s model, inputs and loss."""

from __future__ import annotations

import importlib

__all__ = ["TargetError", "call_factory", "one_line", "resolve"]

_MISSING = object()


class TargetError(Exception):
    """A ``MODULE:ATTR`` target cannot be imported, called, or is not what the option takes (exit status 2)."""


def one_line(error: BaseException) -> str:
    """``error`` as one line: its type and message, whitespace collapsed."""
    return " ".join(f"{type(error).__name__}: {error}".split())


def resolve(target: str, *, example: str) -> tuple[object, str]:
    """The object ``MODULE:ATTR`` names (``ATTR`` may be dotted), and ``ATTR``.

    ``example`` is shown in the error for a target that is not of the form ``MODULE:ATTR``.
    """
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        msg = f"expected MODULE:ATTR (for example {example}); got {target!r}"
        raise TargetError(msg)
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as error:  # the user's module: report any failure, exit 2
        msg = f"the module does not import ({one_line(error)})"
        raise TargetError(msg) from error
    for part in attribute.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            on = f" ({part!r} is missing)" if part != attribute else ""
            msg = f"{module_name} has no attribute {attribute!r}{on}"
            raise TargetError(msg)
    return obj, attribute


def call_factory(factory: object, attribute: str) -> object:
    """What calling ``factory`` without arguments returns; its failure is a :class:`TargetError`."""
    assert callable(factory)
    try:
        return factory()
    except Exception as error:  # the user's factory: report any failure, exit 2
        msg = f"calling {attribute} without arguments failed ({one_line(error)})"
        raise TargetError(msg) from error
