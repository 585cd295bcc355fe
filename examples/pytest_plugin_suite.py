"""fp32scope's pytest plugin in a user's test suite.

Installing fp32scope registers a pytest plugin (entry point ``pytest11``) that adds

* the fixture ``fp32_flags``: saves torch's exact float32 precision flags before the test
  and restores them after it;
* the option ``--fp32scope-strict``: a test that leaves the flags different from how it
  found them gets an error at teardown naming each flag (the flags are then restored).

This script runs pytest on ``plugin_suite/`` twice, in subprocesses: the suite, which
passes in strict mode, and a test that leaks a flag change, which strict mode reports.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

SUITE = Path(__file__).resolve().parent / "plugin_suite"


def plugin_args() -> list[str]:
    """Nothing where fp32scope is installed (pytest loads the plugin itself); else load it by name."""
    installed = any(ep.value == "fp32scope._tools.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "fp32scope._tools.pytest_plugin"]


def run_pytest(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-q", *plugin_args(), *args]
    return subprocess.run(command, cwd=SUITE, capture_output=True, text=True, check=False)  # noqa: S603


def summary(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def main() -> int:
    print("1. the suite, with --fp32scope-strict:")
    suite = run_pytest("--fp32scope-strict", "test_nodes.py")
    print(f"   pytest exit status {suite.returncode}: {summary(suite.stdout)}")
    if suite.returncode != 0:
        print(suite.stdout, suite.stderr, sep="\n")
        return 1

    print("2. a test that leaks a flag change, with --fp32scope-strict:")
    leaky = run_pytest("--fp32scope-strict", "leaky_check.py")
    print(f"   pytest exit status {leaky.returncode}: {summary(leaky.stdout)}")
    reported = [line.strip() for line in leaky.stdout.splitlines() if "get_float32_matmul_precision()" in line]
    for line in reported[:1]:
        print(f"   strict mode reports: {line}")
    if leaky.returncode != 1 or not reported:
        print(leaky.stdout, leaky.stderr, sep="\n")
        return 1
    print("strict mode passed the suite and caught the leak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
