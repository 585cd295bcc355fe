"""FSDP2 mixed precision with a float32 node, wrapped and written by hand, step by step.

Run as a script (``python -m tests._support.autocast_fsdp2 OUT.json``) it spawns two
processes over gloo on the CPU. Each trains, for every configuration, the model
``pre -> router -> post`` sharded with FSDP2 under
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` for
``STEPS`` SGD steps on its own batches, twice: with the router wrapped
``Fp32ScopedModule(router, FULL, autocast=False)``, and with the router made float32 by
hand. Rank 0 writes, per configuration, what each rank found: per step whether the
outputs, the local shards of the gradients and of the parameters are equal (dtype and
values), what the router saw inside (its input and weight dtypes, autocast, precision),
the fp32scope warnings given, and the error of a run that raised.
``tests/training/test_sharded.py`` runs it.

The hand-written stack, decided as what a user writes today for a float32 sub-module
under FSDP2 mixed precision: FSDP2 computes with the parameters of each unit in that
unit's ``param_dtype``, so the only way to a float32 matmul is a unit of its own with a
float32 policy, ``fully_shard(router, mp_policy=MixedPrecisionPolicy(param_dtype=
torch.float32, reduce_dtype=torch.float32))``, before the root's ``fully_shard``
(casting bf16 parameters back with ``.float()`` inside the module gives float32 tensors
holding bf16 values: not the same computation). The module itself does what the wrapper
does: the node's precision scope and autocast off, its input cast to float32
(``HandRouter``). The unit's ``cast_forward_inputs`` (on by default) casts the input to
float32 before either.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fp32scope import Fp32ScopedModule, Fp32ScopeError, current_fp32_precision, fp32_precision_scope
from tests._support import sharded
from tests._support.common import FULL

WORLD = 2
STEPS = 3
BF16 = torch.bfloat16


def policy(param_dtype: torch.dtype) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` (2.6+: public; 2.4-2.5: composable), bf16 or float32 parameters."""
    import importlib

    for home in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            found = getattr(importlib.import_module(home), "MixedPrecisionPolicy", None)
        except ImportError:
            continue
        if found is not None:
            return found(param_dtype=param_dtype, reduce_dtype=torch.float32)
    msg = "this torch has fully_shard but no MixedPrecisionPolicy"
    raise ImportError(msg)


class Router(torch.nn.Module):
    """A float32 node: records what it computes with."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        precision = current_fp32_precision()
        autocast = torch.is_autocast_enabled("cpu")
        weight = self.lin.weight.dtype  # a unit of the Linear's own makes it bf16 inside its call only
        out: torch.Tensor = self.lin(x)
        self.seen.append(f"x {x.dtype} weight {weight} out {out.dtype} autocast {autocast} {precision}")
        return out


class HandRouter(Router):
    """The same node made float32 by hand: its scope, autocast off and its input cast, inside."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fp32_precision_scope(FULL), torch.autocast("cpu", enabled=False):
            return super().forward(x.float())


class Model(torch.nn.Module):
    def __init__(self, router: torch.nn.Module) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(16, 16)
        self.router = router
        self.post = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.pre(x))
        r = self.router(h)
        # Back to the rest's dtype: without autocast, FSDP2's bf16 ``post`` takes bf16 only.
        return self.post(r.softmax(-1).to(h.dtype)), r


# -- configurations: (how the router is placed, whether the step runs under bf16 autocast) --


def _own_unit(order: str) -> Callable[[Model, bool], None]:
    def place(model: Model, wrap: bool) -> None:
        shard = sharded.fully_shard_api()
        assert shard is not None
        if not wrap:
            shard(model.router, mp_policy=policy(torch.float32))
        elif order == "unit-then-proxy":
            shard(model.router, mp_policy=policy(torch.float32))
            model.router = Fp32ScopedModule(model.router, FULL, autocast=False)  # type: ignore[assignment]
        else:  # proxy-then-unit
            model.router = Fp32ScopedModule(model.router, FULL, autocast=False)  # type: ignore[assignment]
            shard(model.router, mp_policy=policy(torch.float32))

    return place


def _in_bf16_unit(model: Model, wrap: bool) -> None:
    # The router's parameters belong to the root's bf16 unit: FSDP2 gives it bf16 weights.
    if wrap:
        model.router = Fp32ScopedModule(model.router, FULL, autocast=False)  # type: ignore[assignment]


def _bf16_unit_inside(model: Model, wrap: bool) -> None:
    # A unit inside the node, with the bf16 policy: still sharded (float32) when the wrapper is called.
    shard = sharded.fully_shard_api()
    assert shard is not None
    shard(model.router.lin, mp_policy=policy(BF16))
    if wrap:
        model.router = Fp32ScopedModule(model.router, FULL, autocast=False)  # type: ignore[assignment]


def _own_bf16_unit(model: Model, wrap: bool) -> None:
    # The router is a unit of its own, with the bf16 policy (one policy for every unit).
    shard = sharded.fully_shard_api()
    assert shard is not None
    if wrap:
        model.router = Fp32ScopedModule(model.router, FULL, autocast=False)  # type: ignore[assignment]
    shard(model.router, mp_policy=policy(BF16))


CONFIGS: dict[str, tuple[Callable[[Model, bool], None], bool]] = {
    "own-fp32-unit-then-proxy-autocast": (_own_unit("unit-then-proxy"), True),
    "own-fp32-proxy-then-unit-autocast": (_own_unit("proxy-then-unit"), True),
    "own-fp32-unit-then-proxy": (_own_unit("unit-then-proxy"), False),
    "own-fp32-proxy-then-unit": (_own_unit("proxy-then-unit"), False),
    "in-bf16-unit": (_in_bf16_unit, False),
    "in-bf16-unit-autocast": (_in_bf16_unit, True),
    "own-bf16-unit": (_own_bf16_unit, False),
    "bf16-unit-inside": (_bf16_unit_inside, False),
}


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    return [torch.randn(8, 16, generator=g) for _ in range(STEPS)]


def _local(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().clone()


def run(name: str, wrap: bool, rank: int) -> dict[str, Any]:
    """One stack of one configuration: per step the outputs, gradients and parameters (local shards)."""
    place, use_autocast = CONFIGS[name]
    shard = sharded.fully_shard_api()
    assert shard is not None
    torch.manual_seed(0)
    router = Router() if wrap else HandRouter()
    model = Model(router)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        place(model, wrap)
        shard(model, mp_policy=policy(BF16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps: list[list[torch.Tensor]] = []
        dtypes: list[str] = []
        error = None
        try:
            for x in _batches(rank):
                opt.zero_grad()
                if use_autocast:
                    with torch.autocast("cpu", dtype=BF16):
                        y, r = model(x)
                else:
                    y, r = model(x)
                (y.float().square().mean() + r.float().square().mean()).backward()
                grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
                opt.step()
                steps.append([y.detach(), r.detach(), *grads, *(_local(p) for p in model.parameters())])
                dtypes = [str(y.dtype), str(r.dtype)]
        except (RuntimeError, Fp32ScopeError) as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    fp32scope_warnings = sorted(
        {f"{w.category.__name__}: {w.message}" for w in caught if w.category.__module__ == "fp32scope"}
    )
    return {"steps": steps, "dtypes": dtypes, "seen": router.seen, "error": error, "warnings": fp32scope_warnings}


def _compare(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> list[bool]:
    # One entry per step either stack completed (a run that raised stops early).
    return [
        step < len(got)
        and step < len(expected)
        and len(got[step]) == len(expected[step])
        and all(u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(got[step], expected[step], strict=True))
        for step in range(max(len(got), len(expected)))
    ]


def compare(name: str, rank: int) -> dict[str, Any]:
    wrapped = run(name, True, rank)
    hand = run(name, False, rank)
    return {
        "steps": [len(wrapped["steps"]), len(hand["steps"])],
        "equal": _compare(wrapped["steps"], hand["steps"]),
        "wrapped": {k: v for k, v in wrapped.items() if k != "steps"},
        "hand": {k: v for k, v in hand.items() if k != "steps"},
    }


def worker(rank: int, init_file: str, out: str, names: list[str]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results: dict[str, Any] = {}
    for name in names:
        try:
            found: Any = compare(name, rank)
        except Exception:  # reported per configuration; the others still run
            found = {"harness-error": traceback.format_exc()}
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, found)
        results[name] = gathered
    if rank == 0:
        with open(out, "w") as f:  # noqa: PTH123
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch's gloo sometimes aborts in the interpreter's teardown


def main(argv: list[str]) -> None:
    from torch.multiprocessing.spawn import spawn

    out = argv[0]
    names = argv[1:] or list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, args=(os.path.join(tmp, "rdzv"), out, names), nprocs=WORLD, join=True)  # type: ignore[no-untyped-call]  # noqa: PTH118


if __name__ == "__main__":
    main(sys.argv[1:])
