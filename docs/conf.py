"""Sphinx configuration for fp32scope's documentation (built offline: no intersphinx)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Build from the checkout even where the package is not installed.
sys.path.insert(0, str(ROOT))

import fp32scope  # noqa: E402

project = "fp32scope"
author = "fp32scope developers"
copyright = "fp32scope developers"
release = fp32scope.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]

exclude_patterns = ["_build"]

# -- HTML ------------------------------------------------------------------------------------
# furo: a column that fits code lines of up to about 90 characters at its code font size
# (tests/docs/test_docs.py keeps the code the pages show within 88), with a sidebar that lists
# every page, and dark mode.
html_theme = "furo"
html_title = f"fp32scope {release}"
html_static_path: list[str] = []
# The copy button copies code without the prompts and without doctest output.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = True

# -- autodoc -------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True

# -- nitpicky mode (-n) ----------------------------------------------------------------------
# The build runs offline, so references into Python's, torch's and wrapt's own docs cannot
# resolve; everything of fp32scope's must.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|wrapt|typing|collections\.abc|types)(\..*)?"),
    (r"py:.*", r"(None|bool|int|str|float|object|tuple|list|dict|type|Any|Callable|Sequence)"),
    (r"py:exc", r"[A-Z][A-Za-z]*(Error|Exception|Warning|Interrupt)"),
    (r"py:class", r"[A-Z][A-Za-z]*(Error|Exception|Warning)"),
    # Private type aliases and type variables in signatures: not public names.
    (r"py:class", r"MatmulPrecision|fp32scope\._wrappers\.decorator\.F"),
]

# -- doctest -------------------------------------------------------------------------------
# ``>>>`` blocks (the docstrings' examples included) run in the "default" group.
doctest_test_doctest_blocks = "default"
# Every document's tests start from the flags the build found and put them back afterwards.
doctest_global_setup = """
import torch
from fp32scope import *
from fp32scope._flags import torch_flags as _fp32scope_flags
_fp32scope_saved = _fp32scope_flags.save_raw_state()
"""
doctest_global_cleanup = """
_fp32scope_flags.restore_raw_state(_fp32scope_saved)
"""

# A hidden doctest appended to each docstring that has examples puts the flags back, so
# one docstring's examples cannot leak flags into the next one's on the same page.
_RESET = [
    "",
    ".. doctest::",
    "   :hide:",
    "",
    "   >>> _fp32scope_flags.restore_raw_state(_fp32scope_saved)",
    "",
]


def _reset_after_examples(  # noqa: PLR0913, PLR0917  (the event's signature)
    app: Any, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    del what, name, obj, options
    if app.builder.name == "doctest" and any(line.lstrip().startswith(">>>") for line in lines):
        lines.extend(_RESET)


def _check_public_names_documented(app: Any, env: Any) -> None:
    """Warn (an error under -W) for every name in ``fp32scope.__all__`` the docs do not describe."""
    del app
    from sphinx.util import logging

    documented = env.get_domain("py").objects
    missing = [name for name in fp32scope.__all__ if f"fp32scope.{name}" not in documented]
    if missing:
        logging.getLogger(__name__).warning(
            "public names missing from the API reference (docs/api.rst): %s", ", ".join(missing)
        )


def _advise_chart(app: Any) -> None:
    """Run examples/advise_moe.py to draw the chart howto/find_fp32_nodes.rst shows (docs/_generated/)."""
    import contextlib
    import io
    import runpy

    chart = Path(app.srcdir) / "_generated" / "advise_moe.png"
    chart.parent.mkdir(exist_ok=True)
    argv = sys.argv
    sys.argv = ["advise_moe.py", str(chart)]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(ROOT / "examples" / "advise_moe.py"), run_name="__main__")
    finally:
        sys.argv = argv


def setup(app: Any) -> None:
    """Connect the per-docstring flag reset, the check that every public name is documented, the chart."""
    app.connect("autodoc-process-docstring", _reset_after_examples)
    app.connect("env-check-consistency", _check_public_names_documented)
    app.connect("builder-inited", _advise_chart)
