"""The command line as a terminal user meets it: --version, help texts, nothing on stderr to wonder about."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import fp32scope
from fp32scope.__main__ import main

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


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    python = ".".join(map(str, sys.version_info[:3]))
    assert out == f"fp32scope {fp32scope.__version__} (torch {torch.__version__}, Python {python})"


def test_version_as_a_user_runs_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fp32scope", "--version"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"fp32scope {fp32scope.__version__} (torch ")


HELPS = [[], ["demo"], ["doctor"]]


@pytest.mark.parametrize("command", HELPS, ids=["main", "demo", "doctor"])
def test_help_is_plain_text_for_a_terminal(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m fp32scope")
    # No reST markup: double backquotes, roles such as :func:, or references such as `name`_.
    assert "``" not in text
    assert re.search(r":[a-z]+:`", text) is None
    assert "`" not in text
    # No private names: nothing a user could not import.
    assert re.search(r"\b_[a-z]", text) is None, re.findall(r"\S*\b_[a-z]\S*", text)
    assert "fp32scope._" not in text
    # Fits a common terminal width (argparse wraps its own parts; the texts are wrapped by hand).
    assert max(map(len, text.splitlines())) <= 79


@pytest.mark.parametrize(("command", "codes"), [(["demo"], "0 when"), (["doctor"], "1 when it is mixed")])
def test_subcommand_help_says_what_the_exit_statuses_mean(
    capsys: pytest.CaptureFixture[str], command: list[str], codes: str
) -> None:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out
    assert "exit status: 0" in text
    assert codes in text
    assert "2 for a bad option" in text
