"""Training with DistributedDataParallel: a full-fp32 head inside a DDP model, two processes.

Each process (gloo, on the CPU) trains the same model on different data. The head is an
``Fp32ScopedModule`` declaring full fp32; the process default is "high". Its forward and
its backward run in full fp32 (a hook on the head's output gradient reads the flags when
autograd runs it), DDP's reducer all-reduces the head's gradients as usual (each rank's
gradients equal the average although their data differ), the replicas stay identical
step after step, and the flags are back to the default afterwards.

Run: ``python examples/ddp_training.py``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import cast

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn
from torch.nn.parallel import DistributedDataParallel

from fp32scope import Fp32Precision, Fp32ScopedModule, current_fp32_precision, set_process_default

WORLD = 2
STEPS = 3
FULL = Fp32Precision("highest", cudnn_allow_tf32=False)


class Head(torch.nn.Module):
    """A head that must run in full fp32; records the flags its backward ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 4)
        self.backward_ran_in: list[Fp32Precision] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x)
        if out.requires_grad:
            out.register_hook(self._record)  # type: ignore[no-untyped-call]
        return out

    def _record(self, grad: torch.Tensor) -> None:
        del grad  # only when autograd runs this is of interest, not the value
        self.backward_ran_in.append(current_fp32_precision())


def build() -> tuple[torch.nn.Module, Head]:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    head = Head()
    body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh())
    model = torch.nn.Sequential(body, cast("torch.nn.Module", Fp32ScopedModule(head, FULL)))
    return model, head


def worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        set_process_default(Fp32Precision("high", cudnn_allow_tf32=True))
        model, head = build()
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
        for _ in range(STEPS):
            x = torch.randn(8, 16, generator=data)
            loss = ddp(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            # The reducer all-reduced the gradients: every rank holds the same average.
            grad = head.proj.weight.grad
            assert grad is not None
            gathered = [torch.empty_like(grad) for _ in range(WORLD)]
            dist.all_gather(gathered, grad)
            same_grads = all(torch.equal(g, gathered[0]) for g in gathered)
            optimizer.step()
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        all_weights = [torch.empty_like(weights) for _ in range(WORLD)]
        dist.all_gather(all_weights, weights)
        identical = all(torch.equal(w, all_weights[0]) for w in all_weights)
        ran_in = sorted(set(head.backward_ran_in))
        lines = [
            f"rank {rank}: head backward ran in {ran_in} ({len(head.backward_ran_in)} steps)",
            f"rank {rank}: gradients all-reduced (equal on every rank): {same_grads}",
            f"rank {rank}: replicas identical after {STEPS} steps: {identical}",
            f"rank {rank}: flags after training: {current_fp32_precision()}",
        ]
        for turn in range(WORLD):  # one rank after the other: no interleaved lines
            if turn == rank:
                print("\n".join(lines), flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: torch's gloo backend (2.13, on this CPU
    # machine kind) sometimes aborts in it ("terminate called without an active
    # exception"), with plain DDP as well, after all the work is done.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD, join=True)  # type: ignore[no-untyped-call]  # noqa: PTH118
    print("DDP training done: the head trained in full fp32 on every rank")


if __name__ == "__main__":
    main()
