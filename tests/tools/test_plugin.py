"""The pytest plugin: the ``fp32_flags`` fixture and ``--fp32scope-strict``, run through pytester."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch

from fp32scope._flags import torch_flags as _flags
from tests._support.common import ROOT
from tests._support.releases import needs_new_api

pytest_plugins = ["pytester"]

PLUGIN = ROOT / "fp32scope" / "_tools" / "pytest_plugin.py"

# Installed, the entry point loads the plugin in every run; from a bare checkout, name it.
_INSTALLED = any(ep.name == "fp32scope" for ep in importlib.metadata.entry_points(group="pytest11"))
LOAD = () if _INSTALLED else ("-p", "fp32scope._tools.pytest_plugin")

LEAKING = """
import torch
from fp32scope._flags import torch_flags as _flags

def test_leak():
    torch.set_float32_matmul_precision("medium")

def test_next_sees_clean_flags():
    assert torch.get_float32_matmul_precision() == "highest"
    if _flags.HAS_NEW_API:  # torch >= 2.9
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
"""


@pytest.fixture
def highest() -> None:
    """A known starting state for the inner runs (the outer autouse fixture restores it)."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True


@pytest.mark.usefixtures("highest")
def test_strict_fails_a_leaking_test_naming_each_flag(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LEAKING)
    result = pytester.runpytest(*LOAD, "--fp32scope-strict")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leak*",
            (
                "*fp32scope strict: test_strict_fails_a_leaking_test_naming_each_flag.py::test_leak left torch's "
                "float32 precision flags changed after its teardown*"
            ),
            "*torch.get_float32_matmul_precision(): 'highest' -> 'medium'",
            "*torch.backends.cuda.matmul.allow_tf32: False -> True",
        ]
    )
    if _flags.HAS_NEW_API:
        result.stdout.fnmatch_lines(["*torch.backends.mkldnn.matmul.fp32_precision: 'ieee' -> 'bf16'"])
    # The plugin restored what it saved before the leaking test's setup.
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.usefixtures("highest")
def test_ini_option_turns_strict_on(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nfp32scope_strict = true\n")
    pytester.makepyfile(LEAKING)
    pytester.runpytest(*LOAD).assert_outcomes(passed=2, errors=1)


@pytest.mark.usefixtures("highest")
def test_without_strict_nothing_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LEAKING)
    result = pytester.runpytest(*LOAD)
    # The leak stays, and the next test sees it: what strict mode exists to catch.
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAILED*test_next_sees_clean_flags*"])
    result.stdout.no_fnmatch_line("*fp32scope strict*")


@pytest.mark.usefixtures("highest")
def test_strict_accepts_tests_that_restore(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest
        import torch
        from fp32scope import Fp32Precision, fp32_precision_scope
        from fp32scope._flags import torch_flags as _flags

        @pytest.fixture
        def medium():
            before = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("medium")
            yield
            torch.set_float32_matmul_precision(before)

        def test_with_fixture(fp32_flags):
            torch.set_float32_matmul_precision("medium")
            if _flags.HAS_NEW_API:  # torch >= 2.9: a write the legacy API cannot make
                torch.backends.cudnn.conv.fp32_precision = "ieee"
            else:
                torch.backends.cudnn.allow_tf32 = False

        def test_with_restoring_fixture(medium):
            assert torch.get_float32_matmul_precision() == "medium"

        def test_with_scope():
            with fp32_precision_scope(Fp32Precision("medium", False)):
                assert torch.get_float32_matmul_precision() == "medium"

        def test_untouched():
            pass
    """)
    result = pytester.runpytest(*LOAD, "--fp32scope-strict")
    result.assert_outcomes(passed=4)


@needs_new_api  # the raw slots (inherited or explicit) exist with that API only
@pytest.mark.usefixtures("highest")
def test_strict_catches_a_change_no_reading_shows(pytester: pytest.Pytester) -> None:
    # cuda/all reads "ieee" and cuda/matmul holds "ieee" explicitly; writing "none" makes it
    # inherit the same value: every reading is unchanged, but a later write to cuda/all
    # would now reach cuBLAS.
    torch.backends.cudnn.fp32_precision = "ieee"
    pytester.makepyfile("""
        import torch

        def test_inherit():
            before = torch.backends.cuda.matmul.fp32_precision
            torch.backends.cuda.matmul.fp32_precision = "none"
            assert torch.backends.cuda.matmul.fp32_precision == before
    """)
    result = pytester.runpytest(*LOAD, "--fp32scope-strict")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*torch.backends.cuda.matmul.fp32_precision: reads the same, but its raw slot changed 'ieee' -> 'none'*",
        ]
    )


@pytest.mark.usefixtures("highest")
def test_fixture_yields_readings_and_restores(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import torch

        def test_uses_fixture(fp32_flags):
            assert fp32_flags.before["torch.get_float32_matmul_precision()"] == "highest"
            assert fp32_flags.changed() == {}
            torch.set_float32_matmul_precision("high")
            assert fp32_flags.readings()["torch.get_float32_matmul_precision()"] == "high"
            assert fp32_flags.changed()["torch.get_float32_matmul_precision()"] == ("highest", "high")

        def test_after_fixture():
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cuda.matmul.allow_tf32 is False
    """)
    result = pytester.runpytest(*LOAD)
    result.assert_outcomes(passed=2)


@pytest.mark.usefixtures("highest")
def test_a_leak_in_a_failing_teardown_is_reported_too(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest
        import torch

        @pytest.fixture
        def broken():
            yield
            torch.set_float32_matmul_precision("high")
            raise RuntimeError("teardown broke")

        def test_it(broken):
            pass
    """)
    result = pytester.runpytest(*LOAD, "--fp32scope-strict")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*RuntimeError: teardown broke*", "*fp32scope strict*", "*'highest' -> 'high'*"])
    assert torch.get_float32_matmul_precision() == "highest"


def test_plugin_module_imports_no_torch() -> None:
    # pytest imports the plugin in every run: the module itself must not import torch
    # (loaded by path here, so that the package's own imports do not count).
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('plugin', {str(PLUGIN)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert hasattr(module, 'fp32_flags')\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('fp32scope')))\n"
    )
    # The command is this interpreter running code built above.
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_loading_the_plugin_imports_no_torch() -> None:
    # pytest loads the plugin in every run of an environment with fp32scope installed.
    code = (
        "import sys, fp32scope._tools.pytest_plugin, fp32scope; print(sorted(m for m in sys.modules if m == 'torch'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)  # noqa: S603
    assert done.stdout.strip() == "[]"


@pytest.mark.usefixtures("highest")
def test_strict_reports_what_assert_fp32_flags_unchanged_reports(pytester: pytest.Pytester) -> None:
    # The plugin's check is the public helper: the same lines, in a user's test and at teardown.
    pytester.makepyfile("""
        import torch
        from fp32scope import assert_fp32_flags_unchanged

        def leak():
            torch.set_float32_matmul_precision("medium")
            torch.backends.cudnn.allow_tf32 = False

        def test_helper():
            with assert_fp32_flags_unchanged():
                leak()

        def test_leak_for_strict():
            leak()
    """)
    result = pytester.runpytest(*LOAD, "--fp32scope-strict")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    out = result.stdout.str()
    helper = out.split("_ test_helper _", 1)[1].split("_ ERROR at teardown", 1)[0]
    strict = out.split("ERROR at teardown of test_leak_for_strict", 1)[1]
    for line in (
        "torch.get_float32_matmul_precision(): 'highest' -> 'medium'",
        "torch.backends.cudnn.allow_tf32: True -> False",
    ):
        assert line in helper, out
        assert line in strict, out
    assert "AssertionError: the block changed torch's float32 precision flags (now restored):" in helper
    # The helper restored the flags, so strict mode found nothing to report for test_helper.
    assert "test_helper left torch's float32 precision flags changed" not in out
