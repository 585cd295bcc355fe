"""Training with FSDP2 (``fully_shard``): a full-fp32 block inside a sharded model, two processes.

Each process (gloo, on the CPU) trains its shard of the same model on its own batch. The
block is an ``Fp32ScopedModule`` declaring full fp32, sharded as a unit of its own; the
process default is "high". Its forward and its backward run in full fp32 (a hook on the
block's output gradient reads the flags when autograd runs it), and after every step each
rank checks its model against the same model trained unsharded, in one process, on both
ranks' batches: the sharded training with the scoped block is that training, step by
step (a gradient lost or a step late would show).

Run: ``python examples/fsdp2_training.py`` (torch 2.6 or later: ``torch.distributed.fsdp.fully_shard``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import cast

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from fp32scope import Fp32Precision, Fp32ScopedModule, current_fp32_precision, set_process_default

WORLD = 2
STEPS = 3
FULL = Fp32Precision("highest", cudnn_allow_tf32=False)
DEFAULT = Fp32Precision("high", cudnn_allow_tf32=True)


class Block(torch.nn.Module):
    """A block that must run in full fp32; records the flags its backward ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.backward_ran_in: list[Fp32Precision] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(self.proj(x))
        if out.requires_grad:
            out.register_hook(self._record)  # type: ignore[no-untyped-call]
        return out

    def _record(self, grad: torch.Tensor) -> None:
        del grad  # only when autograd runs this is of interest, not the value
        self.backward_ran_in.append(current_fp32_precision())


class Model(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(16, 32)
        self.block = block
        self.post = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.pre(x))
        return cast("torch.Tensor", self.post(h + self.block(h)))


def build() -> tuple[Model, Block]:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    block = Block()
    return Model(block), block


def batches(rank: int) -> list[torch.Tensor]:
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    return [torch.randn(8, 16, generator=data) for _ in range(STEPS)]


def reference() -> list[dict[str, torch.Tensor]]:
    """The same training unsharded, in one process, on both ranks' batches (plain torch)."""
    model, _ = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [batches(rank) for rank in range(WORLD)]
    states = []
    for step in range(STEPS):
        optimizer.zero_grad()
        torch.autograd.backward(model(torch.cat([d[step] for d in data])).square().mean())
        optimizer.step()
        states.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return states


def worker(rank: int, init_file: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        set_process_default(DEFAULT)
        expected = reference()
        model, block = build()
        model.block = cast("torch.nn.Module", Fp32ScopedModule(block, FULL))  # scope, then shard
        fully_shard(model.block)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        worst = 0.0
        for step, x in enumerate(batches(rank)):
            optimizer.zero_grad()
            torch.autograd.backward(model(x).square().mean())
            optimizer.step()
            for name, param in model.named_parameters():
                full = param.full_tensor()  # type: ignore[attr-defined]  # a DTensor shard
                worst = max(worst, (full - expected[step][name]).abs().max().item())
        ran_in = sorted(set(block.backward_ran_in), key=str)
        lines = [
            f"rank {rank}: block backward ran in {ran_in} ({len(block.backward_ran_in)} steps)",
            f"rank {rank}: matches the unsharded training at every step: {worst <= 1e-6} ({worst:.1g})",
            f"rank {rank}: flags after training: {current_fp32_precision()}",
        ]
        for turn in range(WORLD):  # one rank after the other: no interleaved lines
            if turn == rank:
                print("\n".join(lines), flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: torch's gloo backend (2.13, on this CPU
    # machine kind) sometimes aborts in it, with plain FSDP2 as well, after all the work.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD, join=True)  # type: ignore[no-untyped-call]  # noqa: PTH118
    print("FSDP2 training done: the block trained in full fp32 on every rank, as the unsharded model does")


if __name__ == "__main__":
    main()
