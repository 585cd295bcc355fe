"""An old home, kept for pickles: fp32scope 0.1's pickles and ``torch.save`` files name this module.

They name ``fp32scope._precision`` for Fp32Precision, now in ``fp32scope._flags.precision``
(docs/internals.rst, "Public paths in pickles"). Remove it only with the old pickles' support.
"""

from fp32scope._flags.precision import Fp32Precision

__all__ = ["Fp32Precision"]
