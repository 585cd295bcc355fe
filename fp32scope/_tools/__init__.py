"""Layer 5, the tools: ``advise``, the ``demo``, ``doctor`` and ``advise`` commands, the pytest plugin.

May import: every layer below, ``fp32scope._errors``, ``fp32scope._compat``, torch. The
pytest plugin imports torch and the layers only when a test uses it (pytest loads it in
every run), so this package's ``__init__`` imports nothing.
"""
