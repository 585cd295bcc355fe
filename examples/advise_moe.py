"""Find which nodes of a mixture of experts need full float32 under bf16 autocast.

The model's router scores nearly tie (its rows are one row plus a little noise), so
bf16 rounding flips which expert a token goes to; the experts are fine in bf16.
``fp32scope.advise`` measures this on two batches, proposes a policy that meets the
tolerance with a margin (1.5) there, and measures it on three held-out batches it never
searched on; the script saves the whole advice as JSON, loads its policy into
``scope_modules``, checks it on another batch itself, and shows with ``trace()``
that the router runs in full float32.
``python examples/advise_moe.py PNG`` also saves the sensitivity chart (matplotlib:
``pip install fp32scope[plot]``).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

import fp32scope

WIDTH = 32
EXPERTS = 4


class MoE(torch.nn.Module):
    """A top-1 mixture of experts whose router's logits nearly tie."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = torch.nn.Linear(WIDTH, EXPERTS, bias=False)
        experts = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS)]
        self.experts = torch.nn.ModuleList(experts)
        with torch.no_grad():
            row = torch.randn(1, WIDTH, generator=g)
            noise = torch.randn(EXPERTS, WIDTH, generator=g)
            self.router.weight.copy_(row + 2e-3 * noise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(dim=-1)
        out = torch.stack([e(x) for e in self.experts], dim=1)
        picked: torch.Tensor = out[torch.arange(x.shape[0]), choice]
        return picked.float()


def batch(seed: int) -> torch.Tensor:
    return torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(seed))


def relative_error(model: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        ref = model(x)  # full float32 (the process default here is "highest")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
    return float((y - ref).norm() / ref.norm())


def main() -> None:
    model = MoE()
    advice = fp32scope.advise(
        model,
        [batch(1), batch(2)],
        held_out=[batch(3), batch(4), batch(5)],
        autocast=torch.bfloat16,
        tolerance=2e-2,
        margin=1.5,
    )
    print(advice.table())
    print("policy:", advice.policy)
    if len(sys.argv) > 1:
        advice.plot(sys.argv[1])
        print("chart:", sys.argv[1])

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "advice.json"
        path.write_text(advice.to_json())
        policy = json.loads(path.read_text())["policy"]
    held_out = batch(6)
    print(f"held-out error, no policy: {relative_error(model, held_out):.3g}")
    scoped = fp32scope.scope_modules(model, policy, autocast=False)
    print("scoped:", scoped)
    print(f"held-out error, with the policy: {relative_error(model, held_out):.3g}")
    with fp32scope.trace() as events, torch.autocast("cpu", dtype=torch.bfloat16):
        model(held_out)
    for event in events:
        print(f"traced: {event.name} {event.phase} {event.observed}")


if __name__ == "__main__":
    main()
