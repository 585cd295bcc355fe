"""Objects a region carries by walking their state: an ``EncoderDecoderCache``, and what it refuses.

An ``EncoderDecoderCache`` (T5's, Whisper's, BART's) holds a self-attention cache, a
cross-attention cache (each a ``DynamicCache`` or a ``StaticCache``) and ``is_updated``, a
dict of per-layer bools that the attention reads and sets. A node given one inside a graph
compiled with ``fullgraph=True`` is one op: the cache crosses it as its state (tensors,
constants, the dict, the nested caches), and what the node changed on it (tensors bound
anew, a layer grown, an ``is_updated`` entry) is set on the caller's cache after the op.
Each check compares with the node's eager twin (``in_graph=False``) fed its own cache.
Before, such a call was a graph break, and ``fullgraph=True`` raised Fp32ScopeError.

A ``DynamicSlidingWindowLayer`` (Mistral's, Gemma's) is carried too: its Python-int
``cumulative_length`` changes every decode step, and comes back as the node's step added to
the caller's value, so the parent recompiles no more often than plain ``torch.compile`` of
the unscoped model (written back as a constant it was a recompile per step, past Dynamo's
limit). A ``StaticSlidingWindowLayer`` too: its update branches on its Python-int length
(filling, filling up, full), a graph per branch, each reading its own plan. Any other
layer class of transformers' cache module but the quantized ones (an indexed layer, a
linear-attention layer) is carried by its ``__dict__`` on torch >= 2.13, as a plain object
is, and refused before, saying so. What a region
still refuses (offloaded caches, quantized layers, also inside an
``EncoderDecoderCache``) raises Fp32ScopeError under ``fullgraph=True`` naming the
argument and the reason, and never names a carried class as refused.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from fp32scope import Fp32ScopedModule, Fp32ScopeError, set_process_default
from fp32scope._compat import DYNAMO_READS_OBJECT_DICTS
from fp32scope._wrappers import carriers
from tests._support.common import DEFAULT, FULL
from tests._support.hf import gpt2_unavailable
from tests._support.probe import phases, probe

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

HEADS, DIM = 2, 8
MEMORY = 5  # the encoder's tokens: the cross-attention cache's length


def _transformers() -> Any:
    reason = gpt2_unavailable()  # transformers' caches and models run on this torch
    if reason is not None:
        pytest.skip(reason.replace("GPT-2", "EncoderDecoderCache"))
    import transformers

    return transformers


class CrossAttends(torch.nn.Module):
    """A decoder layer's two attentions in one node, as T5's attention uses an EncoderDecoderCache.

    It reads ``is_updated`` for its layer: where set, the cross-attention reuses the keys and
    values cached; else it computes them from ``memory``, caches them and sets the flag.
    """

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(DIM, DIM)
        self.k = torch.nn.Linear(DIM, DIM)
        self.v = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, cache: Any) -> torch.Tensor:
        keys, values = cache.self_attention_cache.update(self.k(x), self.v(x), 0)
        if cache.is_updated.get(0):
            cross_keys = cache.cross_attention_cache.layers[0].keys
            cross_values = cache.cross_attention_cache.layers[0].values
        else:
            cross_keys, cross_values = cache.cross_attention_cache.update(self.k(memory), self.v(memory) * 2.0, 0)
            cache.is_updated[0] = True
        query = self.q(x)
        mine = torch.softmax(query @ keys.transpose(-1, -2), -1) @ values
        theirs = torch.softmax(query @ cross_keys.transpose(-1, -2), -1) @ cross_values
        out: torch.Tensor = mine + theirs
        return out


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(DIM, DIM)
        self.node = Fp32ScopedModule(CrossAttends(), FULL)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, cache: Any) -> torch.Tensor:
        out: torch.Tensor = self.node(self.pre(x), memory, cache)
        return out


def _config(transformers: Any) -> Any:
    return transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS
    )


def _cache(kind: str) -> Any:
    transformers = _transformers()
    if kind == "dynamic":
        return transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
    config = _config(transformers)
    return transformers.EncoderDecoderCache(
        transformers.StaticCache(config=config, max_cache_len=8),
        transformers.StaticCache(config=config, max_cache_len=MEMORY),
    )


def _assert_caches_equal(got: Any, want: Any, step: int) -> None:
    assert got.is_updated == want.is_updated, f"is_updated, step {step}"
    for which in ("self_attention_cache", "cross_attention_cache"):
        mine, theirs = getattr(got, which), getattr(want, which)
        assert [type(layer) for layer in mine.layers] == [type(layer) for layer in theirs.layers], which
        for i, (layer, twin_layer) in enumerate(zip(mine.layers, theirs.layers, strict=True)):
            assert layer.is_initialized == twin_layer.is_initialized
            for field in ("keys", "values", "cumulative_length"):
                if hasattr(twin_layer, field):
                    torch.testing.assert_close(
                        getattr(layer, field), getattr(twin_layer, field), msg=f"{which} {field}[{i}], step {step}"
                    )


@pytest.mark.parametrize(
    ("kind", "backend"), [("dynamic", "aot_eager"), ("dynamic", "inductor"), ("static", "inductor")]
)
def test_an_encoder_decoder_cache_crosses_a_region_and_comes_back_as_the_node_left_it(kind: str, backend: str) -> None:
    torch.manual_seed(0)
    model = Decoder()
    twin: Any = copy.deepcopy(model)
    twin.node = Fp32ScopedModule(twin.node.__wrapped__, FULL, in_graph=False)
    cache, twin_cache = _cache(kind), _cache(kind)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(2)
    memory = torch.randn(2, HEADS, MEMORY, DIM, generator=generator)
    with torch.no_grad():
        for step, length in enumerate((3, 1, 1)):  # a prefill (the cross-attention cached), two decode steps
            x = torch.randn(2, HEADS, length, DIM, generator=generator)
            got = compiled(x, memory, cache)
            torch.testing.assert_close(got, twin(x, memory, twin_cache), msg=f"output, step {step}")
            _assert_caches_equal(cache, twin_cache, step)
            assert cache.is_updated == {0: True}
    assert sum(counters["graph_break"].values()) == 0


def test_a_rebuilt_encoder_decoder_cache_holds_the_callers_classes_flags_and_unset_attributes() -> None:
    cache = _cache("static")
    cache.is_updated[3] = False
    rebuilt = carriers.rebuild(carriers.flatten(cache))
    assert type(rebuilt) is type(cache)
    assert rebuilt.is_updated == cache.is_updated == {0: False, 3: False}
    assert rebuilt.is_updated is not cache.is_updated  # the node's writes reach the caller only by write_back
    for which in ("self_attention_cache", "cross_attention_cache"):
        mine, theirs = getattr(rebuilt, which), getattr(cache, which)
        assert type(mine) is type(theirs)
        assert [type(layer) for layer in mine.layers] == [type(layer) for layer in theirs.layers]
        for layer, twin_layer in zip(mine.layers, theirs.layers, strict=True):
            assert sorted(vars(layer)) == sorted(vars(twin_layer))  # not initialized: no keys' sizes yet


def test_what_a_node_changes_on_an_encoder_decoder_cache_is_found_by_its_path_and_written_back() -> None:
    cache = _cache("dynamic")
    marker = carriers.flatten(cache)
    rebuilt = carriers.rebuild(marker)
    keys = torch.randn(1, HEADS, 3, DIM)
    rebuilt.cross_attention_cache.update(keys, keys + 1.0, 0)
    rebuilt.is_updated[0] = True
    found, tensors = carriers.changes(marker, rebuilt, 0)
    assert ((), "is_updated", False, None) not in found
    assert (("is_updated",), ("item", 0), False, ("constant", True)) in found  # written back as it is
    assert all(path[0] == "cross_attention_cache" for path, *_ in found if path != ("is_updated",))
    carriers.write_back(cache, found, tensors)
    assert cache.is_updated == {0: True}
    assert len(cache.self_attention_cache.layers) == 0  # the other cache untouched
    torch.testing.assert_close(cache.cross_attention_cache.layers[0].values, keys + 1.0)


class _Doubles(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        del cache
        return x * 2.0


class TakesCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.node = Fp32ScopedModule(_Doubles(), FULL)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        out: torch.Tensor = self.node(x, cache=cache)
        return out


def _refused(kind: str) -> Any:
    transformers = _transformers()
    cache_utils = transformers.cache_utils
    if kind == "offloaded":
        try:
            return transformers.DynamicCache(offloading=True)
        except RuntimeError:  # "Backend doesn't support create a new Stream": torch >= 2.15 without a GPU
            cache = transformers.DynamicCache()
            cache.offloading = True  # what an offloaded cache holds, and all the region reads of it
            return cache
    quantized = transformers.DynamicCache()
    quantized.layers.append(cache_utils.Fp8QuantizedLayer())
    if kind == "quantized self":
        return transformers.EncoderDecoderCache(quantized, transformers.DynamicCache())
    if kind == "quantized inside":
        return transformers.EncoderDecoderCache(transformers.DynamicCache(), quantized)
    return quantized


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("offloaded", "this DynamicCache offloads its layers"),
        ("quantized", "this DynamicCache holds Fp8QuantizedLayer layers"),
        (
            "quantized self",
            "this EncoderDecoderCache has a self_attention_cache (DynamicCache) that holds Fp8QuantizedLayer layers",
        ),
        (
            "quantized inside",
            "this EncoderDecoderCache has a cross_attention_cache (DynamicCache) that holds Fp8QuantizedLayer layers",
        ),
    ],
)
def test_a_cache_a_region_cannot_carry_is_refused_under_fullgraph_naming_the_argument_and_why(
    kind: str, reason: str
) -> None:
    cache = _refused(kind)
    with pytest.raises(Fp32ScopeError) as caught:
        torch.compile(TakesCache(), backend="eager", fullgraph=True)(torch.ones(2), cache)
    message = str(caught.value)
    assert f"keyword argument 'cache' of type {type(cache).__name__}, which a region cannot carry" in message
    assert f"{reason} (a region carries DynamicCache and StaticCache objects" in message
    assert "not offloaded, not quantized" in message
    assert not re.search(r"EncoderDecoderCache (is|objects are) not carried", message)
    assert "Pass the object's tensors as arguments" in message  # what to do


WINDOW = 3


class SlidingAttends(torch.nn.Module):
    """An attention over a sliding-window cache layer (Mistral's, Gemma's), keys and values from ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(DIM, DIM)
        self.k = torch.nn.Linear(DIM, DIM)
        self.v = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        keys, values = cache.update(self.k(x), self.v(x), 0)
        out: torch.Tensor = torch.softmax(self.q(x) @ keys.transpose(-1, -2), -1) @ values
        return out


class SlidingDecoder(torch.nn.Module):
    """Reads the cache's length before its attention, as a model's mask does (a count that changes every step)."""

    def __init__(self, attention: torch.nn.Module) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(DIM, DIM)
        self.node = attention

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        seen = cache.get_seq_length()
        offset = torch.arange(x.shape[-2]).unsqueeze(-1) + seen
        out: torch.Tensor = self.node(self.pre(x) + offset * 0.01, cache)
        return out


#: The static sliding layer's window: longer than the prefill, so that its update takes each
#: of its three branches (filling, filling up past the window, full) in one decode.
STATIC_WINDOW = 6


def _sliding_cache(kind: str) -> Any:
    transformers = _transformers()
    if kind == "dynamic":
        cache = transformers.DynamicCache()
        cache.layers.append(transformers.cache_utils.DynamicSlidingWindowLayer(sliding_window=WINDOW))
        return cache
    cache = transformers.StaticCache(max_cache_len=16, config=_config(transformers))
    cache.layers = [transformers.cache_utils.StaticSlidingWindowLayer(max_cache_len=16, sliding_window=STATIC_WINDOW)]
    return cache


#: Per layer kind, the tokens of each call: a prefill of 4, then (static) one token twice
#: (filling), two (past the window: the cat branch), then one at a time (full: the roll).
LENGTHS = {"dynamic": (4,), "static": (4, 1, 1, 2)}


def _decode(model: Callable[..., torch.Tensor], cache: Any, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """Each call's output, a call per length."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        return [model(torch.randn(2, HEADS, length, DIM, generator=generator), cache) for length in lengths]


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_sliding_window_cache_crosses_a_region_recompiling_no_more_than_plain_torch(kind: str) -> None:
    # Its length, a Python int, changes every step: written back as a constant, it would be
    # a guard the next step fails (a recompile per token). Written back as the caller's value
    # plus the node's step, it stays symbolic once Dynamo has made it dynamic. A static
    # layer's update branches on it: a graph per branch, each op reading its own plan.
    lengths = (*LENGTHS[kind], *(1,) * 8)
    torch.manual_seed(0)
    bare = SlidingDecoder(SlidingAttends())
    model: Any = copy.deepcopy(bare)
    model.node = Fp32ScopedModule(model.node, FULL)
    twin: Any = copy.deepcopy(bare)
    twin.node = Fp32ScopedModule(twin.node, FULL, in_graph=False)
    plain_cache = _sliding_cache(kind)
    plain = _decode(torch.compile(bare, fullgraph=True), plain_cache, lengths)
    plain_graphs = _graphs()
    torch._dynamo.reset()
    counters.clear()
    cache, twin_cache = _sliding_cache(kind), _sliding_cache(kind)
    got = _decode(torch.compile(model, fullgraph=True), cache, lengths)
    want = _decode(twin, twin_cache, lengths)
    for step, (mine, theirs, bare_out) in enumerate(zip(got, want, plain, strict=True)):
        torch.testing.assert_close(mine, theirs, msg=f"output, step {step}")
        torch.testing.assert_close(mine, bare_out, msg=f"output against plain torch, step {step}")
    layer, twin_layer = cache.layers[0], twin_cache.layers[0]
    length = "cumulative_length" if kind == "dynamic" else "cumulative_length_int"
    assert getattr(layer, length) == getattr(twin_layer, length) == sum(lengths)
    assert type(getattr(layer, length)) is int
    torch.testing.assert_close(layer.keys, twin_layer.keys)
    torch.testing.assert_close(layer.values, twin_layer.values)
    assert layer.keys.shape[-2] == (WINDOW - 1 if kind == "dynamic" else STATIC_WINDOW)
    assert sum(counters["graph_break"].values()) == 0
    assert 0 < _graphs() <= plain_graphs, f"scoped: {_graphs()} graphs, plain torch: {plain_graphs}"


def test_a_count_the_node_moves_comes_back_as_a_step_from_the_callers_value() -> None:
    cache = _sliding_cache("dynamic")
    cache.update(torch.randn(1, HEADS, 5, DIM), torch.randn(1, HEADS, 5, DIM), 0)
    marker = carriers.flatten(cache)
    rebuilt = carriers.rebuild(marker)
    rebuilt.update(torch.randn(1, HEADS, 2, DIM), torch.randn(1, HEADS, 2, DIM), 0)
    found, tensors = carriers.changes(marker, rebuilt, 0)
    assert (("layers", ("index", 0)), "cumulative_length", False, ("delta", 2)) in found
    carriers.write_back(cache, found, tensors)
    assert cache.layers[0].cumulative_length == 7


class Mixes(torch.nn.Module):
    """A linear-attention mixer over its cache layer (Qwen3-Next's, Mamba's): a conv state and a recurrent state."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        layer = cache.layers[0]
        conv = layer.update_conv_state(self.proj(x).transpose(1, 2), 0, conv_kernel_size=3)
        state = torch.tanh(conv[..., -1:] * torch.ones(1, DIM, DIM))
        recurrent = layer.update_recurrent_state(state, 0)
        out: torch.Tensor = x + recurrent.sum(-1).unsqueeze(1) + conv.mean(-1).unsqueeze(1)
        return probe(out, "node")


class Indexes(torch.nn.Module):
    """A sparse attention's indexer over its cache layer (DeepSeek V3.2's, GLM's): keys, values and indexer keys."""

    def __init__(self) -> None:
        super().__init__()
        self.k = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        layer = cache.layers[0]
        keys, values = layer.update(self.k(x), x)
        indexer = layer.update_indexer(x[:, 0])
        out: torch.Tensor = torch.softmax(x @ keys.transpose(-1, -2), -1) @ values + indexer.sum(1, keepdim=True)
        return probe(out, "node")


def _layered(kind: str) -> Any:
    transformers = _transformers()
    cache = transformers.DynamicCache()
    layer = (
        transformers.cache_utils.LinearAttentionLayer()
        if kind == "linear attention"
        else transformers.cache_utils.DynamicIndexedLayer()
    )
    cache.layers = [layer]
    cache.layer_class_to_replicate = None  # (as a cache built from a hybrid model's config holds it)
    return cache


def _layered_inputs(kind: str, length: int, generator: torch.Generator) -> torch.Tensor:
    shape = (2, length, DIM) if kind == "linear attention" else (2, HEADS, length, DIM)
    return torch.randn(shape, generator=generator)


@pytest.mark.parametrize("kind", ["linear attention", "indexed"])
def test_any_other_cache_layer_crosses_a_region_by_its_state_on_torch_2_13_and_is_refused_before(kind: str) -> None:
    # No class of its own in fp32scope: the layer's __dict__ walked as a plain object's
    # is, its class rebuilt by name, what the node changed (dict entries, tensors bound
    # anew, in-place updates, constants) written back on the caller's layer.
    torch.manual_seed(0)
    set_process_default(DEFAULT)
    bare = Mixes() if kind == "linear attention" else Indexes()
    node = Fp32ScopedModule(copy.deepcopy(bare), FULL)
    twin = Fp32ScopedModule(copy.deepcopy(bare), FULL, in_graph=False)
    compiled = torch.compile(lambda x, cache: node(x, cache=cache) * 1, fullgraph=True)
    cache, twin_cache = _layered(kind), _layered(kind)
    generator = torch.Generator().manual_seed(1)
    if not DYNAMO_READS_OBJECT_DICTS:
        name = type(cache.layers[0]).__name__
        with pytest.raises(Fp32ScopeError, match=f"this DynamicCache holds {name} layers .*on torch >= 2.13"):
            compiled(_layered_inputs(kind, 4, generator), cache)
        return
    with torch.no_grad():
        for step, length in enumerate((4, 1, 1, 1)):
            x = _layered_inputs(kind, length, generator)
            torch.testing.assert_close(compiled(x, cache), twin(x, cache=twin_cache), msg=f"output, step {step}")
    layer, twin_layer = cache.layers[0], twin_cache.layers[0]
    assert type(layer) is type(twin_layer)
    for name, value in vars(twin_layer).items():
        mine = getattr(layer, name)
        if isinstance(value, dict):
            assert mine.keys() == value.keys(), name
            for key in value:
                _assert_same(mine[key], value[key], f"{name}[{key}]")
        else:
            _assert_same(mine, value, name)
    assert phases("fwd")["node"] == [FULL] * 8  # each compiled call and its twin
    assert sum(counters["graph_break"].values()) == 0


def _assert_same(mine: Any, theirs: Any, what: str) -> None:
    if isinstance(theirs, torch.Tensor):
        torch.testing.assert_close(mine, theirs, msg=what)
    else:
        assert mine == theirs, what
