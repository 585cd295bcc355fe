"""One process's compiled parents, each holding one region; two of them share Inductor's disk cache.

Run as a script (``python -m tests._support.region_process KIND``) it builds
``pre -> node -> post`` with the node of ``KIND`` (``"halves"`` or ``"doubles"``: the same
parameters, outputs of other shapes) as this process's first region, compiles the parent
whole with Inductor, and compares a ``no_grad`` call with the same parent run eagerly; then
the same again with an ``eager=True`` node (never compiled inside) as its second region.
A difference, or an error, exits non-zero. The two kinds make the same parent graphs but
for the node behind the region's number: the number of the node's compiled-inside entry,
or, for the ``eager=True`` node, the region's own. ``tests/compile/test_regions.py`` runs
one kind then the other with one ``TORCHINDUCTOR_CACHE_DIR``: the second must not be served
the first one's compiled graphs (both processes number their regions and entries alike, in
the same order).
"""

from __future__ import annotations

import sys

import torch

from fp32scope import Fp32Precision, Fp32ScopedModule

WIDTH = 8


class Halves(torch.nn.Module):
    """Returns two outputs: the linear's first half of columns, and its second."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        return y[:, : WIDTH // 2].contiguous(), y[:, WIDTH // 2 :].contiguous()


class Doubles(torch.nn.Module):
    """Returns two outputs: the linear's result and twice it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        return y, y * 2


class Parent(torch.nn.Module):
    def __init__(self, node: torch.nn.Module, *, eager: bool) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(WIDTH, WIDTH)
        self.node = Fp32ScopedModule(node, Fp32Precision("highest", False), eager=eager)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.node(self.pre(x))
        out: torch.Tensor = first.square().sum() + second.square().sum()
        return out


#: The parents each process compiles, in this order: the node compiled inside its region, then an eager one.
CASES = {"compiled inside": False, "eager node": True}


def check(kind: str, case: str) -> bool:
    """Compile one parent and check it; True when the compiled call equals the eager one."""
    torch.manual_seed(0)
    model = Parent(Halves() if kind == "halves" else Doubles(), eager=CASES[case])
    x = torch.randn(6, WIDTH)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, fullgraph=True)(x)
    if not torch.allclose(got, want):
        print(f"{kind}, {case}: compiled {float(got)} against eager {float(want)}")
        return False
    print(f"{kind}, {case}: compiled equals eager")
    return True


def main(kind: str) -> int:
    """Compile and check each case's parent; 0 when every compiled call equals its eager one."""
    passed = [check(kind, case) for case in CASES]  # a wrong value in one stops none
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
