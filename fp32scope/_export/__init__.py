"""Layer 4, export and capture: artifacts and graphs that carry a node's precision.

Owns AOTInductor packages and saved exported programs with their precision (``export``),
the plain-string record they carry (``record``), and CUDA graph capture inside a scope
(``cuda_graphs``).

May import: layers 1 to 3, ``fp32scope._errors``, ``fp32scope._compat``, torch.
"""
