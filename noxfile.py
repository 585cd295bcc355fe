"""Development sessions: tests, lint, typecheck, docs, bench, demo, examples.

Every session installs torch==2.13.0 (its CPU build lies on the CI machine's disk; a
looser requirement would download a multi-GB CUDA build) unless the environment variable
FP32SCOPE_TORCH names another version, which becomes the session's ``torch`` parameter:
``FP32SCOPE_TORCH=2.14.1 nox -s tests``.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.error_on_missing_interpreters = True
nox.options.default_venv_backend = "virtualenv"  # pip-based: pip sees the on-disk torch build
nox.options.sessions = ["tests", "lint", "typecheck", "docs", "examples", "demo"]

TORCH_VERSIONS = [os.environ.get("FP32SCOPE_TORCH", "2.13.0")]


def install(session: nox.Session, torch: str, *extras: str) -> None:
    """Install the pinned torch first, then this package (editable) with ``extras``."""
    session.install(f"torch=={torch}")
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target)


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    """Run the test suite (CPU; the GPU tests skip themselves without CUDA)."""
    install(session, torch, "test")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff: lint and formatting."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def typecheck(session: nox.Session, torch: str) -> None:
    """mypy --strict over the package, tests, benchmarks, examples and this file."""
    install(session, torch, "typecheck")
    session.install("nox")
    session.run("mypy")


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def docs(session: nox.Session, torch: str) -> None:
    """Build the Sphinx docs with warnings as errors, and run their doctests."""
    install(session, torch, "docs")
    session.run("sphinx-build", "-W", "-n", "-T", "--keep-going", "-b", "html", "docs", "docs/_build/html")
    session.run("sphinx-build", "-W", "-n", "-T", "--keep-going", "-b", "doctest", "docs", "docs/_build/doctest")


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def bench(session: nox.Session, torch: str) -> None:
    """Measure the per-call cost of scopes, wrappers and torch's own helpers (medians, ratios)."""
    install(session, torch)
    session.run("python", "benchmarks/bench_scope.py", *session.posargs)


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def demo(session: nox.Session, torch: str) -> None:
    """Run the engine-style demo: three compiled nodes, one in full fp32."""
    install(session, torch)
    session.run("python", "-m", "fp32scope", "demo", *session.posargs)


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def examples(session: nox.Session, torch: str) -> None:
    """Run every script in examples/ as a user would."""
    install(session, torch, "test")
    for script in sorted(Path("examples").glob("*.py")):
        session.run("python", str(script))
