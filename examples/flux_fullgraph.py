"""A layer of a model compiled with ``fullgraph=True`` in full float32: FLUX's ``time_text_embed``.

diffusers recommends compiling its transformers whole, with ``fullgraph=True``. A scoped
node is by default (``in_graph=True``, written out below) one region of the model's single
graph, run at run time inside its precision (forward and backward), while the rest of the
graph runs at the process default; ``in_graph=False`` would be a graph break, which
``fullgraph=True`` refuses.

The model is a tiny ``FluxTransformer2DModel`` built from its config (random weights, no
download). A forward hook on ``time_text_embed`` prints the precision its kernels run
with: inside a region the node runs for real on every call, so the hook does too (it is
also called on fake tensors while the graph is traced, when it says nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers import FluxTransformer2DModel
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import is_fake

from fp32scope import Fp32Precision, current_fp32_precision, scope_modules, set_process_default

CONFIG = {
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


def _show(_module: object, _args: object, output: torch.Tensor) -> None:
    if not is_fake(output):  # not the runs on fake tensors while the graph is traced
        print(f"  time_text_embed ran with {current_fp32_precision()}")


def main() -> None:
    """Build, scope, compile with fullgraph=True, and show what ran where."""
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**CONFIG).eval()
    model.time_text_embed.register_forward_hook(_show)

    set_process_default(Fp32Precision("high", cudnn_allow_tf32=True))
    print("scoped:", scope_modules(model, {"time_text_embed": "highest"}, in_graph=True))

    tokens, text = 16, 8
    inputs = {
        "hidden_states": torch.randn(1, tokens, 16),
        "encoder_hidden_states": torch.randn(1, text, 32),
        "pooled_projections": torch.randn(1, 32),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(tokens, 3),
        "txt_ids": torch.zeros(text, 3),
        "return_dict": False,
    }
    compiled: Callable[..., Any] = torch.compile(model, fullgraph=True)
    counters.clear()
    with torch.no_grad():
        print("compiled call 1:")
        out = compiled(**inputs)[0]
        print("compiled call 2:")
        compiled(**inputs)
        print("eager call (the same scoped model, not compiled):")
        ref = model(**inputs)[0]
    graphs = int(counters["stats"]["unique_graphs"])
    breaks = sum(counters["graph_break"].values())
    print(f"graphs: {graphs}, graph breaks: {breaks}")
    print(f"largest difference from the eager call: {float((out - ref).abs().max()):.1e}")
    print(f"process default after the calls: {current_fp32_precision()}")


if __name__ == "__main__":
    main()
