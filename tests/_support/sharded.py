"""Sharded training with a scoped block, against an unsharded single-process reference.

Run as a script (``python -m tests._support.sharded OUT.json [CONFIG ...]``) it spawns two processes
over gloo on the CPU; each trains, for every configuration, the model
``pre -> block (residual) -> post`` for ``STEPS`` SGD steps on its own batch, the block
declared full fp32 and the process default "high". Rank 0 writes, per configuration and
step, the largest difference between the trained model's full parameters and those of the
same model trained in one process, unsharded and without fp32scope, on both ranks' batches
(so that a gradient that arrives late or not at all shows at the next step), the full
parameters themselves (to compare with the same wrapper without fp32scope), and what the
probes (``tests/_support/probe.py``) saw: the precision of the block's forward and backward and of
the rest. A configuration that fails writes its error instead. ``tests/training/test_sharded.py``
runs it once and checks each configuration.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from fp32scope import (
    Fp32ScopedModule,
    scope_modules,
    set_process_default,
    with_fp32_precision,
)
from fp32scope._flags import torch_flags as _flags
from fp32scope._wrappers import inner
from tests._support import probe as probes
from tests._support.common import DEFAULT, FULL
from tests._support.probe import probe

WORLD = 2
STEPS = 3
BATCH = 4
WIDTH = 8


def fully_shard_api() -> Callable[..., Any] | None:
    """FSDP2's ``fully_shard`` where this torch has it (2.6+: public; 2.4-2.5: composable)."""
    import importlib

    for home in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            found = getattr(importlib.import_module(home), "fully_shard", None)
        except ImportError:
            continue
        if found is not None:
            return cast("Callable[..., Any]", found)
    return None


class Block(torch.nn.Module):
    """Two layers with probes: where the block's forward and backward run."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(probe(x, "block-in")))
        return probe(self.out(h), "block-out")


class Model(torch.nn.Module):
    def __init__(self, *, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(WIDTH, WIDTH)
        self.block: torch.nn.Module = Block()
        self.post = torch.nn.Linear(WIDTH, 4)
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = probe(torch.tanh(self.pre(x)), "pre")
        b = checkpoint(self.block, h, use_reentrant=False) if self.use_checkpoint else self.block(h)
        return probe(self.post(h + b), "post")


def batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(BATCH, WIDTH, generator=g) for _ in range(STEPS)]


def new_model(**kwargs: Any) -> Model:
    torch.manual_seed(0)
    return Model(**kwargs)


def reference() -> list[dict[str, torch.Tensor]]:
    """Full parameters after each step: one process, unsharded, both ranks' batches."""
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = [batches(r) for r in range(WORLD)]
    states = []
    for step in range(STEPS):
        x = torch.cat([data[r][step] for r in range(WORLD)])
        opt.zero_grad()
        torch.autograd.backward(model(x).square().mean())
        opt.step()
        states.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return states


def _decorate_forward(module: torch.nn.Module) -> None:
    module.forward = with_fp32_precision(FULL, name="block.forward")(module.forward)


def _scope(module: torch.nn.Module, *, in_graph: bool = False) -> torch.nn.Module:
    return cast("torch.nn.Module", Fp32ScopedModule(module, FULL, name="block", in_graph=in_graph))


def _compiled(model: torch.nn.Module, backend: str = "aot_eager") -> torch.nn.Module:
    # aot_eager: the region's op and the graph around it, with AOTAutograd's backward (the
    # node run eagerly inside its op). Inductor: the node compiled inside its op
    # (fp32scope/_wrappers/inner/), the parent's graph split by DDP's optimizer at buckets.
    return cast("torch.nn.Module", torch.compile(model, backend=backend))


# -- configurations: each returns (model to train, a function giving its full parameters) --

Built = tuple[torch.nn.Module, Callable[[], dict[str, torch.Tensor]]]


def _plain_params(model: torch.nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    def read() -> dict[str, torch.Tensor]:
        return {_clean(k): v.detach().clone() for k, v in model.named_parameters()}

    return read


def _clean(name: str) -> str:
    # Wrapper prefixes that FSDP1 and DDP add to parameter names.
    for part in ("_fsdp_wrapped_module.", "module.", "_checkpoint_wrapped_module."):
        name = name.replace(part, "")
    return name


def _dtensor_params(model: torch.nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    def read() -> dict[str, torch.Tensor]:
        out = {}
        for k, v in model.named_parameters():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[_clean(k)] = full.detach().clone()
        return out

    return read


def fsdp2(variant: str, *, reshard: bool = True, use_checkpoint: bool = False) -> Callable[[], Built]:
    def build() -> Built:
        shard = fully_shard_api()
        assert shard is not None
        model = new_model(use_checkpoint=use_checkpoint)
        block = model.block
        if variant == "none":
            shard(block, reshard_after_forward=reshard)
        elif variant == "proxy-then-shard":
            model.block = _scope(block)
            shard(model.block, reshard_after_forward=reshard)
        elif variant == "shard-then-proxy":
            shard(block, reshard_after_forward=reshard)
            model.block = _scope(block)
        elif variant == "decorated":
            _decorate_forward(block)
            shard(block, reshard_after_forward=reshard)
        elif variant == "unit-inside-proxy":
            shard(cast("Block", block).inner, reshard_after_forward=reshard)
            model.block = _scope(block)
        elif variant == "unit-inside-decorated":
            shard(cast("Block", block).inner, reshard_after_forward=reshard)
            _decorate_forward(block)
        else:  # pragma: no cover
            raise ValueError(variant)
        shard(model, reshard_after_forward=reshard)
        return model, _dtensor_params(model)

    return build


def fsdp2_region(*, as_unit: bool, backend: str = "aot_eager", scoped: bool = True) -> Callable[[], Built]:
    """The block an in-graph region inside the root's unit, or a unit itself (refused), compiled whole.

    ``scoped=False``: the same model compiled the same way without fp32scope (a control).
    """

    def build() -> Built:
        shard = fully_shard_api()
        assert shard is not None
        model = new_model()
        if scoped:
            model.block = _scope(model.block, in_graph=True)
        if as_unit:  # the region would take its sharded parameters: refused while traced
            shard(model.block)
        shard(model)
        return _compiled(model, backend), _dtensor_params(model)

    return build


def fsdp2_policy(variant: str, *, reshard: bool = True) -> Callable[[], Built]:
    """FSDP2 per block and root (the torchtitan order), with ``scope_modules`` before or after."""

    def build() -> Built:
        shard = fully_shard_api()
        assert shard is not None
        model = new_model()
        if variant == "policy-then-shard":
            assert scope_modules(model, {"block": FULL}) == {"block": FULL}
        shard(model.block, reshard_after_forward=reshard)
        if variant == "shard-then-policy":  # the class selects FSDP's subclass of Block too
            assert scope_modules(model, {Block: FULL}) == {"block": FULL}
        shard(model, reshard_after_forward=reshard)
        if variant == "all-sharded-then-policy":
            assert scope_modules(model, {Block: FULL}) == {"block": FULL}
        return model, _dtensor_params(model)

    return build


def fsdp1(variant: str) -> Callable[[], Built]:
    def build() -> Built:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

        cpu = torch.device("cpu")  # FSDP1 refuses the CPU unless told
        model = new_model()
        if variant == "none":
            model.block = FSDP(model.block, device_id=cpu)
        elif variant == "proxy-around-unit":
            model.block = _scope(FSDP(model.block, device_id=cpu))
        elif variant == "decorated-inside-unit":
            _decorate_forward(model.block)
            model.block = FSDP(model.block, device_id=cpu)
        else:  # pragma: no cover
            raise ValueError(variant)
        root = FSDP(model, device_id=cpu)

        def read() -> dict[str, torch.Tensor]:
            with FSDP.summon_full_params(root):
                return {_clean(k): v.detach().clone() for k, v in root.named_parameters()}

        return root, read

    return build


def ddp(variant: str, *, backend: str | None = None, **kwargs: Any) -> Callable[[], Built]:
    """DDP around the model; ``backend``: the DDP-wrapped model compiled whole with it (torch's recipe)."""

    def build() -> Built:
        from torch.nn.parallel import DistributedDataParallel

        model = new_model(use_checkpoint=variant == "checkpoint")
        if variant != "none":
            model.block = _scope(model.block, in_graph=variant == "region")
        wrapped = DistributedDataParallel(model, **kwargs)
        if backend is not None:
            return _compiled(wrapped, backend), _plain_params(model)
        return wrapped, _plain_params(model)

    return build


CONFIGS: dict[str, Callable[[], Built]] = {
    "fsdp2-control": fsdp2("none"),
    "fsdp2-proxy-then-shard": fsdp2("proxy-then-shard"),
    "fsdp2-proxy-then-shard-no-reshard": fsdp2("proxy-then-shard", reshard=False),
    "fsdp2-shard-then-proxy": fsdp2("shard-then-proxy"),
    "fsdp2-shard-then-proxy-no-reshard": fsdp2("shard-then-proxy", reshard=False),
    "fsdp2-decorated": fsdp2("decorated"),
    "fsdp2-unit-inside-proxy": fsdp2("unit-inside-proxy"),
    "fsdp2-unit-inside-decorated": fsdp2("unit-inside-decorated"),
    "fsdp2-unit-inside-proxy-no-reshard": fsdp2("unit-inside-proxy", reshard=False),
    "fsdp2-proxy-then-shard-checkpoint": fsdp2("proxy-then-shard", use_checkpoint=True),
    "fsdp2-shard-then-proxy-checkpoint": fsdp2("shard-then-proxy", use_checkpoint=True),
    "fsdp2-unit-inside-proxy-checkpoint": fsdp2("unit-inside-proxy", use_checkpoint=True),
    "fsdp2-policy-then-shard": fsdp2_policy("policy-then-shard"),
    "fsdp2-policy-then-shard-no-reshard": fsdp2_policy("policy-then-shard", reshard=False),
    "fsdp2-shard-then-policy": fsdp2_policy("shard-then-policy"),
    "fsdp2-all-sharded-then-policy": fsdp2_policy("all-sharded-then-policy"),
    "fsdp2-region-in-root-unit-compiled": fsdp2_region(as_unit=False),
    "fsdp2-region-as-unit-compiled": fsdp2_region(as_unit=True),
    "fsdp2-control-inductor": fsdp2_region(as_unit=False, backend="inductor", scoped=False),
    "fsdp2-region-in-root-unit-inductor": fsdp2_region(as_unit=False, backend="inductor"),
    "fsdp1-control": fsdp1("none"),
    "fsdp1-proxy-around-unit": fsdp1("proxy-around-unit"),
    "fsdp1-decorated-inside-unit": fsdp1("decorated-inside-unit"),
    "ddp-control": ddp("none"),
    "ddp-static-graph": ddp("proxy", static_graph=True),
    "ddp-bucket-view": ddp("proxy", gradient_as_bucket_view=True),
    "ddp-checkpoint": ddp("checkpoint", static_graph=True),
    "ddp-region-compiled": ddp("region", backend="aot_eager"),
    "ddp-control-inductor": ddp("none", backend="inductor"),
    "ddp-region-inductor": ddp("region", backend="inductor"),
}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP's and fp32scope's one-time notes: not the point here
        yield


def train(name: str, rank: int, expected: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """One configuration on this rank: the differences per step and what the probes saw."""
    set_process_default(DEFAULT)
    before = _flags.read_all()
    entries_before = set(inner._entries)
    with _quiet():
        model, read = CONFIGS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    diffs = []
    states = []
    probes.SEEN.clear()
    for step, x in enumerate(batches(rank)):
        opt.zero_grad()
        with _quiet():
            torch.autograd.backward(model(x).square().mean())
        opt.step()
        got = read()
        diffs.append(max((got[k] - v).abs().max().item() for k, v in expected[step].items()))
        states.append({k: got[k].flatten().tolist() for k in sorted(expected[step])})
    seen: dict[str, list[str]] = {}
    for phase, tag, precision in probes.SEEN:
        seen.setdefault(f"{phase} {tag}", [])
        if str(precision) not in seen[f"{phase} {tag}"]:
            seen[f"{phase} {tag}"].append(str(precision))
    return {
        "diffs": diffs,
        "states": states,
        "seen": seen,
        "flags_restored": _flags.read_all() == before,
        "compiled_inside": _ran_compiled_inside(entries_before),
    }


def _ran_compiled_inside(before: set[int]) -> int:
    """How many region calls made since ``before`` ran compiled inside their op, forward and backward."""
    ran = 0
    for number, ref in list(inner._entries.items()):
        entry = ref()
        if number in before or entry is None or entry.backward is None:
            continue
        ran += entry.forward.fast is not None and entry.backward.fast is not None
    return ran


def worker(rank: int, init_file: str, out: str, names: list[str]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    expected = reference()
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = train(name, rank, expected)
        except Exception:  # reported per configuration; the others still run
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:  # noqa: PTH123
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    # torch's gloo sometimes aborts in the interpreter's teardown (see examples/ddp_training.py).
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str]) -> None:
    from torch.multiprocessing.spawn import spawn

    out = argv[0]
    names = argv[1:] or list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(worker, args=(os.path.join(tmp, "rdzv"), out, names), nprocs=WORLD, join=True)  # type: ignore[no-untyped-call]  # noqa: PTH118


if __name__ == "__main__":
    main(sys.argv[1:])
