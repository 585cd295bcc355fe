"""Run a script of examples/: used by tests/docs/test_examples.py and the training tests.

``run_example`` runs it as a user would, in a fresh interpreter: for a script whose point
needs one (worker processes, subprocesses of its own). ``run_example_main`` imports it and
calls its ``main()`` in this process, saving the fresh interpreter's start, its imports
(torch; transformers and diffusers take 8 s each) and its first compile's warm-up; with
``has_main_guard``, which checks that running the file calls that ``main()``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import subprocess
import sys
from types import ModuleType
from typing import Any

from tests._support.common import ROOT

EXAMPLES = ROOT / "examples"
# Generous: on a machine whose cores are busy, importing torch and compiling in each fresh
# interpreter takes minutes (the training loop compiles forward and backward graphs).
TIMEOUT_S = 300


def run_example(name: str) -> str:
    """Run ``examples/<name>`` in a fresh interpreter; return its stdout, failing on a non-zero exit."""
    result = subprocess.run(  # noqa: S603
        [sys.executable, str(EXAMPLES / name)],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _module(name: str) -> ModuleType:
    """``examples/<name>`` imported once per process, under a name of its own in ``sys.modules``.

    Dynamo imports the module of a function it traces by that name (a hook of the example),
    and a module that registers a custom op can register it only once.
    """
    module_name = f"fp32scope_examples_{name.removesuffix('.py')}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / name)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def has_main_guard(name: str) -> bool:
    """Whether ``examples/<name>`` ends with ``if __name__ == "__main__":`` calling ``main()``: run, it runs main()."""
    last = ast.parse((EXAMPLES / name).read_text()).body[-1]
    if not (isinstance(last, ast.If) and ast.unparse(last.test) == "__name__ == '__main__'"):
        return False
    calls = [ast.unparse(node.value) for node in ast.walk(last) if isinstance(node, ast.Expr)]
    return "main()" in calls


def run_example_main(name: str) -> tuple[str, Any]:
    """Call ``examples/<name>``'s ``main()`` in this process; what it printed, and what it returned.

    ``sys.argv`` holds only the script's path meanwhile (advise_moe.py writes a chart named by
    its first argument). The caller resets Dynamo around it (the ``fresh_dynamo`` fixture)
    where the example compiles.
    """
    assert has_main_guard(name), f"{name}: running the file would not call its main()"
    module = _module(name)
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [str(EXAMPLES / name)]  # run without arguments, as the fresh interpreter was (not pytest's)
    try:
        with contextlib.redirect_stdout(out):
            returned = module.main()
    finally:
        sys.argv = argv
    return out.getvalue(), returned
