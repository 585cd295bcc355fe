"""Hugging Face key-value caches carried by in-graph regions: prefill and decode with ``fullgraph=True``.

Each model's attentions are regions in full float32, under a TF32 default; the model's
``forward`` is compiled whole and run with a ``DynamicCache`` or a ``StaticCache`` through a
prefill and greedy decode steps, and compared step by step with its twin scoped eagerly (no
compile) fed its own cache: the chosen tokens, the logits, and every cache tensor. A forward
hook on each bare attention passes its output through a probe, which reads the precision
where the attention runs. Before regions carried caches, a cache argument was a graph break
(``fullgraph=True`` failed).

A hook keeps a node eager inside its op, so the last test probes inside each attention's
output projection instead: there a static cache's attention is compiled by Inductor inside
its op in decode steps, and no Python of it runs.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from fp32scope import current_fp32_precision, scope_modules, set_process_default
from fp32scope._compat import REGION_OPS_UPDATE_CACHES_IN_PLACE
from fp32scope._wrappers import carriers
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL
from tests._support.hf import ATTENTIONS, cache_argument, probe_attentions
from tests._support.probe import phases
from tests._support.releases import TORCH_RELEASE

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

KEPT = {"matmul": "highest", "cudnn_allow_tf32": False}
PROMPT = 5  # tokens in the prompt
STEPS = 3  # decode steps after the prefill: the first decode and two with a cache of varying length


@pytest.fixture(autouse=True)
def _clear_probes() -> None:
    _probe.SEEN.clear()


def _cache(kind: str, model: Any) -> Any:
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache()  # no config: it adds each layer on its first update, inside the region
    return StaticCache(config=model.config, max_cache_len=PROMPT + STEPS + 2)


def _assert_caches_equal(got: Any, want: Any, step: int) -> None:
    assert got.get_seq_length() > 0, f"step {step}: the model did not use the cache it was given"
    assert len(got.layers) == len(want.layers)
    for i, (mine, theirs) in enumerate(zip(got.layers, want.layers, strict=True)):
        assert type(mine) is type(theirs)
        assert mine.is_initialized == theirs.is_initialized
        for field in ("keys", "values", "cumulative_length"):
            if hasattr(theirs, field):
                torch.testing.assert_close(
                    getattr(mine, field), getattr(theirs, field), msg=f"{field}[{i}], step {step}"
                )


def _prefill_and_decode(  # noqa: PLR0913  (the models, the cache, and what to check besides)
    compiled: Callable[..., Any],
    model: Any,
    twin: Any,
    kind: str,
    n_probed: int,
    *,
    check: Callable[[int, Any, Any, Any, Any], None] | None = None,
) -> None:
    """A prefill and STEPS greedy decode steps of ``compiled`` and its eager ``twin``, each fed its own cache.

    Compared step by step: each probed attention in its precision, the default outside, the
    logits, every cache tensor, the chosen tokens; then ``check(step, got, want, cache,
    twin_cache)``; and no graph break.
    """
    name_of_cache = cache_argument(model)
    cache, twin_cache = _cache(kind, model), _cache(kind, twin)
    ids = torch.randint(0, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    start = 0
    with torch.no_grad():
        for step in range(1 + STEPS):
            positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
            _probe.SEEN.clear()
            got = compiled(input_ids=ids, **{name_of_cache: cache}, use_cache=True, position_ids=positions)
            assert phases("fwd")["attention"] == [FULL] * n_probed, f"step {step}"  # each in its precision
            assert current_fp32_precision() == DEFAULT
            want = twin(input_ids=ids, **{name_of_cache: twin_cache}, use_cache=True, position_ids=positions)
            torch.testing.assert_close(got.logits, want.logits, msg=f"logits, step {step}")
            _assert_caches_equal(cache, twin_cache, step)
            if check is not None:
                check(step, got, want, cache, twin_cache)
            start += ids.shape[1]
            ids = got.logits[:, -1:].argmax(-1)
            assert torch.equal(ids, want.logits[:, -1:].argmax(-1)), f"tokens, step {step}"
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize(
    ("name", "kind"),
    [("llama", "dynamic"), ("llama", "static"), ("gpt2", "dynamic"), ("gpt2", "static"), ("mixtral", "dynamic")],
)
def test_attentions_as_regions_carry_the_cache_through_prefill_and_decode(name: str, kind: str) -> None:
    build, pattern = ATTENTIONS[name]
    set_process_default(DEFAULT)
    model = build()
    n_attentions = probe_attentions(model, pattern)
    twin = copy.deepcopy(model)
    scope_modules(model, {pattern: KEPT}, in_graph=True)
    scope_modules(twin, {pattern: KEPT})
    _prefill_and_decode(torch.compile(model.forward, fullgraph=True), model, twin, kind, n_attentions)


# transformers >= 5.25 renames generate's past_key_values to cache; earlier 5.x know only the old name.
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_compiled_generate_with_attentions_as_regions_gives_the_eager_tokens(kind: str) -> None:
    # What a user writes: the model's forward compiled whole (fullgraph=True) inside
    # transformers' own generate loop, the attentions scoped with the default in_graph.
    build, pattern = ATTENTIONS["llama"]
    set_process_default(DEFAULT)
    model = build()
    n_attentions = probe_attentions(model, pattern)
    twin = copy.deepcopy(model)
    scope_modules(model, {pattern: KEPT})
    scope_modules(twin, {pattern: KEPT})
    model.forward = torch.compile(model.forward, fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    new_tokens = STEPS + 2
    with torch.no_grad():
        want = twin.generate(ids, max_new_tokens=new_tokens, do_sample=False, past_key_values=_cache(kind, twin))
        _probe.SEEN.clear()
        got = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, past_key_values=_cache(kind, model))
    assert torch.equal(got, want)
    seen = phases("fwd")["attention"]
    assert seen == [FULL] * (n_attentions * new_tokens)  # every attention of every step, in its precision
    assert current_fp32_precision() == DEFAULT
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_cache_rebuilt_inside_the_op_has_the_callers_attributes_and_no_more(kind: str) -> None:
    # A layer not initialized yet lacks the attributes its first update sets (a static
    # layer's batch_size: Cache.batch_size reads -1 where no layer has one). Rebuilt for the
    # node, it must lack them too, not hold them as None.
    model = ATTENTIONS["llama"][0]()  # (or a skip saying why transformers' models do not run here)
    from transformers import DynamicCache, StaticCache

    config = model.config
    cache = DynamicCache(config=config) if kind == "dynamic" else StaticCache(config=config, max_cache_len=8)
    rebuilt = carriers.rebuild(carriers.flatten(cache))
    assert [type(layer) for layer in rebuilt.layers] == [type(layer) for layer in cache.layers]
    for mine, theirs in zip(rebuilt.layers, cache.layers, strict=True):
        assert sorted(vars(mine)) == sorted(vars(theirs))
        assert not mine.is_initialized
    if hasattr(type(cache), "batch_size"):  # (transformers >= 5.2x)
        assert rebuilt.batch_size == cache.batch_size


class _Probed(torch.nn.Module):
    """A projection whose output passes through a probe: inside the node, no hook (a hook keeps it eager)."""

    def __init__(self, projection: torch.nn.Module) -> None:
        super().__init__()
        self.projection = projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _probe.probe(self.projection(x), "attention")


def _probe_inside(model: torch.nn.Module, pattern: str) -> list[torch.nn.Module]:
    """Each matching attention's output projection wrapped in :class:`_Probed`; the attentions."""
    found = []
    for name, module in model.named_modules():
        if re.fullmatch(pattern.removeprefix("re:"), name):
            attribute = "o_proj" if hasattr(module, "o_proj") else "c_proj"
            setattr(module, attribute, _Probed(getattr(module, attribute)))
            found.append(module)
    return found


def _attention_frames(attentions: list[torch.nn.Module], fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()``, and how many times an attention's own Python ``forward`` ran in it."""
    codes = {inspect.unwrap(type(a).forward).__code__ for a in attentions}
    seen = []

    def profile(frame: types.FrameType, event: str, _arg: object) -> None:
        if event == "call" and frame.f_code in codes:
            seen.append(frame.f_code)

    sys.setprofile(torch.compiler.disable(profile, recursive=True))  # type: ignore[no-untyped-call]
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, len(seen)


@pytest.mark.parametrize(("name", "kind"), [("llama", "static"), ("gpt2", "static"), ("llama", "dynamic")])
def test_a_decode_attention_is_compiled_inside_with_a_static_cache_and_eager_with_a_growing_one(
    name: str, kind: str
) -> None:
    # Under Inductor, a decode step's attention with a static cache (fixed sizes, no
    # gradient) is the node's own compiled graph inside its op: no Python of the attention
    # runs, its kernels run in its precision, and the cache it updates in place is written
    # back as the eager one is. A dynamic cache grows: compiled with dynamic=True (its sizes
    # symbolic, as Dynamo's automatic dynamic shapes make them after a size changed, on a
    # schedule that differs between Python versions), its attention runs its Python inside
    # the op.
    build, pattern = ATTENTIONS[name]
    set_process_default(DEFAULT)
    model = build()
    attentions = _probe_inside(model, pattern)
    twin = copy.deepcopy(model)
    scope_modules(model, {pattern: KEPT})
    scope_modules(twin, {pattern: KEPT})
    compiled: Callable[..., Any] = torch.compile(model.forward, fullgraph=True, dynamic=kind == "dynamic" or None)
    name_of_cache = cache_argument(model)
    prompt = torch.randint(0, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for run in range(2):  # the first compiles each step's graph; the second runs them
            cache, twin_cache = _cache(kind, model), _cache(kind, twin)
            ids, start = prompt, 0
            for step in range(1 + STEPS):
                positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
                _probe.SEEN.clear()
                kwargs = {"input_ids": ids, name_of_cache: cache, "use_cache": True, "position_ids": positions}
                if run == 0:  # compiling: no profiler, which slows Dynamo and Inductor down many times
                    got, frames = compiled(**kwargs), 0
                else:
                    got, frames = _attention_frames(attentions, functools.partial(compiled, **kwargs))
                assert phases("fwd")["attention"] == [FULL] * len(attentions), f"run {run}, step {step}"
                if run == 1 and step > 0:
                    python_runs = len(attentions) if kind == "dynamic" else 0
                    assert frames == python_runs, f"decode step {step}: the attentions ran their Python {frames} times"
                want = twin(input_ids=ids, **{name_of_cache: twin_cache}, use_cache=True, position_ids=positions)
                torch.testing.assert_close(got.logits, want.logits, msg=f"logits, run {run}, step {step}")
                _assert_caches_equal(cache, twin_cache, step)
                start += ids.shape[1]
                ids = got.logits[:, -1:].argmax(-1)
                assert torch.equal(ids, want.logits[:, -1:].argmax(-1)), f"tokens, run {run}, step {step}"
    assert current_fp32_precision() == DEFAULT
    assert sum(counters["graph_break"].values()) == 0


def _cache_sized_allocations(model: Any, scoped: bool) -> tuple[list[int], int]:
    """A compiled static-cache decode step's allocations the size of a layer's keys or values; that size.

    Prefill and two decode steps first (compiled, warm), then one step profiled with the
    allocator's records.
    """
    from transformers import StaticCache

    if scoped:
        scope_modules(model, {ATTENTIONS_PATTERNS[type(model).__name__]: KEPT})
    compiled: Callable[..., Any] = torch.compile(model.forward, fullgraph=True)
    name_of_cache = cache_argument(model)
    cache = StaticCache(config=model.config, max_cache_len=256)  # keys far bigger than anything else of a step
    ids = torch.randint(0, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    start = 0
    with torch.no_grad():
        for step in range(4):
            kwargs = {"input_ids": ids, name_of_cache: cache, "use_cache": True}
            kwargs["position_ids"] = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
            if step < 3:
                out = compiled(**kwargs)
            else:
                with torch.profiler.profile(profile_memory=True) as profile:
                    out = compiled(**kwargs)
            start += ids.shape[1]
            ids = out.logits[:, -1:].argmax(-1)
    sizes = {cache.layers[0].keys.nbytes, cache.layers[0].values.nbytes}
    records = [e.nbytes() for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"]
    # Exactly their size: a copy of a layer's keys (a grouped-query attention's repeated
    # keys are larger).
    return [n for n in records if n in sizes], max(sizes)


ATTENTIONS_PATTERNS = {"LlamaForCausalLM": ATTENTIONS["llama"][1], "GPT2LMHeadModel": ATTENTIONS["gpt2"][1]}


@pytest.mark.skipif(
    not REGION_OPS_UPDATE_CACHES_IN_PLACE,
    reason=f"torch {TORCH_RELEASE}: a region copies the static cache's keys and values into its op and back",
)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_static_cache_decode_step_allocates_no_copy_of_a_cache_layer(name: str) -> None:
    # A decode step's attention, compiled inside its region, updates the static cache's keys
    # and values where they are (one position), as the plain compiled model does: no tensor
    # the size of a layer's keys or values is allocated in the step, by the region (new
    # keys) or by the parent (which would copy them back). The same step without fp32scope
    # checks the premise: the plain model allocates none either.
    build = ATTENTIONS[name][0]
    set_process_default(DEFAULT)
    plain, size = _cache_sized_allocations(build(), scoped=False)
    assert plain == [], f"the plain compiled model allocated {plain} (a layer's keys: {size} bytes)"
    torch._dynamo.reset()
    scoped, size = _cache_sized_allocations(build(), scoped=True)
    assert scoped == [], f"a scoped decode step allocated {scoped} bytes (a layer's keys: {size} bytes)"
    assert current_fp32_precision() == DEFAULT


#: Each model's whole decoder, which returns the cache it was given in its output.
DECODERS = {"llama": "model", "gpt2": "transformer"}


@pytest.mark.parametrize(("name", "kind"), [("llama", "dynamic"), ("llama", "static"), ("gpt2", "static")])
def test_a_whole_decoder_as_a_region_returns_the_callers_own_cache(name: str, kind: str) -> None:
    # A region around a model's whole decoder (LlamaModel, GPT2Model) returns the cache it
    # was given inside its ModelOutput, as eager code does: the compiled model's output
    # holds the caller's own cache object, updated as the eager twin's is, step by step.
    # (Before, such a node was refused: "returned a DynamicCache inside its output".)
    build, pattern = ATTENTIONS[name]
    set_process_default(DEFAULT)
    model = build()
    attentions = _probe_inside(model, pattern)
    twin = copy.deepcopy(model)
    scope_modules(model, {DECODERS[name]: KEPT})
    scope_modules(twin, {DECODERS[name]: KEPT})

    def returns_the_callers_cache(step: int, got: Any, want: Any, cache: Any, twin_cache: Any) -> None:
        assert [v is twin_cache for v in want.values()].count(True) == 1  # the premise: eager returns it
        assert [v is cache for v in got.values()].count(True) == 1, f"step {step}: not the caller's cache"

    compiled = torch.compile(model.forward, fullgraph=True)
    _prefill_and_decode(compiled, model, twin, kind, len(attentions), check=returns_the_callers_cache)


def test_a_decoder_returning_a_cache_it_made_itself_is_refused_saying_what_to_do() -> None:
    # Called without a cache (use_cache=True, Llama's default), a LlamaModel makes a
    # DynamicCache of its own and returns it: an object the region never carried in, so
    # the parent could not get it back. Refused while the graph is traced, the flags as
    # they were.
    model = ATTENTIONS["llama"][0]()
    set_process_default(DEFAULT)
    scope_modules(model, {DECODERS["llama"]: KEPT})
    compiled: Callable[..., Any] = torch.compile(model, fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(Exception, match=r"'model' returned a DynamicCache inside its output") as got:
        compiled(ids)
    message = str(got.value)
    assert "made by the node itself" in message
    assert "use_cache=False" in message
    assert "in_graph=False" in message
    assert current_fp32_precision() == DEFAULT
    with torch.no_grad():  # and as the message says, without a cache of its own it compiles, as eager runs
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    assert sum(counters["graph_break"].values()) == 0
