"""DDP under bf16 autocast with an ``autocast=False`` router, against the hand-written stack.

Run as a script (``python -m tests._support.autocast_ddp``) it spawns two processes over gloo on the
CPU; each trains, on its own batches, the model of ``tests/wrappers/test_autocast.py`` twice under
DDP: with the router wrapped ``Fp32ScopedModule(router, FULL, autocast=False)``, and with
the router made float32 by hand. Rank 0 prints one line per step whose outputs, gradients
(all-reduced) and parameters are equal in both; any difference exits non-zero.
``tests/wrappers/test_autocast.py`` runs it.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests._support.autocast_model import STEPS, pair, train

WORLD = 2


def worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        wrapped, hand = pair()
        runs = []
        for model in (wrapped, hand):
            ddp = DistributedDataParallel(model)
            runs.append(train(model, ddp, seed=1 + rank))  # each rank its own batches
        for step, (got, expected) in enumerate(zip(*runs, strict=True)):
            for i, (a, b) in enumerate(zip(got, expected, strict=True)):
                if a.dtype != b.dtype or not torch.equal(a, b):
                    print(f"rank {rank} step {step}: tensor {i} differs", flush=True)
                    sys.exit(1)
            if rank == 0:
                print(f"step {step}: step equal to the hand-written stack", flush=True)
        assert len(runs[0]) == STEPS
        dist.barrier()  # neither rank tears gloo down while the other still uses it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    # torch's gloo sometimes aborts in the interpreter's teardown ("terminate called without
    # an active exception", SIGABRT, after every step had matched; seen on Python 3.10).
    os._exit(0)


def main() -> None:
    from torch.multiprocessing.spawn import spawn

    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, args=(os.path.join(tmp, "rdzv"),), nprocs=WORLD, join=True)  # type: ignore[no-untyped-call]  # noqa: PTH118


if __name__ == "__main__":
    main()
