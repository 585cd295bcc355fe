"""``assert_fp32_flags_unchanged``: a check, for tests, that a block leaves torch's precision flags as it found them."""

from __future__ import annotations

import contextlib
from types import TracebackType

from fp32scope._flags import torch_flags

__all__ = ["assert_fp32_flags_unchanged", "changes"]

Reading = str | bool
Saved = tuple[torch_flags.FlagReadings, torch_flags.RawState]


def _save() -> Saved:
    # Readings first: saving the raw state probes by writing for two C calls and restoring.
    return torch_flags.read_all(), torch_flags.save_raw_state()


def _raw_labels(slots: int) -> list[tuple[str, str]]:
    labels = [(torch_flags.LEGACY_MATMUL, "legacy matmul enum"), (torch_flags.LEGACY_CUDNN, "legacy cuDNN bool")]
    # No slots before torch 2.9: the raw state is the legacy pair alone.
    labels += [(name, "slot") for _, _, name in torch_flags.SLOTS[:slots]]
    return labels


def _raw_values(state: torch_flags.RawState) -> list[Reading]:
    e, b, slots = state
    return [e, b, *slots]


def changes(before: Saved, after: Saved) -> list[str]:
    """One line per flag that differs between two saves, naming it with both values; empty when none does."""
    readings_before, raw_before = before
    readings_after, raw_after = after
    changed = [name for name in readings_before if readings_before[name] != readings_after.get(name)]
    lines = [f"{name}: {readings_before[name]!r} -> {readings_after.get(name)!r}" for name in changed]
    # The raw state catches what no reading shows: a slot that inherited its value and now
    # holds it explicitly (a later write to its parent would no longer reach it).
    labels = _raw_labels(len(raw_before[2]))
    for (name, kind), old, new in zip(labels, _raw_values(raw_before), _raw_values(raw_after), strict=True):
        if old != new and name not in changed:
            lines.append(
                f"{name}: reads the same, but its raw {kind} changed {old!r} -> {new!r} "
                "('none' = inherits from its parent slot)"
            )
    return lines


class assert_fp32_flags_unchanged(contextlib.ContextDecorator):  # noqa: N801  (lower case: used like pytest.raises)
    """Assert that a block leaves every float32 precision flag of torch exactly as it found it.

    A context manager for tests; as a decorator it checks each call of the function. On
    entry it saves every reading torch offers, through both precision APIs, and the raw
    value of every slot (whether it inherits from its parent or holds its value itself);
    on a normal exit it compares. If anything differs it raises :class:`AssertionError`
    naming each changed flag with its value before and after, having first put back the
    saved state (``restore=False`` leaves the changed state in place). A block that
    raises is not checked: its exception goes on as it is.

    >>> with assert_fp32_flags_unchanged():
    ...     with fp32_precision_scope(Fp32Precision("highest")):
    ...         pass
    >>> torch.set_float32_matmul_precision("highest")
    >>> with assert_fp32_flags_unchanged():
    ...     torch.set_float32_matmul_precision("medium")
    Traceback (most recent call last):
      ...
    AssertionError: the block changed torch's float32 precision flags (now restored):
      torch.get_float32_matmul_precision(): 'highest' -> 'medium'
      ...
    >>> torch.get_float32_matmul_precision()
    'highest'
    """

    def __init__(self, *, restore: bool = True) -> None:
        if type(restore) is not bool:
            msg = f"restore must be True or False; got {restore!r} of type {type(restore).__name__}."
            raise TypeError(msg)
        self._restore = restore
        # A stack, not one slot: the same object may be re-entered (a decorated function
        # that recurses), and each exit compares with its own entry.
        self._saved: list[Saved] = []

    def __enter__(self) -> None:
        """Save the state of every flag."""
        self._saved.append(_save())

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Compare the state with the saved one; raise AssertionError naming each difference."""
        before = self._saved.pop()
        if exc_type is not None:
            return
        lines = changes(before, _save())
        if not lines:
            return
        if self._restore:
            torch_flags.restore_raw_state(before[1])
        state = "now restored" if self._restore else "left as the block set them"
        msg = f"the block changed torch's float32 precision flags ({state}):\n  " + "\n  ".join(lines)
        raise AssertionError(msg)


# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
assert_fp32_flags_unchanged.__module__ = "fp32scope"
