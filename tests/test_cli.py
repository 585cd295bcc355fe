"""The command line on a first run: nothing on stderr the user has to wonder about."""

from __future__ import annotations

import subprocess
import sys

NUMPY_WARNING = "Failed to initialize NumPy"

# A fresh venv has no NumPy (torch does not require it); blocking the import shows the same
# warning on torch's import whether or not this environment has NumPy.
WITHOUT_NUMPY = "import sys; sys.modules['numpy'] = None\n"


def run(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (torch's import warning fires once per process)."""
    return subprocess.run(  # noqa: S603
        [sys.executable, "-c", WITHOUT_NUMPY + code], capture_output=True, text=True, timeout=300, check=False
    )


def test_the_command_line_does_not_show_torchs_numpy_warning() -> None:
    result = run("from fp32scope.__main__ import main\nraise SystemExit(main(['doctor']))")
    assert result.returncode in (0, 1), result.stderr  # 1: the doctor found a mixed state
    assert result.stdout.strip(), "the doctor printed its report"
    assert NUMPY_WARNING not in result.stderr


def test_library_users_still_see_it() -> None:
    # Only the command line ignores the warning: importing torch and fp32scope shows it as usual.
    result = run("import torch, fp32scope\nfp32scope.Fp32Precision('high')")
    assert result.returncode == 0, result.stderr
    assert NUMPY_WARNING in result.stderr
