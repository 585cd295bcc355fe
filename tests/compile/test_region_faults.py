"""Silent wrong results a region could give, each checked against the same model run eagerly.

Each test stands for a fault that once survived the region tests (a hand-made mutant of the
region code): a parameter the node hands back, overwritten by the compiled graph around the
op; the second of two caches given to one node, rebuilt from the first one's tensors;
autocast entered inside the compiled function with float16, re-entered around the node
with CPU autocast's default dtype instead. Each would change no precision and raise
nothing: only the numbers, compared with the eager scoped twin, show it.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import pytest
import torch
from torch._dynamo.utils import counters

from fp32scope import Fp32ScopedModule, current_fp32_precision, set_process_default
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL
from tests._support.hf import gpt2_unavailable
from tests._support.probe import phases, probe

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

WIDTH = 16
BACKENDS = pytest.mark.parametrize("backend", ["aot_eager", "inductor"])


@pytest.fixture(autouse=True)
def _clear_probes() -> None:
    _probe.SEEN.clear()


def _eager_twin(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    twin: Any = copy.deepcopy(model)
    twin.node = Fp32ScopedModule(twin.node.__wrapped__, FULL, in_graph=False, **options)
    return cast("torch.nn.Module", twin)


class HandsBack(torch.nn.Module):
    """Returns its output and its own weight (as a tied head or a LoRA factor's holder may)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), self.linear.weight


class UsesWeight(torch.nn.Module):
    """Uses the weight the node hands back once, elementwise: Inductor may write the result where it was."""

    def __init__(self) -> None:
        super().__init__()
        self.node = Fp32ScopedModule(HandsBack(), FULL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, weight = self.node(x)
        # The weight's last use, elementwise, into a tensor of its size: an op's output is the
        # graph's own memory, which Inductor reuses in place (its inplace_buffers).
        h = torch.tanh(weight * 2.0) + 1.0
        out: torch.Tensor = h @ y
        return out


@BACKENDS
def test_a_parameter_the_node_hands_back_is_never_overwritten_by_the_graph_around_it(backend: str) -> None:
    torch.manual_seed(0)
    model = UsesWeight()
    twin = _eager_twin(model)
    weight = cast("Any", model.node).linear.weight
    before = weight.detach().clone()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(WIDTH, WIDTH)
    with torch.no_grad():
        for _ in range(3):
            got = compiled(x)
            torch.testing.assert_close(weight, before, rtol=0, atol=0)
            torch.testing.assert_close(got, twin(x), rtol=1e-4, atol=1e-4)
    assert sum(counters["graph_break"].values()) == 0


class Fp16Parent(torch.nn.Module):
    """Enters autocast itself, with float16, around a scoped node that keeps the caller's autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.before = torch.nn.Linear(WIDTH, WIDTH)
        self.node = Fp32ScopedModule(torch.nn.Linear(WIDTH, WIDTH), FULL, autocast=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out: torch.Tensor = self.node(self.before(x))
        return probe(out, "after")


@BACKENDS
def test_float16_autocast_entered_inside_the_compiled_function_is_the_nodes_autocast(backend: str) -> None:
    set_process_default(DEFAULT)
    torch.manual_seed(0)
    model = Fp16Parent()
    twin = _eager_twin(model, autocast=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(4, WIDTH)
    got, want = compiled(x), twin(x)
    assert want.dtype == torch.float16  # (CPU autocast's default dtype is bfloat16)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert phases("fwd")["after"] == [DEFAULT, DEFAULT]
    assert current_fp32_precision() == DEFAULT


HEADS, DIM = 2, 8


class TwoCaches(torch.nn.Module):
    """An attention-like node given two caches: it updates both and mixes what each holds."""

    def __init__(self) -> None:
        super().__init__()
        self.k = torch.nn.Linear(DIM, DIM)
        self.v = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, first: Any, second: Any) -> torch.Tensor:
        k1, v1 = first.update(self.k(x), self.v(x), 0)
        k2, v2 = second.update(self.k(x) * 2.0, self.v(x) - 1.0, 0)
        out: torch.Tensor = (k1.sum(-2) + v1.mean(-2)) * 3.0 + k2.sum(-2) - v2.mean(-2) * 5.0
        return out


class TwoCachesParent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(DIM, DIM)
        self.node = Fp32ScopedModule(TwoCaches(), FULL)

    def forward(self, x: torch.Tensor, first: Any, second: Any) -> torch.Tensor:
        out: torch.Tensor = self.node(self.pre(x), first, second)
        return out


def _two_caches(kind: str) -> tuple[Any, Any]:
    transformers = pytest.importorskip("transformers")
    generator = torch.Generator().manual_seed(1)
    caches = []
    for scale in (1.0, -7.0):  # the two caches hold different numbers from the start
        if kind == "dynamic":
            cache = transformers.DynamicCache()
        else:
            config = transformers.LlamaConfig(
                num_hidden_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS
            )
            cache = transformers.StaticCache(config=config, max_cache_len=8)
        keys = torch.randn(2, HEADS, 2, DIM, generator=generator) * scale
        cache.update(keys, keys + scale, 0)
        caches.append(cache)
    return caches[0], caches[1]


@pytest.mark.parametrize(
    ("kind", "backend"), [("dynamic", "aot_eager"), ("dynamic", "inductor"), ("static", "inductor")]
)
def test_two_caches_given_to_one_node_are_each_rebuilt_from_their_own_tensors(kind: str, backend: str) -> None:
    reason = gpt2_unavailable()
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    model = TwoCachesParent()
    twin = _eager_twin(model)
    caches, twin_caches = _two_caches(kind), _two_caches(kind)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for step, length in enumerate((3, 1, 1)):  # a prefill, then two decode steps
            x = torch.randn(2, HEADS, length, DIM, generator=generator)
            torch.testing.assert_close(compiled(x, *caches), twin(x, *twin_caches), msg=f"output, step {step}")
            for which, (cache, want) in enumerate(zip(caches, twin_caches, strict=True)):
                for field in ("keys", "values"):
                    torch.testing.assert_close(
                        getattr(cache.layers[0], field),
                        getattr(want.layers[0], field),
                        msg=f"cache {which} {field}, step {step}",
                    )
    assert sum(counters["graph_break"].values()) == 0
