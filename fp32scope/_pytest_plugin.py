"""pytest plugin: the ``fp32_flags`` fixture and the ``--fp32scope-strict`` leak check.

pytest loads this module (entry point ``pytest11``) in every run of an environment where
fp32scope is installed, so it imports torch only when a test asks for the fixture or the
strict check is on: a run that uses neither pays one boolean test per test.

Strict mode (``--fp32scope-strict`` or ``fp32scope_strict = true`` in the ini file) saves
the exact flag state before each test's setup and compares it with the state after the
test's teardown, that is after every function-scoped fixture has been torn down. A test
that leaves a difference gets an error at teardown that names each flag with its value
before and after; the plugin then restores the saved state so that later tests start
clean. A fixture of wider scope that changes the flags for several tests therefore
counts as a leak of the first of them: in strict mode, change flags in function-scoped
fixtures (``fp32_flags`` restores on its own).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fp32scope._flags import FlagReadings, RawState

__all__ = ["Fp32Flags", "fp32_flags"]

_STRICT_OPTION = "--fp32scope-strict"
_STRICT_INI = "fp32scope_strict"
_strict_key = pytest.StashKey[bool]()
_before_key = pytest.StashKey[tuple["FlagReadings", "RawState"]]()

Reading = str | bool


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--fp32scope-strict`` and the ``fp32scope_strict`` ini option."""
    group = parser.getgroup("fp32scope", "float32 precision flags (fp32scope)")
    group.addoption(
        _STRICT_OPTION,
        action="store_true",
        default=False,
        help=(
            "fail (error at teardown) every test that leaves torch's float32 precision flags "
            "different from how it found them, naming each flag; the flags are then restored"
        ),
    )
    parser.addini(_STRICT_INI, type="bool", default=False, help=f"same as {_STRICT_OPTION}")


def pytest_configure(config: pytest.Config) -> None:
    """Decide once whether the strict check runs, so that each test pays a stash lookup only."""
    strict = bool(config.getoption(_STRICT_OPTION)) or bool(config.getini(_STRICT_INI))
    config.stash[_strict_key] = strict
    if strict:
        # Fail the run at start-up, with the reason, rather than at the first test.
        try:
            import fp32scope._flags  # noqa: F401
        except Exception as exc:
            msg = f"{_STRICT_OPTION} needs fp32scope and torch importable: {exc!r}"
            raise pytest.UsageError(msg) from exc


def _save() -> tuple[FlagReadings, RawState]:
    from fp32scope import _flags

    # Readings first: saving the raw state probes by writing for two C calls and restoring.
    return _flags.read_all(), _flags.save_raw_state()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """In strict mode, save the flags before any fixture of the test is set up."""
    if item.config.stash.get(_strict_key, False):
        item.stash[_before_key] = _save()
    return (yield)


def _raw_labels(slots: int) -> list[tuple[str, str]]:
    from fp32scope import _flags

    labels = [(_flags.LEGACY_MATMUL, "legacy matmul enum"), (_flags.LEGACY_CUDNN, "legacy cuDNN bool")]
    # No slots before torch 2.9: the raw state is the legacy pair alone.
    labels += [(name, "slot") for _, _, name in _flags.SLOTS[:slots]]
    return labels


def _raw_values(state: RawState) -> list[Reading]:
    e, b, slots = state
    return [e, b, *slots]


def leaks(before: tuple[FlagReadings, RawState], after: tuple[FlagReadings, RawState]) -> list[str]:
    """One line per flag that differs between two saves; empty when nothing leaked."""
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    """In strict mode, turn the teardown report into an error when the test leaked flags."""
    report = yield
    if call.when != "teardown" or not item.config.stash.get(_strict_key, False):
        return report
    before = item.stash.get(_before_key, None)
    if before is None:  # setup never ran (skipped by a collection-time mark, or interrupted)
        return report
    del item.stash[_before_key]
    lines = leaks(before, _save())
    if not lines:
        return report
    from fp32scope import _flags

    _flags.restore_raw_state(before[1])
    message = (
        f"fp32scope strict: {item.nodeid} left torch's float32 precision flags changed after its "
        "teardown (the plugin has restored them for the next test):\n  "
        + "\n  ".join(lines)
        + "\nRestore what the test changes: use the fp32_flags fixture, or fp32scope.fp32_precision_scope "
        "around the code that needs another precision."
    )
    assert isinstance(report, pytest.TestReport)
    if report.passed:
        report.outcome = "failed"
        report.longrepr = message
    else:
        # A teardown that failed already keeps its own error; the leak is reported alongside.
        report.sections.append(("fp32scope strict", message))
    return report


class Fp32Flags:
    """What the ``fp32_flags`` fixture yields: the readings before the test, and helpers."""

    def __init__(self) -> None:
        from fp32scope import _flags

        self._flags = _flags
        self._raw_before = _flags.save_raw_state()
        #: Every reading torch offered before the test (``fp32scope._flags.read_all()``).
        self.before: FlagReadings = _flags.read_all()

    def readings(self) -> FlagReadings:
        """Every reading torch offers now; a raising legacy getter reads ``_flags.RAISES``."""
        return self._flags.read_all()

    def changed(self) -> dict[str, tuple[Reading, Reading]]:
        """The readings that differ from :attr:`before`, as ``{name: (before, now)}``."""
        now = self.readings()
        return {name: (self.before[name], now[name]) for name in self.before if self.before[name] != now[name]}

    def restore(self) -> None:
        """Put back the exact state saved before the test (the fixture also does at teardown)."""
        self._flags.restore_raw_state(self._raw_before)


@pytest.fixture
def fp32_flags() -> Iterator[Fp32Flags]:
    """Save torch's exact float32 precision flags before the test and restore them after it."""
    flags = Fp32Flags()
    try:
        yield flags
    finally:
        flags.restore()
