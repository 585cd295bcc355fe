"""Per-process defaults in multi-process workers.

The float32 precision flags belong to a process: a ``torch.multiprocessing`` worker
starts (with the ``spawn`` context) with torch's own defaults, not its parent's. Each
worker therefore sets its default with ``set_process_default`` in the pool's initializer,
then runs its nodes in scopes as a single-process engine does.
"""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from fp32scope import Fp32Precision, Fp32ScopedModule, current_fp32_precision, set_process_default

WORKER_DEFAULT = Fp32Precision("high", cudnn_allow_tf32=True)
NODE_PRECISION = Fp32Precision("highest", cudnn_allow_tf32=False)


class Probe(torch.nn.Module):
    """A node that reports the precision its forward runs with."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Fp32Precision]:
        return x * 2, current_fp32_precision()


def init_worker(default: Fp32Precision) -> None:
    """Pool initializer: runs once in each worker process, before any task."""
    torch.set_num_threads(1)
    set_process_default(default)


def run_node(task: int) -> tuple[int, int, Fp32Precision, Fp32Precision, Fp32Precision]:
    """One task: the worker's default, the precision inside a scoped node, and after it."""
    node = Fp32ScopedModule(Probe(), NODE_PRECISION, name="probe")
    before = current_fp32_precision()
    _, inside = node(torch.ones(2))
    return task, os.getpid(), before, inside, current_fp32_precision()


def main() -> None:
    print(f"parent process {os.getpid()}: {current_fp32_precision()} (torch's default, left alone)")
    context = mp.get_context("spawn")
    with context.Pool(2, initializer=init_worker, initargs=(WORKER_DEFAULT,)) as pool:
        results = pool.map(run_node, range(4))
    for task, pid, before, inside, after in results:
        print(f"task {task} in worker {pid}: default {before}, inside the node {inside}, after {after}")
        assert before == after == WORKER_DEFAULT
        assert inside == NODE_PRECISION
    print(f"parent process afterwards: {current_fp32_precision()}")
    print("every worker ran with its own default and its node's precision")


if __name__ == "__main__":
    main()
