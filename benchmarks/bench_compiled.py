"""What a scoped node costs inside a ``torch.compile``'d model, whole-model and regional.

Run with ``nox -s bench`` (or ``python benchmarks/bench_compiled.py``). The model: an
8-block stack of ``Linear(256, 256)`` + GELU, batch 32, inductor, one thread, with 0, 1
or 4 of its blocks scoped to full float32 (``Fp32ScopedModule``) and the process default
``Fp32Precision("highest", False)`` too, so that every variant runs the same matmuls and a
difference is what the scoping costs, not a precision difference.

Three ways to compile it:

- whole-model: ``torch.compile(model)``. Each scoped block is a graph break, inside the
  stack's loop (as in ``nn.Sequential``): Dynamo gives up on the stack's frame, runs its
  loop eagerly and compiles each block as a graph of its own, the scoped ones inside their
  scopes.
- in-graph: ``torch.compile(model)`` with the scoped blocks made with ``in_graph=True``:
  one graph, each scoped block one opaque region op in it (two in training: forward and
  backward), its node compiled by Inductor inside the op and run inside its scope.
- regional: each block compiled on its own (``torch.compile(block)``, the scoped ones
  inside their proxies: ``Fp32ScopedModule(torch.compile(block), precision)``) and the
  stack itself left eager, which is torch's "regional compilation".

For each: the median training step (forward, loss, backward, gradients cleared) and
``no_grad`` call over ``--repeats`` interleaved loops, the graphs Dynamo made and the
graph breaks it counted (those it resumed after: the break in the stack's loop, after which
it skips the stack's frame instead, is not counted), the Python ``forward`` frames a warm
call ran, and the cost per scoped node: the median over rounds of (time with n scoped -
time with 0 scoped) / n, both loops of the same round (paired).

Then, apart from the model, what a region's op adds per call (see ``op_overheads``): each
op of the in-graph stack's region against its node's compiled code called alone, in a
tight loop, with a do-nothing op of the same schema as the dispatcher's floor. And in the
model, paired per round with the unscoped stack, the in-graph variants with fp32scope's op
kernels against the same graphs with bare kernels (see ``floor_rounds``: each only finds its
node's compiled code and calls it), which is what any region that runs its node's compiled
code from an op pays, whatever fp32scope does around it.

Each variant is built from classes of its own, whose ``forward`` runs a code object of its
own (see ``fresh``): a graph break inside a loop makes Dynamo skip that loop's code object
for good (torch 2.4 and 2.13 alike), so variants sharing ``nn.Sequential.forward`` would run
every later one eagerly, silently. And the bench checks that what it times runs as it says
(see ``check``): after warmup, one training step and one ``no_grad`` call of each variant are
profiled, and it exits 1, naming the variant and the frames, if the Python ``forward`` of a
module that should run compiled ran. What runs eagerly by design, and is allowed:

- whole-model, n > 0 scoped: the stack's own ``forward``. Its loop holds a graph break, so
  Dynamo skips the stack's frame (as it would ``nn.Sequential``'s) and compiles each block
  as a frame of its own: the unscoped blocks each in their graph, the scoped ones in theirs
  inside their scopes (their Python ``forward`` does not run either).
- in-graph: nothing; the stack and every block run in the one graph, a scoped block's
  node as Inductor's code inside its op.
- regional: the stack's ``forward``, left eager on purpose; no block's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import timeit
import types
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import fp32scope
from fp32scope import Fp32Precision, Fp32ScopedModule
from fp32scope._wrappers.inner.entries import _entry

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

FULL = Fp32Precision("highest", False)
BLOCKS = 8
WIDTH = 256
BATCH = 32

M = TypeVar("M", bound=torch.nn.Module)


class Block(torch.nn.Module):
    """``Linear(WIDTH, WIDTH)`` + GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.gelu = torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gelu(self.linear(x))  # type: ignore[no-any-return]


class Stack(torch.nn.Module):
    """The blocks one after the other, in a loop, as ``nn.Sequential`` runs them."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def fresh(cls: type[M]) -> type[M]:
    """A subclass of ``cls`` whose ``forward`` is a new function running a new code object.

    Dynamo keys what it decides about a frame on the frame's code object: a graph break in
    a loop (the stack's, with a scoped block in it) makes it skip that code object for good,
    and every later module running it then runs eagerly. A new class with the same function
    (same code object) would share that fate, so the code object is copied: the same
    bytecode, a distinct object. This keeps all the variants in one process, which the
    paired, interleaved timing needs (a subprocess per variant could not pair rounds).
    """
    forward = cls.forward
    code = forward.__code__.replace()  # a copy: CodeType.replace always makes a new object
    if code is forward.__code__:  # the premise above, checked
        msg = "CodeType.replace() returned the same code object; the variants would share it"
        raise RuntimeError(msg)
    function = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__)
    function.__qualname__ = forward.__qualname__
    function.__kwdefaults__ = forward.__kwdefaults__
    namespace = {"forward": function, "__qualname__": cls.__qualname__, "__module__": cls.__module__}
    return cast("type[M]", type(cls.__name__, (cls,), namespace))


class Built(NamedTuple):
    """A variant's model, and what its Python ``forward`` frames may do (see ``check``)."""

    model: torch.nn.Module
    #: The ``forward`` code objects of the modules watched (the stack, blocks, Linear, GELU).
    codes: frozenset[types.CodeType]
    #: Each watched module, by id: its name and whether its Python ``forward`` may run.
    watched: dict[int, tuple[str, bool]]


def stack(scoped: int, *, how: str) -> Built:
    """The 8-block stack, ``scoped`` blocks (spread out) scoped; compiled as ``how`` says (see HOWS)."""
    regional = how == "regional"
    in_graph = how == "in-graph"
    torch.manual_seed(0)
    where = {round(i * BLOCKS / scoped) for i in range(scoped)} if scoped else set()
    stack_class, block_class = fresh(Stack), fresh(Block)  # this variant's own code objects
    watched: dict[int, tuple[str, bool]] = {}
    blocks: list[torch.nn.Module] = []
    for i in range(BLOCKS):
        block: torch.nn.Module = block_class()
        # No block's forward runs in Python: under Inductor a region's node is compiled
        # inside its op.
        for name, module in block.named_modules(prefix=f"block{i}"):
            watched[id(module)] = (name, False)
        if regional:
            block = torch.compile(block)  # type: ignore[assignment]
        if i in where:
            block = Fp32ScopedModule(block, FULL, name=f"block{i}", in_graph=in_graph)  # type: ignore[assignment]
        blocks.append(block)
    model = stack_class(blocks)
    # The stack runs eagerly when left so (regional) and when Dynamo skips its frame for the
    # graph break in its loop (whole-model with a scoped block).
    watched[id(model)] = ("stack", regional or (how == "whole-model" and scoped > 0))
    codes = frozenset(
        {stack_class.forward.__code__, block_class.forward.__code__}
        | {torch.nn.Linear.forward.__code__, torch.nn.GELU.forward.__code__}
    )
    return Built(model if regional else torch.compile(model), codes, watched)  # type: ignore[arg-type]


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


def python_forwards(built: Built, fn: Callable[[], None]) -> list[str]:
    """The watched modules whose own Python ``forward`` ran in ``fn()``, in call order.

    Its own: the original code object. A frame Dynamo compiled runs code it made from it (a
    different object), and a graph runs no frame at all, so neither is counted.
    """
    seen: list[str] = []

    def profile(frame: types.FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code in built.codes:
            module = frame.f_locals.get("self")
            seen.append(built.watched.get(id(module), (f"an unwatched {type(module).__name__}", False))[0])

    # Called inside the compiled calls it watches, where Dynamo would trace it as a frame of
    # its own (and count it as one): kept out of Dynamo's sight.
    sys.setprofile(torch.compiler.disable(profile, recursive=True))  # type: ignore[no-untyped-call]
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def tally(frames: list[str]) -> str:
    """``stack, block0 (x2)``: each name once, in order, with how often when more than once."""
    counts = Counter(frames)
    return ", ".join(name if counts[name] == 1 else f"{name} (x{counts[name]})" for name in counts)


def check(name: str, built: Built, train: Callable[[], None], infer: Callable[[], None]) -> list[str]:
    """Profile one training step and one ``no_grad`` call; exit 1 if a module meant to run compiled ran eagerly.

    Returns the Python ``forward`` frames seen (allowed ones), for the report.
    """
    allowed = {module_name for module_name, may in built.watched.values() if may}
    seen: list[str] = []
    for what, fn in (("train step", train), ("no_grad call", infer)):
        frames = python_forwards(built, fn)
        wrong = [frame for frame in frames if frame not in allowed]
        if wrong:
            print(
                f"error: {name}, {what}: the Python forward of {tally(wrong)} ran, which should run compiled "
                f"(Python forward frames seen: {tally(frames)}); its figures would not be what they claim.",
                file=sys.stderr,
            )
            raise SystemExit(1)
        seen.extend(frame for frame in frames if frame not in seen)
    return seen


def _laid_out(graph: Any) -> list[torch.Tensor]:
    """Random tensors laid out as ``graph`` (an entry's compiled graph) was compiled for."""
    return [
        # Storage as long as the layout reaches (an expanded or padded layout spans more or less than numel).
        torch.randn(
            1 + sum((n - 1) * step for n, step in zip(size, stride, strict=True) if n), dtype=example.dtype
        ).as_strided(size, stride)
        for (size, stride), example in zip(graph.inputs, graph.example, strict=True)
    ]


def _new_tensor(_site: int, _entry: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(values[0])]


def _fresh_list_call(fn: Callable[[list[Any]], object], values: list[torch.Tensor]) -> object:
    return fn(list(values))


def op_overheads(model: torch.nn.Module, x: torch.Tensor, repeats: int) -> dict[str, tuple[float, float]]:
    """What a region's op adds to its node's compiled code per call, in a tight loop: ``{op: (code, op)}`` us.

    Reads fp32scope's private entry table on purpose. ``model`` (one scoped block) is run
    once more, so that its region has a warm entry for its ``no_grad`` layout and one for
    training (entries of other variants' regions are alike: every block is the same). The
    op the parent's code calls (``fp32scope::inner``, ``inner_fwd``, ``inner_bwd``) is timed
    against the entry's compiled graph called alone on the same inputs; and, as the floor,
    an op of the same schema whose kernel only returns a new tensor against that kernel
    called as a Python function. Both numbers are medians of ``repeats`` loops of 200 calls.
    The difference is the dispatcher, the scope, the state and stride checks; in the model
    the same calls run with caches cold from the node's kernels, and cost more (see the
    guide).
    """
    from fp32scope._wrappers import inner

    train, infer = measure(model, x)
    train()
    infer()
    entries = [entry for ref in list(inner._entries.values()) if (entry := ref()) is not None]
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    for entry in entries:
        graphs = [("inner" if entry.backward is None else "inner_fwd", entry.forward)]
        if entry.backward is not None:
            graphs.append(("inner_bwd", entry.backward))
        for name, graph in graphs:
            if graph.fast is None:
                continue  # never ran (a layout traced but not called warm)
            values = _laid_out(graph)
            op = getattr(torch.ops.fp32scope, name).default
            fast = graph.fast
            # The compiled code empties the list it is given: a fresh list per call, as the op's kernel makes.
            pairs[name] = (
                functools.partial(_fresh_list_call, fast, values),
                functools.partial(op, 0, entry.number, values),
            )
    wanted = {"inner", "inner_fwd", "inner_bwd"}
    if set(pairs) != wanted:
        found = sorted(pairs)
        print(f"error: expected the region ops {sorted(wanted)} in the warm model, found {found}", file=sys.stderr)
        raise SystemExit(1)
    # The floor: an op of the same schema whose Python kernel only returns a new tensor.
    floor = torch.library.Library("fp32scope_bench", "FRAGMENT")  # type: ignore[no-untyped-call]
    floor.define("new_tensor(int site, int entry, Tensor[] values) -> Tensor[]")  # type: ignore[no-untyped-call]
    floor.impl("new_tensor", _new_tensor, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    values = _laid_out(entries[0].forward)
    new_tensor = torch.ops.fp32scope_bench.new_tensor.default
    pairs["a do-nothing op"] = (
        functools.partial(_new_tensor, 0, 0, values),
        functools.partial(new_tensor, 0, 0, values),
    )
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in pairs}
    with torch.no_grad():
        for _ in range(repeats):
            for name, (code, op) in pairs.items():
                for fn, into in ((code, times[name][0]), (op, times[name][1])):
                    into.append(timeit.Timer(fn).timeit(number=200) / 200 * 1e6)
    return {name: (statistics.median(code), statistics.median(op)) for name, (code, op) in times.items()}


# These two run as the op kernels' code, with the globals of the module defining the
# kernels (fp32scope._wrappers.inner.ops): they may name only what that module holds.
def _bare_forward(_site: int, number: int, values: list[torch.Tensor]) -> Any:
    return _entry(number).forward.fast(list(values))  # type: ignore[misc]


def _bare_backward(_site: int, number: int, values: list[torch.Tensor]) -> Any:
    return [g for g in _entry(number).backward.fast(list(values)) if g is not None]  # type: ignore[union-attr, misc]


def floor_rounds(cases: dict[str, Callable[[], None]], repeats: int, number: int) -> dict[str, tuple[float, float]]:
    """Per scoped node, in the model: fp32scope's region against a bare one, ``{case: (fp32scope, bare)}`` us.

    The bare region is the same graph with the ops' kernels cut to what any op that runs
    its node's separately compiled code pays: the dispatcher's call of a Python kernel, the
    entry found by number, the compiled code called (no scope, no state or stride check, no
    layout or copy fix-up). Their code objects are swapped in and out per half round, so the
    two are paired with the unscoped stack in the same round. Reads and patches fp32scope's
    private ``inner`` module on purpose (a bench, not a use).
    """
    from fp32scope._wrappers import inner

    kernels = (inner._inner_impl, inner._inner_bwd_impl)
    own = tuple(k.__code__ for k in kernels)
    bare = (_bare_forward.__code__, _bare_backward.__code__)
    base = {what: cases[f"{label('whole-model', 0)}: {what}"] for what in ("train step", "no_grad call")}
    scoped = [(n, what, cases[f"{label('in-graph', n)}: {what}"]) for n in (1, 4) for what in base]
    paired: dict[str, tuple[list[float], list[float]]] = {f"{what}, {n} scoped": ([], []) for n, what, _ in scoped}
    try:
        for _ in range(repeats):
            for side, codes in enumerate((own, bare)):
                for kernel, code in zip(kernels, codes, strict=True):
                    kernel.__code__ = code
                took = {what: timeit.Timer(fn).timeit(number=number) / number for what, fn in base.items()}
                for n, what, fn in scoped:
                    mine = timeit.Timer(fn).timeit(number=number) / number
                    paired[f"{what}, {n} scoped"][side].append((mine - took[what]) / n * 1e6)
    finally:
        for kernel, code in zip(kernels, own, strict=True):
            kernel.__code__ = code
    return {name: (statistics.median(a), statistics.median(b)) for name, (a, b) in paired.items()}


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0912, PLR0915  (one flat script)
    """Build, compile, check, measure; print the figures (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=50, help="steps per timing loop")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fp32scope.set_process_default(FULL)
    x = torch.randn(BATCH, WIDTH)
    # Room in Dynamo's cache: the blocks of a variant share their forward's code object (on
    # torch without inline_inbuilt_nn_modules each block instance is an entry of its own).
    config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):
        if limit in config._config:  # type: ignore[attr-defined]
            setattr(config, limit, 256)

    # First each variant alone, with a fresh Dynamo, to count its graphs and graph breaks.
    graphs: dict[str, tuple[int, int]] = {}
    for how, scoped in VARIANTS:
        torch._dynamo.reset()
        counters.clear()
        built = stack(scoped, how=how)
        train, infer = measure(built.model, x)
        for _ in range(2):
            train()
            infer()
        breaks = sum(counters["graph_break"].values())
        graphs[label(how, scoped)] = (int(counters["stats"]["unique_graphs"]), breaks)
        check(f"{label(how, scoped)} (alone)", built, train, infer)
    # Then all of them, compiled again and timed interleaved, in one process with no reset
    # between them: each with code objects of its own (see fresh), and checked once warm.
    torch._dynamo.reset()
    cases: dict[str, Callable[[], None]] = {}
    checked: dict[str, tuple[Built, Callable[[], None], Callable[[], None]]] = {}
    for how, scoped in VARIANTS:
        built = stack(scoped, how=how)
        train, infer = measure(built.model, x)
        for _ in range(3):  # compile (train and no_grad graphs), then warm up
            train()
            infer()
        cases[f"{label(how, scoped)}: train step"] = train
        cases[f"{label(how, scoped)}: no_grad call"] = infer
        checked[label(how, scoped)] = (built, train, infer)
    # Each variant compiled once above; later calls must not compile again (a recompile
    # would be timed): the compile counters stand still from here.
    frames_before = counters["frames"]["total"]
    # Checked when all are built and warm, as they are timed: a variant built later must not
    # have turned an earlier one eager.
    eager = {name: check(name, *what) for name, what in checked.items()}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            samples[name].append(timeit.Timer(fn).timeit(number=args.number) / args.number * 1e6)
    if counters["frames"]["total"] != frames_before:
        print("error: a checked or timed call compiled again; the figures would include compiling", file=sys.stderr)
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
    print("Python forward frames in a warm train step and no_grad call (checked: only those meant to run eagerly):")
    for name, frames in eager.items():
        print(f"  {name}: {', '.join(frames) or 'none'}")
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
    overheads = op_overheads(checked[label("in-graph", 1)][0].model, x, args.repeats)
    print("a region's op against its node's compiled code alone, tight loop, us per call (median of loops x 200):")
    for name, (code, op) in overheads.items():
        what = name if name.startswith("a ") else f"fp32scope::{name}"
        kernel = "its Python kernel" if name.startswith("a ") else "compiled code"
        print(f"  {what}: {kernel} {code:.1f}, op {op:.1f}, added {op - code:.1f}")
    added = {name: op - code for name, (code, op) in overheads.items()}
    step = added["inner_fwd"] + added["inner_bwd"]
    print(f"  added per no_grad call {added['inner']:.1f}, per training step (forward and backward op) {step:.1f}")
    floor = floor_rounds(cases, args.repeats, args.number)
    if counters["frames"]["total"] != frames_before:
        print("error: a call timed with bare kernels compiled again; the figures would include it", file=sys.stderr)
        return 1
    print("a region per scoped node in the model (paired as above): fp32scope's ops against bare ones, us")
    print("  (bare: each op's kernel only finds its node's compiled code and calls it; see floor_rounds)")
    for name, (own_us, bare_us) in floor.items():
        print(f"  in-graph, {name}: fp32scope {own_us:.1f}, bare {bare_us:.1f}")
    if args.json:
        report = {
            "median_us": med,
            "graphs": graphs,
            "python_forwards": eager,
            "per_scoped_node_us": per_node,
            "op_overhead_us": overheads,
            "bare_region_us": floor,
        }
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
