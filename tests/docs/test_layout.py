"""The package's layers: every import points down, no circle, and the docs' module map is the code's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests._support.common import ROOT

PACKAGE = ROOT / "fp32scope"
INTERNALS = ROOT / "docs" / "internals.rst"

#: Each layer's subpackage, bottom up; the ground (0) and the top are single modules.
LAYERS = {"_flags": 1, "_training": 2, "_wrappers": 3, "_export": 4, "_tools": 5}
GROUND = {"fp32scope._errors", "fp32scope._compat"}
TOP = 6  # fp32scope/__init__.py, __main__.py and the old homes kept for pickles
#: The old homes of fp32scope 0.1's pickles (docs/internals.rst, "Public paths in pickles").
ALIASES = {"fp32scope._precision", "fp32scope._trace", "fp32scope._proxy"}
#: Imports made inside a function, each for a reason other than a circle: the plugin and the
#: command line must not import torch before they need it (pytest loads the plugin in every
#: run; ``--version`` answers at once).
DEFERRED = {"fp32scope._tools.pytest_plugin", "fp32scope.__main__"}


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    """The layer of a module of the package."""
    if module in GROUND:
        return 0
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS[parts[1]]
    return TOP


def _imports(module: str) -> list[tuple[str, bool]]:
    """``(imported module, made at the module's top level)`` for each import of the package."""
    tree = ast.parse(MODULES[module].read_text())
    top = {id(node) for node in tree.body}
    top |= {
        id(node)
        for stmt in tree.body
        if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "TYPE_CHECKING"
        for node in stmt.body
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fp32scope"):
            for alias in node.names:  # `from fp32scope._flags import scope` imports a module
                sub = f"{node.module}.{alias.name}"
                found.append((sub if sub in MODULES else node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names if a.name.startswith("fp32scope")]
    return found


def test_the_layout_finds_every_module() -> None:
    assert len(MODULES) > 30
    assert {layer(m) for m in MODULES} == {0, 1, 2, 3, 4, 5, TOP}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_import_points_down(module: str) -> None:
    for imported, _ in _imports(module):
        assert layer(imported) <= layer(module), f"{module} (layer {layer(module)}) imports {imported}"
        if layer(module) == 0:
            assert imported in GROUND
            assert imported != module


@pytest.mark.parametrize("module", sorted(set(MODULES) - DEFERRED))
def test_no_import_of_the_package_is_made_inside_a_function(module: str) -> None:
    inside = [imported for imported, at_top in _imports(module) if not at_top]
    assert inside == [], f"{module} imports {inside} inside a function"


def test_the_import_graph_has_no_circle() -> None:
    graph = {m: {i for i, _ in _imports(m) if i in MODULES and i != m} for m in MODULES}
    graph["fp32scope.__main__"].discard("fp32scope")  # run as a script, after the package: not a circle
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, " -> ".join([*path[path.index(module) :], module])
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_layer_says_what_it_owns_and_may_import(package: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
    assert doc is not None
    assert doc.startswith(f"Layer {LAYERS[package]}, ")
    assert "May import" in doc


@pytest.mark.parametrize("module", sorted(m for m in MODULES if 0 < layer(m) < TOP and m.count(".") == 2))
def test_the_module_map_lists_each_module_in_its_layer(module: str) -> None:
    text = INTERNALS.read_text()
    package, name = module.split(".")[1:]
    assert f"``{package}.{name}``" in text or f"``{package}.{name}``," in text
    row = next(line for line in text.splitlines() if f"  {package}/ " in line)
    block = text[text.index(row) :].split("\n        |\n", 1)[0]  # the layer's row and its continuation
    assert name in block.replace(",", " ").replace("|", " ").split(), f"{module} is not in the map's row for {package}/"


@pytest.mark.parametrize("module", sorted(GROUND | ALIASES))
def test_the_module_map_lists_the_ground_and_the_old_homes(module: str) -> None:
    text = INTERNALS.read_text()
    block = text[text.index(".. code-block:: text\n\n   top") :].split("\n\n", 2)[1]
    assert f"{module.split('.')[1]}.py" in block.replace(",", " ").split(), module


def test_the_old_pickle_homes_only_re_export() -> None:
    for module in ALIASES:
        tree = ast.parse(MODULES[module].read_text())
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert all(isinstance(n, (ast.ImportFrom, ast.Assign)) for n in body), module
