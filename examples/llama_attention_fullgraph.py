"""Every attention of a Llama in full float32, the model compiled whole with ``fullgraph=True``, training.

The attentions take their rotary embedding as a tuple ``(cos, sin)``, which an in-graph
region carries. The model is a tiny ``LlamaForCausalLM`` built from its config (random
weights, no download), under a ``"high"`` (TF32) default; each layer's ``self_attn`` is a
region in ``"highest"``. A forward hook on each attention prints the precision it ran with
(it is also called on fake tensors while the graph is traced, when it says nothing); the
loss and the gradients are compared with the same scoped model run eagerly.

Called with a KV cache (``generate``), an attention gets a Hugging Face ``DynamicCache`` or
``StaticCache``, which a region carries too: still one graph, no break
(``tests/compile/test_region_caches.py``). A cache a region cannot carry (a sliding-window
layer's, an ``EncoderDecoderCache``) makes that call a graph break with
``Fp32RegionBreakWarning``, or under ``fullgraph=True`` an ``Fp32ScopeError`` saying why (see
the errors page).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import is_fake

from fp32scope import Fp32Precision, current_fp32_precision, scope_modules, set_process_default

ATTENTIONS = r"re:model\.layers\.\d+\.self_attn"


def _show(name: str) -> Callable[..., None]:
    def hook(_module: object, _args: object, output: tuple[torch.Tensor, ...]) -> None:
        if not is_fake(output[0]):  # not the runs on fake tensors while the graph is traced
            print(f"  {name} ran with {current_fp32_precision()}")

    return hook


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def main() -> None:
    """Build, scope, compile with fullgraph=True, train a step, and show what ran where."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(_show(f"layer {i} attention"))
    eager = copy.deepcopy(model)

    set_process_default(Fp32Precision("high", cudnn_allow_tf32=True))
    print("scoped:", sorted(scope_modules(model, {ATTENTIONS: "highest"}, in_graph=True)))
    scope_modules(eager, {ATTENTIONS: "highest"})  # the twin: the same scoped model, run eagerly

    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    compiled: Callable[..., Any] = torch.compile(model, fullgraph=True)
    counters.clear()
    print("compiled training step:")
    loss = _loss(compiled(input_ids=ids, use_cache=False).logits, ids)
    torch.autograd.backward(loss)
    print("eager training step (the same scoped model, not compiled):")
    expected = _loss(eager(input_ids=ids, use_cache=False).logits, ids)
    torch.autograd.backward(expected)
    graphs = int(counters["stats"]["unique_graphs"])
    breaks = sum(counters["graph_break"].values())
    print(f"graphs: {graphs}, graph breaks: {breaks}")
    print(f"loss difference from the eager step: {float((loss - expected).detach().abs()):.1e}")
    gradients = max(
        float((p.grad - q.grad).abs().max())
        for p, q in zip(model.parameters(), eager.parameters(), strict=True)
        if p.grad is not None and q.grad is not None
    )
    print(f"largest gradient difference: {gradients:.1e}")
    print(f"process default after the steps: {current_fp32_precision()}")


if __name__ == "__main__":
    main()
