"""Small models whose compiled results drift from eager, for ``advise(..., compile=...)``.

Each drifting block is pointwise bf16 work (no parameter, no matmul) that Inductor fuses,
keeping the intermediates in float32 where eager rounds each one to bf16: a rotate-half
rotary embedding (pytorch issue 183122's pattern) and a sinusoidal timestep embedding
(FLUX's ``time_text_embed``, pytorch issue 196957). Linears around them drift not at all.
And diffusers' own ``time_text_embed`` at FLUX.1's widths (random weights), whose
``time_proj`` (the sinusoid) drifts compiled.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fp32scope import scope_modules, unscope_modules

WIDTH = 64
BF16 = torch.bfloat16


class Rope(torch.nn.Module):
    """A rotate-half rotary embedding: pointwise work and no parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
        angles = torch.arange(x.shape[-1], dtype=torch.float32).to(x.dtype) * 0.37
        return x * angles.cos() + rotated * angles.sin()


class Sinusoid(torch.nn.Module):
    """A sinusoidal embedding of each value added to it: pointwise work and no parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half).to(x.dtype)
        angles = x[..., :half] * 100.0 * freqs
        return torch.cat((angles.cos(), angles.sin()), dim=-1) + x


class RopeNet(torch.nn.Module):
    """``before -> rope -> middle -> sinusoid -> after``: two drifting blocks between three linears."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.before = torch.nn.Linear(WIDTH, WIDTH)
        self.rope = Rope()
        self.middle = torch.nn.Linear(WIDTH, WIDTH)
        self.sinusoid = Sinusoid()
        self.after = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.after(self.sinusoid(self.middle(self.rope(self.before(x)))))
        return out


def rope_net() -> torch.nn.Module:
    """The model in bf16, eval mode."""
    return RopeNet().to(BF16).eval()


def rope_batches(count: int = 1, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, WIDTH, generator=generator).to(BF16) for _ in range(count)]


def rope_batch() -> torch.Tensor:
    return rope_batches()[0]


def rope_held_out() -> list[torch.Tensor]:
    return rope_batches(1, seed=1)


#: FLUX.1's time_text_embed widths: a 3072-wide embedding, a 768-wide pooled text projection.
FLUX_WIDTH, FLUX_POOLED = 3072, 768
FLUX_STEPS = 200


def flux_time_text_embed() -> torch.nn.Module:
    """diffusers' CombinedTimestepTextProjEmbeddings at FLUX.1's widths, random weights, bf16, eval mode."""
    from diffusers.models.embeddings import CombinedTimestepTextProjEmbeddings

    torch.manual_seed(0)
    model: torch.nn.Module = CombinedTimestepTextProjEmbeddings(FLUX_WIDTH, FLUX_POOLED)
    return model.to(BF16).eval()


def flux_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch: 200 timesteps in [0, 1000) and as many pooled text projections."""
    generator = torch.Generator().manual_seed(seed)
    timesteps = (torch.rand(FLUX_STEPS, generator=generator) * 1000).to(BF16)
    pooled = torch.randn(FLUX_STEPS, FLUX_POOLED, generator=generator).to(BF16)
    return [(timesteps, pooled)]


def flux_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return flux_batches()[0]


def flux_held_out() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return flux_batches(seed=1)


def _relative(output: torch.Tensor, reference: torch.Tensor) -> float:
    diff = float((output.double() - reference.double()).norm())
    return diff / float(reference.double().norm())


def compiled_error(model: torch.nn.Module, batches: list[Any], policy: dict[str, Any], **options: Any) -> float:
    """The largest error over ``batches`` of the model scoped with ``policy`` and compiled whole, vs eager.

    A batch is a tensor or a tuple of positional arguments.
    """
    batches = [x if isinstance(x, tuple) else (x,) for x in batches]
    with torch.no_grad():
        references = [model(*x) for x in batches]
        torch.compiler.reset()
        if policy:
            scope_modules(model, policy)
        try:
            fast = torch.compile(model, **options)
            return max(_relative(fast(*x), r) for x, r in zip(batches, references, strict=True))
        finally:
            unscope_modules(model)
            torch.compiler.reset()
