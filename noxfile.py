"""Development sessions: tests, lint, typecheck, docs, bench, demo, examples; the torch matrix.

Every session installs torch==2.13.0 (its CPU build lies on the CI machine's disk; a
looser requirement would download a multi-GB CUDA build) unless the environment variable
FP32SCOPE_TORCH names another version, which becomes the session's ``torch`` parameter:
``FP32SCOPE_TORCH=2.14.1 nox -s tests``.

The torch matrix: one test session per tested release, ``tests-<release>`` (e.g.
``nox -s tests-2.4.1``), all tagged ``torch-matrix``: ``nox -t torch-matrix`` runs the whole
matrix. Each venv takes 1-7 GB (the registry's releases are CUDA builds); ``.nox/`` can be
removed afterwards.

The Python matrix: one test session per supported Python, ``tests-py<version>`` (e.g.
``nox -s tests-py3.10``), all on torch 2.13.0 and tagged ``python-matrix``. nox looks for
``python3.10`` ... ``python3.13`` on the PATH (with pyenv: ``PYENV_VERSION=3.11.7:3.10.13:3.12.1:3.13.0``;
``.ci/run`` finds them on its own). The registry's torch for Pythons other than the one the
CPU build on disk was made for is a CUDA build, about 5 GB of venv.

The corners, which CI runs (``.ci/run``): ``tests-2.4.1-py3.10`` and ``tests-2.15.0-py3.13``,
the oldest tested release on the oldest Python and the newest on the newest, tagged
``corners``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import nox

nox.options.error_on_missing_interpreters = True
# uv makes a venv and installs torch in seconds where pip takes minutes; virtualenv (pip)
# where uv is missing. uv reads no pip configuration: _pass_pip_config_to_uv hands it on.
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests", "lint", "typecheck", "docs", "examples", "demo"]

#: pytest-xdist workers for the test sessions (the machine's two cores), which steal work from each other
#: (``--dist worksteal``: a worker that runs out of tests takes some of the other's); ``-- -n 0`` runs serially.
TEST_WORKERS = os.environ.get("FP32SCOPE_TEST_WORKERS", "2")
#: Every test session's pytest options: the workers, and the 25 slowest tests' times (where a session's time goes).
PYTEST_ARGS = ("-n", TEST_WORKERS, "--dist", "worksteal", "--durations=25")


def _pip_config() -> dict[str, str]:
    """pip's own settings, as ``pip config list`` shows them (files and PIP_* variables), by key without scope."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    # pip prints its keys sorted (":env:." first); it honours a PIP_* variable over the install
    # section over global, so read them in that order of rising precedence.
    rank = {"global": 0, "install": 1, ":env:": 2}
    found: list[tuple[int, str, str]] = []
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            scope, _, name = key.rpartition(".")
            found.append((rank.get(scope, 0), name, value.strip().strip("'\"")))
    return {name: value for _, name, value in sorted(found, key=lambda item: item[0])}


def _pass_pip_config_to_uv() -> None:
    """Give uv the local wheel folders and extra indexes pip is configured with (the on-disk torch builds)."""
    pip = _pip_config()
    if "find-links" in pip:
        os.environ.setdefault("UV_FIND_LINKS", ",".join(pip["find-links"].split()))
    if "extra-index-url" in pip:
        os.environ.setdefault("UV_EXTRA_INDEX_URL", pip["extra-index-url"])
        # As pip does: a package's versions from every index count (uv's default stops at the first).
        os.environ.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")
    if "index-url" in pip:
        os.environ.setdefault("UV_INDEX_URL", pip["index-url"])


_pass_pip_config_to_uv()

DEFAULT_TORCH = "2.13.0"
TORCH_VERSIONS = [os.environ.get("FP32SCOPE_TORCH", DEFAULT_TORCH)]

#: The releases the package is tested on, oldest first: the floor of ``torch>=2.4`` in
#: pyproject.toml, the last release without the per-backend fp32_precision API (2.8), the
#: first tested one with it, the default, the last without cuda matmul "bfx9" (2.14.1, on
#: the CI machine's disk), and the newest (2.15.0, which brought "bfx9").
TORCH_RELEASES = ["2.4.1", "2.8.0", "2.10.0", "2.13.0", "2.14.1", "2.15.0"]

#: Releases newer than the cap the CI machine's pip configuration (/etc/xdg/pip) puts on
#: torch (torch<=2.14.1, the builds on its disk): their installs run with PIP_CONSTRAINT
#: set to /dev/null, which lifts that constraint file for those pip commands only.
PAST_PIP_CAP = {"2.15.0"}

#: The Pythons the package supports and is tested on (the classifiers in pyproject.toml).
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]


def install(session: nox.Session, torch: str, *extras: str) -> None:
    """Install the pinned torch first, then this package (editable) with ``extras``."""
    # Both commands: under the cap, installing the package would take torch back down to 2.14.1.
    env = {"PIP_CONSTRAINT": "/dev/null"} if torch in PAST_PIP_CAP else None
    # setuptools: torch 2.4's Dynamo imports it on every compile, and a uv venv, unlike a
    # virtualenv one, starts without it.
    session.install(f"torch=={torch}", "setuptools", env=env)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target, env=env)


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def tests(session: nox.Session, torch: str) -> None:
    """Run the test suite (CPU; the GPU tests skip themselves without CUDA)."""
    install(session, torch, "test")
    session.run("pytest", *PYTEST_ARGS, *session.posargs)


def _matrix_session(release: str) -> Callable[[nox.Session], None]:
    def run_tests(session: nox.Session) -> None:
        install(session, release, "test")
        session.run("python", "-c", "import platform, torch; print(platform.python_version(), torch.__version__)")
        # pytest's -ra (pyproject.toml) lists each skip with its reason: a test that cannot
        # run on a release says why.
        session.run("pytest", *PYTEST_ARGS, *session.posargs)

    run_tests.__doc__ = f"Run the test suite on torch {release} (part of the torch matrix: nox -t torch-matrix)."
    return run_tests


for _release in TORCH_RELEASES:
    nox.session(name=f"tests-{_release}", tags=["torch-matrix"])(_matrix_session(_release))

#: The corners of the two matrices that CI runs: the oldest tested torch on the oldest
#: supported Python and the newest on the newest (the default session is the middle: 2.13.0
#: on 3.11). Each corner tests a release and a Python in one run of the suite, where the two
#: matrices' rows would take four.
CORNERS = {"2.4.1": "3.10", "2.15.0": "3.13"}


def _corner_session(release: str, python: str) -> Callable[[nox.Session], None]:
    run_tests = _matrix_session(release)
    run_tests.__doc__ = f"Run the test suite on torch {release} and Python {python} (a corner of the matrices; CI)."
    return run_tests


for _release, _python in CORNERS.items():
    nox.session(name=f"tests-{_release}-py{_python}", python=_python, tags=["corners"])(
        _corner_session(_release, _python)
    )


def _python_session(python: str) -> Callable[[nox.Session], None]:
    def run_tests(session: nox.Session) -> None:
        install(session, DEFAULT_TORCH, "test")
        session.run("python", "-c", "import platform, torch; print(platform.python_version(), torch.__version__)")
        session.run("pytest", *PYTEST_ARGS, *session.posargs)

    run_tests.__doc__ = f"Run the test suite on Python {python}, torch {DEFAULT_TORCH} (part of nox -t python-matrix)."
    return run_tests


for _python in PYTHONS:
    nox.session(name=f"tests-py{_python}", python=_python, tags=["python-matrix"])(_python_session(_python))


def extra(name: str) -> list[str]:
    """The requirements of pyproject.toml's optional dependency ``name`` (where the tools are pinned)."""
    requirements: list[str] = nox.project.load_toml("pyproject.toml")["project"]["optional-dependencies"][name]
    return requirements


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff (the version the ``lint`` extra pins): lint and formatting."""
    session.install(*extra("lint"))  # the extra's tools alone: ruff needs neither torch nor the package
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
    # torch warns "Failed to initialize NumPy" on import without NumPy (which it does not
    # require): the build imports torch, and a first run should show nothing to wonder about.
    session.install("numpy")
    session.run("sphinx-build", "-W", "-n", "-T", "--keep-going", "-b", "html", "docs", "docs/_build/html")
    session.run("sphinx-build", "-W", "-n", "-T", "--keep-going", "-b", "doctest", "docs", "docs/_build/doctest")


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def bench(session: nox.Session, torch: str) -> None:
    """Measure per-call costs (scopes, wrappers, torch's helpers), per-step training costs, compiled models, decoding.

    Arguments after ``--`` go to every script (``--repeats N``).
    """
    install(session, torch)
    session.install("numpy")  # as most users have it; else torch's import warns "Failed to initialize NumPy"
    session.run("python", "benchmarks/bench_scope.py", *session.posargs)
    session.run("python", "benchmarks/bench_training.py", *session.posargs)
    session.run("python", "benchmarks/bench_compiled.py", *session.posargs)
    session.install("transformers>=5")  # the decode bench's Llama, built offline from its config
    session.run("python", "benchmarks/bench_decode.py", *session.posargs)


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
    session.install("numpy")  # as most users have it; else torch's import warns "Failed to initialize NumPy"
    for script in sorted(Path("examples").glob("*.py")):
        session.run("python", str(script))


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def zoo(session: nox.Session, torch: str) -> None:
    """Run the whole model zoo (tests/zoo): every architecture and check; CI's default run checks a few."""
    install(session, torch, "test")
    session.run("pytest", *PYTEST_ARGS, "tests/zoo", *session.posargs, env={"FP32SCOPE_ZOO": "1"})


@nox.session(tags=["mutation"])
@nox.parametrize("torch", TORCH_VERSIONS)
def mutation(session: nox.Session, torch: str) -> None:
    """Mutation testing (mutmut, pinned in the ``mutation`` extra): prints the score and the survivors.

    Mutates the modules where a wrong line is a wrong result (``[tool.mutmut]`` in
    pyproject.toml) and runs, for each mutant, the tests there that reach the mutated
    function; then ``tests/_support/mutation_report.py`` prints the score (mutants explained in
    ``tests/_support/mutation_equivalents.txt`` left out, each with its reason) and every other
    mutant not killed, with its diff, and fails under 90%. Slow (about an hour on two busy
    cores), so in neither the default sessions nor CI; results stay in ``mutants/`` and a
    rerun tests only the mutants of changed functions. Arguments after ``--`` go to
    ``mutmut run`` (``--max-children N``, or mutant names to rerun). The code that only
    another release runs (entries tagged ``[on RELEASE]`` in the equivalents file) is left
    out of this score: ``nox -s mutation-2.4.1`` and ``nox -s mutation-2.15.0`` mutate it on
    its release, and ``nox -t mutation`` runs all three.
    """
    install(session, torch, "mutation")
    session.run("mutmut", "run", *session.posargs, env=ONE_THREAD)
    session.run("python", "tests/_support/mutation_report.py", "--rerun-survivors", env=ONE_THREAD)


@nox.session(name="mutation-regions", tags=["mutation"])
def mutation_regions(session: nox.Session) -> None:
    """Hand-made mutants of the in-graph region code, which mutmut cannot run (its tests compile).

    ``tests/_support/region_mutants.py`` applies each mutant to a copy of the repository,
    runs the region tests against it (the test that killed it last time first, as
    ``tests/_support/region_mutants.json`` records), and prints each one's fate and the
    score; it fails under 90%, or when a mutant's text is no longer in its file. Two
    mutants run side by side: a whole run takes about half an hour on two cores (a
    surviving mutant costs the whole region suite, 15 to 20 minutes on one core).
    Arguments after ``--`` go to the script (``--only WORD``, repeatable, runs the mutants
    whose name holds it; ``--equivalents`` runs the equivalent ones too).
    """
    install(session, DEFAULT_TORCH, "test")
    session.run("python", "tests/_support/region_mutants.py", *session.posargs)


# One OpenMP thread: mutmut forks each mutant's run, and a fork of a process whose OpenMP
# pool has run hangs at its first parallel kernel (tests/_support/mutation_plugin.py).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

#: The releases whose own code the default torch never runs, mutated there by ``nox -s mutation-<release>``:
#: the legacy implementation (torch < 2.9) on 2.4.1, cuda matmul "bfx9" on 2.15.0.
MUTATION_RELEASES = ["2.4.1", "2.15.0"]


def _mutation_tree(release: str) -> Path:
    """A fresh copy of what mutmut reads, in ``.mutation/<release>/``, apart from the default run's ``mutants/``.

    Its ``mutants/`` starts empty each time: these runs take minutes, and mutmut keeps a
    cached verdict when only the test selection or the equivalents file changed.
    """
    work = Path(".mutation") / release
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for folder in ("fp32scope", "tests"):
        shutil.copytree(folder, work / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2("pyproject.toml", work / "pyproject.toml")
    return work


def _release_mutation(release: str) -> Callable[[nox.Session], None]:
    def run_mutation(session: nox.Session) -> None:
        install(session, release, "mutation")
        report = ["python", "tests/_support/mutation_report.py", "--release", release]
        listed = session.run(*report, "--selection", silent=True)
        patterns = list(session.posargs) if session.posargs else str(listed).split()
        session.chdir(_mutation_tree(release))
        session.run("mutmut", "run", *patterns, env=ONE_THREAD)
        only = [arg for pattern in patterns for arg in ("--only", pattern)]
        session.run(*report, "--rerun-survivors", *only, env=ONE_THREAD)

    run_mutation.__doc__ = (
        f"Mutation testing of the code that only torch {release} of the tested releases runs, on that torch.\n\n"
        f"Mutates the mutants that ``tests/_support/mutation_equivalents.txt`` tags ``[on {release}]`` (or the "
        f"mutant names or globs after ``--``), in a copy of the tree in ``.mutation/{release}/``, and reports "
        "their score alone. Part of ``nox -t mutation``."
    )
    return run_mutation


for _release in MUTATION_RELEASES:
    nox.session(name=f"mutation-{_release}", tags=["mutation"])(_release_mutation(_release))
