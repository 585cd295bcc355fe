"""Which layers of a bf16 FLUX transformer drift under torch.compile? Ask advise, keep them eager.

diffusers recommends compiling its transformers whole, with ``fullgraph=True``. In bf16,
Inductor fuses pointwise work and keeps its intermediates in float32 where eager rounds
each one to bf16, so the compiled model's output drifts from the eager one's.
``fp32scope.advise(..., compile=..., reference="eager")`` finds the submodules whose
compiled work makes the drift; its policy keeps them ``"eager"``: each one an in-graph
region of the compiled model that runs as eager runs it, with no graph break.

The model is a tiny ``FluxTransformer2DModel`` built from its config (one block of each
kind, random weights, no download). The tolerance is a tenth of the plain compile's
smallest drift over the batches. The candidates are restricted (``candidates=``) to the
rotary and timestep embeddings, each transformer block and the output norm: advising
every submodule (60 candidates) takes 13 whole-model compiles and 60 node compiles, 81 s
on two cores, where this advise takes 10 and 5, about 30 s. ``main()`` returns the figures
it prints (``tests/tools/test_advise_flux.py`` runs it once and checks them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from diffusers import FluxTransformer2DModel
from torch._dynamo.utils import counters

import fp32scope
from fp32scope import scope_modules, unscope_modules

CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "guidance_embeds": False,
    "axes_dims_rope": (4, 6, 6),
}
CANDIDATES = ["pos_embed", "time_text_embed.time_proj", r"re:(single_)?transformer_blocks\.\d+", "norm_out"]
TOKENS, TEXT = 16, 8


def batch(seed: int) -> dict[str, Any]:
    """A 4x4 latent image of 16 tokens, 8 text tokens and a timestep: the transformer's keyword arguments."""
    generator = torch.Generator().manual_seed(seed)
    rows, cols = torch.arange(TOKENS) // 4, torch.arange(TOKENS) % 4
    return {
        "hidden_states": torch.randn(1, TOKENS, 16, generator=generator).to(torch.bfloat16),
        "encoder_hidden_states": torch.randn(1, TEXT, 32, generator=generator).to(torch.bfloat16),
        "pooled_projections": torch.randn(1, 32, generator=generator).to(torch.bfloat16),
        "timestep": torch.rand(1, generator=generator).to(torch.bfloat16),
        "img_ids": torch.stack((torch.zeros(TOKENS), rows, cols), dim=-1).float(),
        "txt_ids": torch.zeros(TEXT, 3),
        "return_dict": False,
    }


class Drift(NamedTuple):
    """The model compiled whole against it run eagerly: per batch, and the compile's graphs."""

    relative: list[float]  # ||y - y_eager|| / ||y_eager||, in float64, as advise measures it
    largest: list[float]  # the largest element of |y - y_eager|
    graphs: int
    graph_breaks: int


class Figures(NamedTuple):
    """What ``main`` printed: the plain compile's drift, the tolerance, the advice, the advised policy's drift."""

    plain: Drift
    tolerance: float
    advice: fp32scope.Fp32Advice
    advised: Drift


def drift(model: torch.nn.Module, batches: list[dict[str, Any]], policy: dict[str, Any]) -> Drift:
    """Per batch, the relative and largest error of the model scoped with ``policy`` and compiled whole, vs eager."""
    with torch.no_grad():
        references = [model(**b)[0].double() for b in batches]
        torch.compiler.reset()
        counters.clear()
        scope_modules(model, policy, in_graph=True)  # every node of an eager policy: an in-graph region
        try:
            compiled = torch.compile(model, fullgraph=True)
            diffs = [compiled(**b)[0].double() - r for b, r in zip(batches, references, strict=True)]
        finally:
            unscope_modules(model)
    relative = [float(d.norm() / r.norm()) for d, r in zip(diffs, references, strict=True)]
    largest = [float(d.abs().max()) for d in diffs]
    return Drift(relative, largest, int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values()))


def main() -> Figures:
    """Measure the plain compile's drift, advise, measure the advised policy's; return the figures printed."""
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**CONFIG).to(torch.bfloat16).eval()
    batches, held_out = [batch(0), batch(1)], [batch(2), batch(3)]

    plain = drift(model, batches + held_out, {})
    print("plain compile, relative error per batch:", " ".join(f"{e:.3g}" for e in plain.relative))
    print("plain compile, largest error per batch:", " ".join(f"{e:.3g}" for e in plain.largest))
    print("plain compile, graphs and graph breaks:", plain.graphs, plain.graph_breaks)
    if min(plain.relative) == 0:  # advise takes a positive tolerance
        raise SystemExit("this CPU's Inductor does not drift from eager on every batch: no tolerance under it")
    tolerance = min(plain.relative) / 10
    print(f"tolerance: {tolerance:.3g}")

    advice = fp32scope.advise(
        model,
        batches,
        held_out=held_out,
        compile={"fullgraph": True},
        reference="eager",
        tolerance=tolerance,
        candidates=CANDIDATES,
    )
    print(advice.table())
    print("policy:", advice.policy)
    print(f"candidates and kept: {len(advice.nodes)} {len(advice.policy)}")
    print(f"whole-model and node compiles: {advice.compiles} {advice.node_compiles}")
    print(f"advise seconds: {advice.seconds:.0f}")

    advised = drift(model, batches + held_out, advice.policy)
    print("advised policy, relative error per batch:", " ".join(f"{e:.3g}" for e in advised.relative))
    print("advised policy, largest error per batch:", " ".join(f"{e:.3g}" for e in advised.largest))
    print("advised policy, graphs and graph breaks:", advised.graphs, advised.graph_breaks)
    return Figures(plain, tolerance, advice, advised)


if __name__ == "__main__":
    main()
