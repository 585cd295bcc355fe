"""Layer 3, the wrappers: what runs every call of a node in its precision, and what shows it.

Owns the proxy (``proxy``), the decorator (``decorator``), the node's declared precision
(``node``), scoping a model by selectors (``policy``), autocast and parameter-dtype checks
(``autocast``, ``param_dtype``), compiling a wrapped callable inside its scope
(``trampoline``), a scoped node as one op of a compiled parent's graph (``region``),
and :func:`~fp32scope.trace` with its events and table (``trace``).

May import: layers 1 and 2, ``fp32scope._errors``, ``fp32scope._compat``, torch, wrapt.
"""
