"""An old home, kept for pickles: fp32scope 0.1's pickles and ``torch.save`` files name this module.

They name ``fp32scope._trace`` for Fp32Trace and Fp32TraceEvent, now in ``fp32scope._wrappers.trace``
(docs/internals.rst, "Public paths in pickles"). Remove it only with the old pickles' support.
"""

from fp32scope._wrappers.trace import Fp32Trace, Fp32TraceEvent

__all__ = ["Fp32Trace", "Fp32TraceEvent"]
