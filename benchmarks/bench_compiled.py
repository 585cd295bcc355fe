"""What a scoped node costs inside a ``torch.compile``'d model, whole-model and regional.

Run with ``nox -s bench`` (or ``python benchmarks/bench_compiled.py``). The model: an
8-block stack of ``Linear(256, 256)`` + GELU, batch 32, inductor, one thread, with 0, 1
or 4 of its blocks scoped to full float32 (``Fp32ScopedModule``) and the process default
``Fp32Precision("highest", False)`` too, so that every variant runs the same matmuls and a
difference is what the scoping costs, not a precision difference.

Three ways to compile it:

- whole-model: ``torch.compile(model)``. Each scoped block is a graph break: the parent is
  compiled as several graphs, with the scoped blocks compiled as graphs of their own
  inside their scopes.
- in-graph: ``torch.compile(model)`` with the scoped blocks made with ``in_graph=True``:
  one graph, each scoped block one opaque region op in it, run eagerly inside its scope
  (forward, and backward over the forward's kept graph).
- regional: each block compiled on its own (``torch.compile(block)``, the scoped ones
  inside their proxies: ``Fp32ScopedModule(torch.compile(block), precision)``) and the
  stack itself left eager, which is torch's "regional compilation".

For each: the median training step (forward, loss, backward, gradients cleared) and
``no_grad`` call over ``--repeats`` interleaved loops, the graphs Dynamo made and the
graph breaks it counted, and the cost per scoped node: the median over rounds of
(time with n scoped - time with 0 scoped) / n, both loops of the same round (paired).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
import warnings
from collections.abc import Callable

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import fp32scope
from fp32scope import Fp32Precision, Fp32ScopedModule

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

FULL = Fp32Precision("highest", False)
BLOCKS = 8
WIDTH = 256
BATCH = 32


def stack(scoped: int, *, how: str) -> torch.nn.Module:
    """The 8-block stack, ``scoped`` blocks (spread out) scoped; compiled as ``how`` says (see HOWS)."""
    regional = how == "regional"
    torch.manual_seed(0)
    where = {round(i * BLOCKS / scoped) for i in range(scoped)} if scoped else set()
    blocks: list[torch.nn.Module] = []
    for i in range(BLOCKS):
        block: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())
        if regional:
            block = torch.compile(block)  # type: ignore[assignment]
        if i in where:
            block = Fp32ScopedModule(block, FULL, name=f"block{i}", in_graph=how == "in-graph")  # type: ignore[assignment]
        blocks.append(block)
    model = torch.nn.Sequential(*blocks)
    return model if regional else torch.compile(model)  # type: ignore[return-value]


#: How the stack is compiled: scoped blocks as graph breaks, as in-graph regions, or per block.
HOWS = ("whole-model", "in-graph", "regional")
#: (how, number of scoped blocks) of each variant; "in-graph, 0 scoped" is "whole-model, 0 scoped".
VARIANTS = [(how, scoped) for how in HOWS for scoped in (0, 1, 4) if (how, scoped) != ("in-graph", 0)]


def label(how: str, scoped: int) -> str:
    """A variant's name: ``whole-model, 1 scoped``."""
    return f"{how}, {scoped} scoped"


def base_label(how: str) -> str:
    """The variant with no scoped block that ``how`` is compared with."""
    return label("regional" if how == "regional" else "whole-model", 0)


def measure(model: torch.nn.Module, x: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    """A training step and a ``no_grad`` call of ``model``."""
    params = list(model.parameters())

    def train() -> None:
        torch.autograd.backward(model(x).square().mean())
        for p in params:
            p.grad = None

    def infer() -> None:
        with torch.no_grad():
            model(x)

    return train, infer


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0912, PLR0915  (one flat script)
    """Build, compile, measure; print the figures (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=50, help="steps per timing loop")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fp32scope.set_process_default(FULL)
    x = torch.randn(BATCH, WIDTH)

    # First each variant alone, with a fresh Dynamo, to count its graphs and graph breaks.
    graphs: dict[str, tuple[int, int]] = {}
    for how, scoped in VARIANTS:
        torch._dynamo.reset()
        counters.clear()
        train, infer = measure(stack(scoped, how=how), x)
        for _ in range(2):
            train()
            infer()
        breaks = sum(counters["graph_break"].values())
        graphs[label(how, scoped)] = (int(counters["stats"]["unique_graphs"]), breaks)
    # Then all of them, compiled again and timed interleaved: no reset between them, and room
    # in Dynamo's cache for the entries they add to the code objects they share
    # (Sequential.forward among them), where Dynamo would otherwise run the later ones eagerly.
    config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):
        if limit in config._config:  # type: ignore[attr-defined]
            setattr(config, limit, 256)
    torch._dynamo.reset()
    cases: dict[str, Callable[[], None]] = {}
    for how, scoped in VARIANTS:
        train, infer = measure(stack(scoped, how=how), x)
        for _ in range(3):  # compile (train and no_grad graphs), then warm up
            train()
            infer()
        cases[f"{label(how, scoped)}: train step"] = train
        cases[f"{label(how, scoped)}: no_grad call"] = infer
    # Each variant compiled once above; later calls must not compile again (a recompile
    # would be timed): the compile counters stand still from here.
    frames_before = counters["frames"]["total"]
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            samples[name].append(timeit.Timer(fn).timeit(number=args.number) / args.number * 1e6)
    if counters["frames"]["total"] != frames_before:
        print("error: a timed call compiled again; the figures would include compiling", file=sys.stderr)
        return 1
    med = {name: statistics.median(values) for name, values in samples.items()}

    print(f"torch {torch.__version__}, fp32scope {fp32scope.__version__}, inductor, 1 thread")
    print(f"{BLOCKS} blocks of Linear({WIDTH}, {WIDTH}) + GELU, batch {BATCH}; process default {FULL}")
    print(f"median of {args.repeats} interleaved loops x {args.number}, microseconds per step or call")
    width = max(map(len, med))
    for name, value in med.items():
        print(f"  {name:<{width}}  {value:9.1f}")
    print("graphs Dynamo made and graph breaks it counted, each variant alone (two train steps, two calls):")
    for name, (made, breaks) in graphs.items():
        print(f"  {name}: {made} graphs, {breaks} graph breaks")
    per_node: dict[str, float] = {}
    for how in HOWS:
        for what in ("train step", "no_grad call"):
            base = samples[f"{base_label(how)}: {what}"]
            for scoped in (1, 4):
                mine = samples[f"{label(how, scoped)}: {what}"]
                paired = [(m - b) / scoped for m, b in zip(mine, base, strict=True)]
                per_node[f"{how}, {what}, {scoped} scoped"] = statistics.median(paired)
    print("cost per scoped node, us (median over rounds of (time with n scoped - with 0) / n, same round):")
    for name, value in per_node.items():
        print(f"  {name}: {value:.1f}")
    print("in-graph region / graph break, per scoped node (below 1: the region costs less):")
    for what in ("train step", "no_grad call"):
        for scoped in (1, 4):
            region = per_node[f"in-graph, {what}, {scoped} scoped"]
            broken = per_node[f"whole-model, {what}, {scoped} scoped"]
            ratio = region / broken if broken > 0 else float("nan")
            per_node[f"in-graph / whole-model, {what}, {scoped} scoped"] = ratio
            print(f"  {scoped} scoped, {what}: {ratio:.2f}")
    print("regional / whole-model, same number scoped (what compiling per block costs or saves):")
    for scoped in (0, 1, 4):
        for what in ("train step", "no_grad call"):
            ratio = med[f"regional, {scoped} scoped: {what}"] / med[f"whole-model, {scoped} scoped: {what}"]
            per_node[f"regional / whole-model, {what}, {scoped} scoped"] = ratio
            print(f"  {scoped} scoped, {what}: {ratio:.2f}")
    if args.json:
        print(json.dumps({"median_us": med, "graphs": graphs, "per_scoped_node_us": per_node}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
