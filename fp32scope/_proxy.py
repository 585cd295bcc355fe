"""An old home, kept for pickles: fp32scope 0.1's pickles and ``torch.save`` files name this module.

They name ``fp32scope._proxy`` for _rebuild (the proxy's pickle), now in ``fp32scope._wrappers.proxy``
(docs/internals.rst, "Public paths in pickles"). Remove it only with the old pickles' support.
"""

from fp32scope._wrappers.proxy import _rebuild

__all__ = ["_rebuild"]
