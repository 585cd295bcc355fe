"""Layer 2, training: running a scoped call's backward in the call's precision.

Owns the boundary node that reruns a recorded call's backward inside its scope
(``backward``) and the accumulation of the caller's leaf gradients from that nested
backward (``leaf_grads``).

May import: layer 1 (``fp32scope._flags``), ``fp32scope._errors``, ``fp32scope._compat``, torch.
"""
