"""What scoping a Llama's attentions costs in a compiled decode step with a KV cache.

Run with ``nox -s bench`` (or ``python benchmarks/bench_decode.py``). The model: a Llama
built offline from transformers' config with random weights (``--layers`` 4, width 256, 4
heads, 2 key-value heads), batch 1, a ``--prompt`` of 16 tokens, its ``forward`` compiled
``fullgraph=True`` with Inductor, one thread. Two variants, each with a ``StaticCache``
(``--cache-length`` long) and a ``DynamicCache``, without gradients (as ``generate`` runs):

- plain: no scoped node;
- scoped: every ``self_attn`` scoped to full float32 (``scope_modules``, the default
  ``in_graph``): each attention is one region op of the decode step's graph, carrying the
  cache. With the static cache (fixed sizes) the attention is compiled by Inductor inside
  its op; with the dynamic one (sizes that grow, compiled with ``dynamic=True``: symbolic)
  it runs inside its op as eager code does;
- scoped, hooked (static cache only): scoped as above, each attention with a forward hook
  that does nothing, which keeps it eager inside its op (hooks run at every call): what
  compiling the attention inside saves;
- scoped, copied (static cache only, where torch >= 2.8 lets a compiled-inside attention
  update the cache's keys and values where they are): scoped as above, compiled with that
  turned off (a private switch of fp32scope), so that the keys and values leave its op as
  new tensors and are copied back into the cache, as on earlier releases: what updating
  them in place saves.

The process default is full float32 too, so both run the same matmuls and a difference is
what the scoping costs. For each: the median over ``--repeats`` interleaved rounds of the
mean time of a decode step over ``--steps`` consecutive steps (the caches cut back to the
prompt between rounds, untimed), and the cost per scoped attention: the median over rounds
of (scoped - plain) / layers, both of the same round (and of the hooked variant likewise).

It also times what a region op's kernel does at every call carrying the cache: rebuilding
the attention's arguments, with torch's pytree and with the code fp32scope generates for
the layout (``--layers`` and 32 layers).

Checked before timing, on decode steps, and it exits 1 otherwise: the scoped static-cache
attentions update the keys and values where they are, and the copied ones do not; no graph
break; no Python ``forward`` of the model, its decoder layers or their MLPs ran (the graph
runs them), nor of an attention, except in the hooked variant and the scoped one with the
dynamic cache (inside their ops); the timed steps compile nothing. It exits 2 where
transformers cannot run its models here.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import sys
import time
import timeit
import types
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils import _pytree

import fp32scope
from fp32scope import Fp32Precision, scope_modules
from fp32scope._wrappers import carriers, layouts
from fp32scope._wrappers.region import inside as region  # where update_caches_in_place is read

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

FULL = Fp32Precision("highest", False)
PROMPT = 16
ATTENTIONS = r"re:model\.layers\.\d+\.self_attn"


def build(layers: int) -> Any:
    """The Llama, weights drawn at random (seed 0); exits 2 where transformers cannot run it."""
    transformers = importlib.import_module("transformers")
    if not transformers.is_torch_available():  # transformers 5 disables its models below torch 2.6
        print(f"bench_decode: transformers {transformers.__version__} does not run its models here", file=sys.stderr)
        raise SystemExit(2)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


class Variant:
    """One model and cache: its prompt run, a timed run of decode steps, a cut back to the prompt."""

    def __init__(self, model: Any, cache_kind: str, cache_length: int, prompt: int) -> None:
        transformers = importlib.import_module("transformers")
        self.model = model
        self.static = cache_kind == "static"
        # A growing cache's sizes symbolic from the start: Dynamo's automatic dynamic shapes
        # make them so after a size changed, on a schedule that differs between Pythons.
        self.forward: Callable[..., Any] = torch.compile(model.forward, fullgraph=True, dynamic=not self.static or None)
        config = model.config
        self.cache = (
            transformers.StaticCache(config=config, max_cache_len=cache_length)
            if self.static
            else transformers.DynamicCache(config=config)
        )
        self.prompt = torch.randint(0, config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))

    def step(self, token: torch.Tensor, position: int) -> torch.Tensor:
        logits = self.forward(
            input_ids=token,
            past_key_values=self.cache,
            use_cache=True,
            position_ids=torch.tensor([[position]]),
            cache_position=torch.tensor([position]),
        ).logits
        return logits[:, -1:].argmax(-1)  # type: ignore[no-any-return]

    def restart(self) -> torch.Tensor:
        """The cache holding the prompt only; the first token to decode."""
        if self.static:
            self.cache.reset()
        else:
            self.cache.crop(0)
        positions = torch.arange(self.prompt.shape[1])
        logits = self.forward(
            input_ids=self.prompt,
            past_key_values=self.cache,
            use_cache=True,
            position_ids=positions.unsqueeze(0),
            cache_position=positions,
        ).logits
        return logits[:, -1:].argmax(-1)  # type: ignore[no-any-return]

    def decode(self, steps: int) -> float:
        """Microseconds per decode step, over ``steps`` steps after the prompt (without gradients, as ``generate``)."""
        with torch.no_grad():
            token = self.restart()
            start = time.perf_counter()
            for i in range(steps):
                token = self.step(token, self.prompt.shape[1] + i)
            return (time.perf_counter() - start) / steps * 1e6


def python_forwards(model: Any, fn: Callable[[], object]) -> Counter[str]:
    """Which kinds of module ran their own Python ``forward`` in ``fn()``: model, layer, mlp, attention."""
    kinds = {}
    for name, module in model.named_modules():
        # The function itself, not a decorator's wrapper (transformers decorates forwards;
        # one wrapper's code object serves many of them).
        code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
        if code is None:
            continue
        kind = (
            "attention"
            if name.endswith("self_attn")
            else "mlp"
            if name.endswith("mlp")
            else "layer"
            if name.count(".") == 2 and name.startswith("model.layers.")
            else "model"
            if name in ("", "model")
            else None
        )
        if kind is not None:
            kinds[code] = kind
    seen: Counter[str] = Counter()

    def profile(frame: types.FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code in kinds:
            seen[kinds[frame.f_code]] += 1

    sys.setprofile(torch.compiler.disable(profile, recursive=True))  # type: ignore[no-untyped-call]
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def _no_op_hook(_module: torch.nn.Module, _args: object, _output: object) -> None:
    return None


def prepared(
    kind: str, scoped: bool, args: argparse.Namespace, *, hooked: bool = False, copied: bool = False
) -> Variant:
    """A variant compiled and warm, checked (exits 1): no graph break, only the Python frames meant to run."""
    name = (
        f"{kind} cache, {'scoped' if scoped else 'plain'}{', hooked' if hooked else ''}{', copied' if copied else ''}"
    )
    model = build(args.layers)
    if scoped:
        scope_modules(model, {ATTENTIONS: FULL})
    if hooked:
        for layer in model.model.layers:
            layer.self_attn.register_forward_hook(_no_op_hook)
    variant = Variant(model, kind, args.cache_length, args.prompt)
    counters.clear()
    in_place = region.update_caches_in_place
    region.update_caches_in_place = in_place and not copied  # read when a graph is traced
    try:
        # Compile the prompt and decode graphs (dynamic: sizes marked dynamic; a 1-token prompt's is the decode one).
        for _ in range(2):
            variant.decode(args.steps)
    finally:
        region.update_caches_in_place = in_place
    breaks = sum(counters["graph_break"].values())
    with torch.no_grad():
        token = variant.restart()
        ran = python_forwards(model, lambda: [variant.step(token, args.prompt + i) for i in range(2)])
    eager_attentions = scoped and (kind == "dynamic" or hooked)
    if breaks or ran["model"] + ran["layer"] + ran["mlp"] > 0 or (ran["attention"] > 0) != eager_attentions:
        expected = "but the scoped attentions' (inside their ops)" if eager_attentions else "at all"
        print(
            f"error: {name}: {breaks} graph breaks, Python forward frames in decode steps {dict(ran)}; "
            f"expected none {expected}",
            file=sys.stderr,
        )
        raise SystemExit(1)
    if scoped and kind == "static" and not hooked:
        # What "compiled inside" means for the cache: its keys and values updated where they
        # are, or (copied) leaving the op as new tensors; checked on the decode graphs' entries.
        entries = [
            entry
            for layer in model.model.layers
            for entry in layer.self_attn._self_region.inner.values()
            if entry is not None
        ]
        in_place = any(entry.in_place for entry in entries)
        if in_place != (region.update_caches_in_place and not copied):
            print(
                f"error: {name}: keys and values updated in place: {in_place}, not as the variant says", file=sys.stderr
            )
            raise SystemExit(1)
    return variant


def all_prepared(args: argparse.Namespace) -> dict[str, Variant]:
    """Every variant the arguments ask for, by name, compiled, warm and checked."""
    variants: dict[str, Variant] = {}
    for kind in args.caches.split(","):
        variants[f"{kind} cache, plain"] = prepared(kind, False, args)
        variants[f"{kind} cache, scoped"] = prepared(kind, True, args)
        if kind == "static":
            variants[f"{kind} cache, scoped, hooked"] = prepared(kind, True, args, hooked=True)
            if region.update_caches_in_place:
                variants[f"{kind} cache, scoped, copied"] = prepared(kind, True, args, copied=True)
    return variants


def main(argv: list[str] | None = None) -> int:
    """Build, compile, check, measure; print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cache-length", type=int, default=1024)
    parser.add_argument(
        "--prompt", type=int, default=PROMPT, help="prompt tokens (1: prompt and decode steps share one graph)"
    )
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--caches", default="static,dynamic", help="which caches, comma-separated")
    parser.add_argument("--number", type=int, default=None, help="accepted and ignored (nox -s bench passes it)")
    args = parser.parse_args(argv)
    unknown = set(args.caches.split(",")) - {"static", "dynamic"}
    if unknown:
        parser.error(f"--caches takes static and dynamic, comma-separated; got {args.caches!r}")
    torch.set_num_threads(1)
    fp32scope.set_process_default(FULL)
    for limit in ("recompile_limit", "cache_size_limit"):
        if limit in torch._dynamo.config._config:  # type: ignore[attr-defined]
            setattr(torch._dynamo.config, limit, 256)
    variants = all_prepared(args)
    frames = counters["frames"]["total"]
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, variant in variants.items():
            samples[name].append(variant.decode(args.steps))
    if counters["frames"]["total"] != frames:
        print("error: a timed step compiled again; the figures would include compiling", file=sys.stderr)
        return 1
    report(samples, args)
    for layers in sorted({args.layers, 32}):
        pytree, generated = rebuild_costs(layers, args.repeats)
        print(
            f"rebuilding a call's arguments in its op, {layers}-layer static cache: torch's tree_unflatten "
            f"{pytree:.1f} us, fp32scope's code for the layout {generated:.1f} us"
        )
    return 0


def rebuild_costs(layers: int, repeats: int) -> tuple[float, float]:
    """Microseconds to rebuild an attention call's arguments (hidden states, rotary pair, cache), two ways.

    What a region op's kernel does at every call carrying the cache, with torch's pytree and
    with the code fp32scope generates for the layout: medians over ``repeats`` of 2,000 calls.
    """
    transformers = importlib.import_module("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2
    )
    cache = transformers.StaticCache(config=config, max_cache_len=64)
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 1, 64))
    rotary = (torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))
    values = [torch.zeros(1, 1, 256), rotary, None, carriers.flatten(cache), torch.tensor([3])]
    leaves, spec = _pytree.tree_flatten(values)
    slots = tuple(layouts.TENSOR if isinstance(v, torch.Tensor) else v for v in leaves)
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    build_layout = layouts.builder(slots, spec)

    def with_pytree() -> object:
        it = iter(tensors)
        return _pytree.tree_unflatten([next(it) if s is layouts.TENSOR else s for s in slots], spec)

    def with_generated() -> object:
        return build_layout(tensors, [])

    mine, theirs = _pytree.tree_flatten(with_generated()), _pytree.tree_flatten(with_pytree())
    if mine[1] != theirs[1] or any(a is not b and a != b for a, b in zip(mine[0], theirs[0], strict=True)):
        print("error: the generated rebuild differs from tree_unflatten's", file=sys.stderr)
        raise SystemExit(1)
    runs = range(max(repeats, 3))
    costs = [
        statistics.median(timeit.timeit(fn, number=2000) / 2000 * 1e6 for _ in runs)
        for fn in (with_pytree, with_generated)
    ]
    return costs[0], costs[1]


def report(samples: dict[str, list[float]], args: argparse.Namespace) -> None:
    """Print each variant's median step and each scoped one's cost per attention."""
    print(f"torch {torch.__version__}, fp32scope {fp32scope.__version__}, inductor, fullgraph=True, 1 thread")
    print(
        f"Llama, {args.layers} layers, width 256, batch 1, prompt {args.prompt}, "
        f"static cache {args.cache_length} long; "
        f"median of {args.repeats} interleaved rounds of {args.steps} decode steps, us per step"
    )
    for name, values in samples.items():
        print(f"  {name:<28} {statistics.median(values):9.1f}")
    print("cost per scoped attention, us per step (median over rounds of (scoped - plain) / layers):")
    for name, values in samples.items():
        kind = name.split(" ", 1)[0]
        if name != f"{kind} cache, plain":
            base = samples[f"{kind} cache, plain"]
            paired = [(m - b) / args.layers for m, b in zip(values, base, strict=True)]
            print(f"  {name:<28} {statistics.median(paired):9.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
