"""Layer 1, the flags: torch's float32-precision flags, the scope that sets and restores them, the process default.

Owns the exact reads and writes of the flags in either API (``torch_flags``), the
``Fp32Precision`` value and the checks on user input (``precision``), the scope with its
thread and compile guards (``scope``), the process default (``process``), the hook point
that tracing and profiling attach to (``hooks``), and what keeps Dynamo out of the scope's
frames (``dynamo_exclude``).

May import: ``fp32scope._errors``, ``fp32scope._compat``, torch. Nothing above this layer.
"""
