"""pytest plugin: the ``fp32_flags`` fixture and the ``--fp32scope-strict`` leak check.

pytest loads this module (entry point ``pytest11``) in every run of an environment where
fp32scope is installed, so it imports torch only when a test asks for the fixture or the
strict check is on: a run that uses neither pays one boolean test per test.

Strict mode (``--fp32scope-strict`` or ``fp32scope_strict = true`` in the ini file) runs
``fp32scope.assert_fp32_flags_unchanged`` around each test: it saves the exact flag state
before the test's setup and compares it with the state after the test's teardown, that is
after every function-scoped fixture has been torn down. A test that leaves a difference gets
an error at teardown that names each flag with its value before and after; the plugin then
restores the saved state so that later tests start clean. A fixture of wider scope that
changes the flags for several tests therefore counts as a leak of the first of them: in
strict mode, change flags in function-scoped fixtures (``fp32_flags`` restores on its own).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fp32scope._flags.torch_flags import FlagReadings
    from fp32scope._flags.unchanged import assert_fp32_flags_unchanged

__all__ = ["Fp32Flags", "fp32_flags"]

_STRICT_OPTION = "--fp32scope-strict"
_STRICT_INI = "fp32scope_strict"
_strict_key = pytest.StashKey[bool]()
_check_key: pytest.StashKey[assert_fp32_flags_unchanged] = pytest.StashKey()

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
            import fp32scope._flags.torch_flags  # noqa: F401
        except Exception as exc:
            msg = f"{_STRICT_OPTION} needs fp32scope and torch importable: {exc!r}"
            raise pytest.UsageError(msg) from exc


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """In strict mode, save the flags before any fixture of the test is set up."""
    if item.config.stash.get(_strict_key, False):
        # The same check users write in their own tests, entered here and left at teardown.
        from fp32scope._flags.unchanged import assert_fp32_flags_unchanged

        check = assert_fp32_flags_unchanged(restore=True)
        check.__enter__()
        item.stash[_check_key] = check
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    """In strict mode, turn the teardown report into an error when the test leaked flags."""
    report = yield
    if call.when != "teardown" or not item.config.stash.get(_strict_key, False):
        return report
    check = item.stash.get(_check_key, None)
    if check is None:  # setup never ran (skipped by a collection-time mark, or interrupted)
        return report
    del item.stash[_check_key]
    try:
        check.__exit__(None, None, None)  # restores the saved state where it raises
    except AssertionError as error:
        lines = str(error).splitlines()[1:]
    else:
        return report
    message = (
        f"fp32scope strict: {item.nodeid} left torch's float32 precision flags changed after its "
        "teardown (the plugin has restored them for the next test):\n"
        + "\n".join(lines)
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
        from fp32scope._flags import torch_flags

        self._flags = torch_flags
        self._raw_before = torch_flags.save_raw_state()
        #: Every reading torch offered before the test (``fp32scope._flags.torch_flags.read_all()``).
        self.before: FlagReadings = torch_flags.read_all()

    def readings(self) -> FlagReadings:
        """Every reading torch offers now; a raising legacy getter reads ``torch_flags.RAISES``."""
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
