"""AMP training (bf16 autocast on the CPU) with a float32 router, checked against the hand-written stack.

A small mixture-of-experts layer trains under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
Its router needs float32: it declares full float32 and ``autocast = False`` on its class,
and the model wraps it in ``Fp32ScopedModule``, which runs it with autocast off and its
bf16 input cast to float32. The experts keep bf16 AMP speed.

Each step is compared with the same model written the way people write it today, by hand
inside the router (``torch.autocast(..., enabled=False)``, ``x.float()``, and the
precision set around it): the outputs, the gradients and the parameters must be equal,
exactly. On CUDA the same holds with fp16 and a ``GradScaler`` (see the GPU tests).
"""

from __future__ import annotations

import torch

from fp32scope import Fp32Precision, Fp32ScopedModule, fp32_precision_scope, node_fp32_precision

EXPERTS = 4
WIDTH = 32
STEPS = 5


class Router(torch.nn.Module):
    """Scores each token for each expert; the softmax over experts needs float32."""

    float32_matmul_precision = "highest"
    cudnn_allow_tf32 = False
    autocast = False  # run in float32 under the caller's AMP

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(WIDTH, EXPERTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.gate(x)
        return scores.softmax(-1)


class HandRouter(Router):
    """The same router made float32 by hand, as most code does it today."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp32_precision_scope(Fp32Precision("highest", False)), torch.autocast("cpu", enabled=False):
            return super().forward(x.float())


class MoE(torch.nn.Module):
    def __init__(self, router: torch.nn.Module) -> None:
        super().__init__()
        self.router = router
        self.experts = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = self.router(x)  # float32 (batch, experts)
        mixed = sum(weights[:, i : i + 1] * expert(x) for i, expert in enumerate(self.experts))
        return self.head(torch.relu(mixed)), weights


def build() -> tuple[MoE, MoE]:
    torch.manual_seed(0)
    hand = MoE(HandRouter())
    router = Router()
    scoped = MoE(router)
    scoped.load_state_dict(hand.state_dict())
    # The engine's usual two lines: read the declaration, wrap (autocast=False is declared).
    precision = node_fp32_precision("router", router)
    scoped.router = Fp32ScopedModule(router, precision)  # type: ignore[assignment]
    return scoped, hand


def step(model: MoE, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
    loss.backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    opt.step()
    print(f"  loss {loss.item():.5f}; output {out.dtype}, router weights {weights.dtype}")
    return [loss.detach(), out.detach(), weights.detach(), *grads, *(p.detach().clone() for p in model.parameters())]


def main() -> None:
    scoped, hand = build()
    print(f"router wrapper: {repr(scoped.router).splitlines()[0]}")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (scoped, hand)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, WIDTH, generator=g)
    y = x[:, :1] - x[:, 1:2]  # a target the model can learn
    losses = []
    for i in range(STEPS):
        print(f"step {i}, scoped:")
        got = step(scoped, opts[0], x, y)
        print(f"step {i}, by hand:")
        expected = step(hand, opts[1], x, y)
        same = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        print(f"step {i}: equal to the hand-written stack (outputs, gradients, parameters): {same}")
        if not same:
            raise SystemExit(1)
        losses.append(got[0].item())
    went = "down" if losses[-1] < losses[0] else "UP"
    print(f"the loss went {went}: from {losses[0]:.5f} to {losses[-1]:.5f}")


if __name__ == "__main__":
    main()
