"""One process's compiled parent holding one region; two of them share Inductor's disk cache.

Run as a script (``python -m tests._support.region_process KIND [eager]``) it builds
``pre -> node -> post`` with the node of ``KIND`` (``"halves"`` or ``"doubles"``: the same
parameters, outputs of other shapes) as this process's first region, compiles the parent
whole with Inductor, and compares a ``no_grad`` call with the same parent run eagerly; a
difference, or an error, exits non-zero. The two kinds make the same parent graph but for
the node behind the region's number: the number of the node's compiled-inside entry, or,
with ``eager`` (an ``eager=True`` node, never compiled inside), the region's own.
``tests/compile/test_regions.py`` runs one kind then the other with one
``TORCHINDUCTOR_CACHE_DIR``: the second must not be served the first one's compiled graph.
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


def main(kind: str, *, eager: bool) -> int:
    """Compile and check one parent; 0 when the compiled call equals the eager one."""
    torch.manual_seed(0)
    model = Parent(Halves() if kind == "halves" else Doubles(), eager=eager)
    x = torch.randn(6, WIDTH)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, fullgraph=True)(x)
    if not torch.allclose(got, want):
        print(f"{kind}: compiled {float(got)} against eager {float(want)}")
        return 1
    print(f"{kind}: compiled equals eager")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], eager=sys.argv[2:] == ["eager"]))
