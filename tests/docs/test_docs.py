"""What the docs, the README and the packaging files say about each other holds.

The doctests themselves run in ``nox -s docs``; these checks need no build.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fp32scope
from tests._support.common import ROOT

DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
PYPROJECT = (ROOT / "pyproject.toml").read_text()
NOXFILE = (ROOT / "noxfile.py").read_text()

#: The widest code line the docs show. furo's content column is 46em; its code font is
#: 81.25% of the text's, about 0.49em a character: 90 characters fit, less the padding.
CODE_WIDTH = 88

CODE_DIRECTIVES = {"code-block", "code", "sourcecode", "doctest", "testcode", "testoutput"}
# Prose, shown as it is kept in the repository (not code a reader copies).
NOT_CODE = {"CHANGELOG.md"}


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.rst") if "_build" not in p.parts)


def code_lines(page: Path) -> list[tuple[str, int, str]]:
    """Every line the page shows as code: (where, width, line), indentation of its block removed."""
    found: list[tuple[str, int, str]] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        directive = re.match(r"\.\. ([a-z-]+)::\s*(.*)", stripped)
        is_code = False
        if directive and directive.group(1) == "literalinclude":
            included = (page.parent / directive.group(2)).resolve()
            if included.name not in NOT_CODE:
                found += [
                    (f"{included.relative_to(ROOT)}:{n}", len(text), text)
                    for n, text in enumerate(included.read_text().splitlines(), 1)
                ]
        elif directive:
            is_code = directive.group(1) in CODE_DIRECTIVES
        else:
            is_code = stripped.endswith("::") and not stripped.startswith("..")
        i += 1
        if not is_code:
            continue
        outer = len(line) - len(line.lstrip())
        # Directive options (":language: python") and blank lines come before the content.
        while i < len(lines) and (not lines[i].strip() or (directive and lines[i].strip().startswith(":"))):
            i += 1
        block = []
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > outer):
            block.append((i + 1, lines[i]))
            i += 1
        indents = [len(text) - len(text.lstrip()) for _, text in block if text.strip()]
        if not indents:
            continue
        indent = min(indents)
        found += [(f"{page.relative_to(ROOT)}:{n}", len(text) - indent, text) for n, text in block if text.strip()]
    return found


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(DOCS)))
def test_no_code_line_is_wider_than_the_column(page: Path) -> None:
    wide = [f"{where} ({width}): {text.strip()}" for where, width, text in code_lines(page) if width > CODE_WIDTH]
    assert not wide, "\n".join(wide)


def test_the_width_check_sees_code_blocks() -> None:
    # The check above must find the code it is about: a page with each kind of block.
    found = code_lines(DOCS / "getting_started.rst")
    texts = [text.strip() for _, _, text in found]
    assert "$ python -m fp32scope --version" in texts  # code-block
    assert ">>> import torch" in texts  # doctest
    included = code_lines(DOCS / "howto" / "training_loop.rst")
    assert any(where.startswith("examples/training_loop.py:") for where, _, _ in included)


def test_docstring_examples_fit_the_column() -> None:
    for name in fp32scope.__all__:
        doc = inspect.getdoc(getattr(fp32scope, name)) or ""
        for line in doc.splitlines():
            if line.lstrip().startswith((">>>", "...")):
                assert len(line) <= CODE_WIDTH, f"{name}: {line}"


def test_the_errors_page_covers_every_exception_and_warning() -> None:
    page = (DOCS / "errors.rst").read_text()
    classes = [
        n for n in fp32scope.__all__ if isinstance(getattr(fp32scope, n), type) and n.endswith(("Error", "Warning"))
    ]
    assert classes
    for name in classes:
        assert re.search(rf"^{name}\n-+\n", page, re.MULTILINE), f"docs/errors.rst has no section for {name}"


def supported_pythons() -> list[str]:
    return re.findall(r'"Programming Language :: Python :: (3\.\d+)"', PYPROJECT)


def test_python_versions_agree_everywhere() -> None:
    pythons = supported_pythons()
    assert pythons == ["3.10", "3.11", "3.12", "3.13"]
    assert f'requires-python = ">={pythons[0]}"' in PYPROJECT
    assert f"python_version = {pythons[0]!r}".replace("'", '"') in PYPROJECT  # mypy checks the oldest
    assert f'target-version = "py{pythons[0].replace(".", "")}"' in PYPROJECT
    nox_pythons = re.search(r"^PYTHONS = \[(.*)\]$", NOXFILE, re.MULTILINE)
    assert nox_pythons is not None
    assert re.findall(r'"(3\.\d+)"', nox_pythons.group(1)) == pythons
    ci = (ROOT / ".ci" / "run").read_text()
    extra = re.search(r"^EXTRA_PYTHONS=\((.*)\)$", ci, re.MULTILINE)
    assert extra is not None
    assert extra.group(1).split() == [pythons[0], pythons[-1]]  # the oldest and the newest
    assert f"Python {pythons[0]} to {pythons[-1]}" in README
    releases = (DOCS / "guide" / "releases.rst").read_text()
    assert f"Python {pythons[0]} to {pythons[-1]}" in releases
    for python in pythons:
        assert f"| {python} |" in README, f"the README's table lacks Python {python}"
        assert f"   * - {python}\n" in releases


def test_the_docs_theme_is_installed_by_the_docs_extra() -> None:
    conf = (DOCS / "conf.py").read_text()
    assert 'html_theme = "furo"' in conf
    assert '"sphinx_copybutton"' in conf
    docs_extra = re.search(r"^docs = \[(.*)\]$", PYPROJECT, re.MULTILINE)
    assert docs_extra is not None
    assert '"furo' in docs_extra.group(1)
    assert '"sphinx-copybutton' in docs_extra.group(1)


def test_the_readme_installs_before_it_runs_anything() -> None:
    headings = re.findall(r"^## (.+)$", README, re.MULTILINE)
    assert headings.index("Installation") < headings.index("Quick start") < headings.index("Development")
    install = README.split("## Installation", 1)[1].split("\n## ", 1)[0]
    # torch first, then the package, into the user's own environment.
    assert install.index("pip install torch") < install.index("pip install path/to/fp32scope")
    assert "torch>=2.4" in install
    assert "nox" not in install  # contributors' tools come later


@pytest.mark.compile
def test_the_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1
    script = tmp_path / "quick_start.py"
    script.write_text(blocks[0])
    done = subprocess.run(  # noqa: S603
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "Fp32Precision(matmul='high', cudnn_allow_tf32=True)"


def test_the_test_layout_is_the_one_internals_describes() -> None:
    page = (DOCS / "internals.rst").read_text()
    tests = ROOT / "tests"
    subjects = sorted(p.name for p in tests.iterdir() if (p / "__init__.py").exists() and p.name != "_support")
    assert subjects, "tests/ has no subject packages"
    for name in subjects:
        assert f"``tests/{name}/``" in page, f"docs/internals.rst does not describe tests/{name}/"
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert not loose, f"test modules outside a subject package: {loose}"
    support = tests / "_support"
    assert not list(support.glob("test_*.py")), "tests/_support holds helpers, not tests"


def test_no_test_module_imports_from_another() -> None:
    importing = []
    for module in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import | ast.ImportFrom) else []
            if any(name.rsplit(".", 1)[-1].startswith("test_") for name in names):
                importing.append(f"{module.relative_to(ROOT)}: {names}")
    assert not importing, "shared helpers go to tests/_support, fixtures to tests/conftest.py: " + "; ".join(importing)
