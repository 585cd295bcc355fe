"""The model of the autocast tests: a float32 router between bf16 layers, wrapped and by hand.

Used by tests/wrappers/test_autocast.py and by the DDP script tests/_support/autocast_ddp.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from fp32scope import Fp32Precision, Fp32ScopedModule, current_fp32_precision, fp32_precision_scope
from tests._support.common import FULL

BF16 = torch.bfloat16
STEPS = 3


class Router(torch.nn.Module):
    """A small float32 node: what a MoE router is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)
        self.seen: list[tuple[bool, torch.dtype, Fp32Precision]] = []
        self.record = True  # off under torch.compile: a list that grows would recompile each call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.record:
            self.seen.append((torch.is_autocast_enabled("cpu"), x.dtype, current_fp32_precision()))
        out: torch.Tensor = self.lin(x)
        return out


class HandRouter(Router):
    """The same node made float32 by hand: scope, autocast off, inputs cast, inside the module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp32_precision_scope(FULL), torch.autocast("cpu", enabled=False):
            return super().forward(x.float())


class Model(torch.nn.Module):
    """``pre -> router -> post``: the rest of the model runs under the caller's autocast."""

    def __init__(self, router: torch.nn.Module, *, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(16, 16)
        self.router = router
        self.post = torch.nn.Linear(4, 3)
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.pre(x))
        r = checkpoint(self.router, h, use_reentrant=False) if self.use_checkpoint else self.router(h)
        return self.post(r.softmax(-1)), r


def pair(*, record: bool = True, in_graph: bool | None = None, **kwargs: Any) -> tuple[Model, Model]:
    """The wrapped stack and the hand-written one, with the same weights (``in_graph``: the router's)."""
    torch.manual_seed(0)
    hand = Model(HandRouter(), **kwargs)
    router = Router()
    router.record = record
    wrapped = Model(router, **kwargs)
    wrapped.load_state_dict(hand.state_dict())
    wrapped.router = Fp32ScopedModule(router, FULL, autocast=False, in_graph=in_graph)  # type: ignore[assignment]
    return wrapped, hand


def train(
    model: torch.nn.Module,
    call: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    seed: int = 1,
) -> list[list[torch.Tensor]]:
    """STEPS SGD steps under bf16 autocast; per step the outputs, the gradients and the parameters."""
    call = call if call is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    record = []
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            y, r = call(x)
        (y.float().square().mean() + r.square().mean()).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        record.append([y.detach(), r.detach(), *grads, *(p.detach().clone() for p in model.parameters())])
    return record
