"""Small models for ``advise`` (tests/tools/test_advise.py), importable as command line targets."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest
import torch

WIDTH = 32
EXPERTS = 4
#: Tolerance of the router model: above the experts' bf16 error (about 4e-3), far below a flipped choice's.
ROUTER_TOLERANCE = 2e-2


class NearTieMoE(torch.nn.Module):
    """A top-1 mixture of experts whose router's logits nearly tie: bf16 flips its choices.

    The router's rows are one random row plus 2e-3 noise, so the logits of one token differ
    by about 1e-2, less than bf16 rounds them by; the experts are plain Linear layers.
    """

    def __init__(self, width: int = WIDTH, experts: int = EXPERTS) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.router = torch.nn.Linear(width, experts, bias=False)
        linears = [torch.nn.Linear(width, width) for _ in range(experts)]
        self.experts = torch.nn.ModuleList(linears)
        with torch.no_grad():
            row = torch.randn(1, width, generator=generator)
            self.router.weight.copy_(row + 2e-3 * torch.randn(experts, width, generator=generator))
            for expert in linears:
                expert.weight.copy_(torch.randn(width, width, generator=generator) / width**0.5)
                expert.bias.copy_(torch.randn(width, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(dim=-1)
        outputs = torch.stack([expert(x) for expert in self.experts], dim=1)
        return outputs[torch.arange(x.shape[0]), choice].float()


def near_tie_batch() -> torch.Tensor:
    return torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(1))


def near_tie_batches() -> list[Any]:
    """Two batches, one a tuple of positional arguments and one a dict... of the same model."""
    second = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(2))
    return [(near_tie_batch(),), {"x": second}]


def near_tie_loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


class Cancellation(torch.nn.Module):
    """``a(x) - b(x)`` with nearly equal weights: reduced precision in either one is a large relative error.

    Wide (256): on a oneDNN CPU "medium" changes only products above a size, and by how much
    depends on the CPU: bf16 on one with AMX (a product about 2e-3 off, which makes the small
    ``c`` matter too), far less on others (about 5e-7), nothing on some.
    """

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(width, width, bias=False)
        self.b = torch.nn.Linear(width, width, bias=False)
        self.c = torch.nn.Linear(width, width, bias=False)
        with torch.no_grad():
            weight = torch.randn(width, width, generator=generator) / width**0.5
            self.a.weight.copy_(weight)
            self.b.weight.copy_(weight + 1e-4 * torch.randn(width, width, generator=generator) / width**0.5)
            self.c.weight.copy_(1e-4 * torch.randn(width, width, generator=generator) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(x) - self.b(x) + self.c(x)
        return out


def cancellation_batch() -> torch.Tensor:
    return torch.randn(32, 256, generator=torch.Generator().manual_seed(1))


class OwnWork(torch.nn.Module):
    """The root's own forward runs a matmul: no candidate policy can make it full float32."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(0)))
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x @ self.weight)
        return out.float()


class Noisy(torch.nn.Module):
    """A model whose every call differs (a counter in its output): not deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.head(x)
        return out.float() + 1e-2 * self.calls


class Attention(torch.nn.Module):
    """Self-attention whose projections are children: its own work is softmax(QK^T)V."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, WIDTH)
        self.k = torch.nn.Linear(WIDTH, WIDTH)
        self.v = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2)) / WIDTH**0.5
        return torch.matmul(scores.softmax(dim=-1), self.v(x))


class Block(torch.nn.Module):
    """An attention, a container with an activation, and a head: which of them do work of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.mlp(self.attn(x)))
        return out


def block_batch() -> torch.Tensor:
    return torch.randn(2, 8, WIDTH, generator=torch.Generator().manual_seed(1))


def tiny_mixtral() -> torch.nn.Module:
    """A two-layer Mixtral (4 experts, top 2) built from its config (nothing downloaded), or a skip saying why not."""
    release = torch.__version__.split("+")[0]
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (the test extra installs it: pip install -e .[test])")
    try:
        transformers = importlib.import_module("transformers")
        config_class, model_class = transformers.MixtralConfig, transformers.MixtralForCausalLM
    except Exception as error:  # transformers 5.x imports its models only with torch >= 2.6
        pytest.skip(f"transformers' Mixtral does not import with torch {release}: {error}")
    if not transformers.is_torch_available():  # transformers 5.x disables its models for torch < 2.6
        pytest.skip(f"transformers {transformers.__version__} does not run its models on torch {release}")
    torch.manual_seed(0)
    config = config_class(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model: torch.nn.Module = model_class(config)
    return model.eval()


def mixtral_batch() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))}


class Outer(torch.nn.Module):
    """A near-tie router as a child, and a difference of nearly equal products as its own work."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.router = torch.nn.Linear(WIDTH, EXPERTS, bias=False)
        weight = torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5
        self.weight = torch.nn.Parameter(weight)
        self.nearly = torch.nn.Parameter(weight + 0.05 * torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5)
        with torch.no_grad():
            row = torch.randn(1, WIDTH, generator=generator)
            self.router.weight.copy_(row + 2e-3 * torch.randn(EXPERTS, WIDTH, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(dim=-1, keepdim=True)
        difference = x @ self.weight - x @ self.nearly
        out: torch.Tensor = difference * (1 + 10 * choice)
        return out.float()


class Nested(torch.nn.Module):
    """``Outer`` inside a root: the search keeps the router first, then ``outer``, which makes the router redundant."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = Outer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.outer(x)
        return out


# -- models for what advise must leave as found, and for its figures ---------------------------


class BatchNormNet(torch.nn.Module):
    """A near-tie router model with BatchNorm in front: train mode moves its running statistics."""

    seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(WIDTH)
        self.moe = NearTieMoE()
        # Not in the state_dict: advise must put back every buffer, not only the persistent ones.
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)
        out: torch.Tensor = self.moe(self.norm(x))
        return out


class Stateful(torch.nn.Module):
    """Its output depends on a buffer it increments each call: repeatable only if the buffer is put back."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.moe = NearTieMoE()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        out: torch.Tensor = self.moe(x) * self.calls
        return out


class Reassigns(torch.nn.Module):
    """Its forward assigns a new tensor to a buffer (``adds``: registers one more); advise puts back its own."""

    calls: torch.Tensor

    def __init__(self, *, adds: bool = False) -> None:
        super().__init__()
        self.moe = NearTieMoE()
        self.adds = adds
        self.register_buffer("calls", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        if self.adds:
            self.register_buffer("added", self.calls.clone())
        out: torch.Tensor = self.moe(x) * self.calls[0]
        return out


class WritesItsWeight(torch.nn.Module):
    """Its forward writes one of its parameters (as some normalisations do): advise must put it back."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = NearTieMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.moe.router.weight  # any parameter: this one matters most
        with torch.no_grad():
            bias.add_(1e-3)
        out: torch.Tensor = self.moe(x)
        return out


class TwoLayer(torch.nn.Module):
    """64 -> 64 then 64 -> 256: with a loss, the first does 1/7 of the work (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(64, 64, bias=False)
        self.second = torch.nn.Linear(64, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(torch.relu(self.first(x)))
        return out


def two_layer_batch() -> torch.Tensor:
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


def mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def quiet_batch() -> torch.Tensor:
    """A batch of zeros: the router's logits are all 0 (no flip), only the biases reach the output."""
    return torch.zeros(64, WIDTH)


def held_out_batches() -> list[Any]:
    return [torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(seed)) for seed in (3, 4, 5)]


STEPS = 6


def sample(model: torch.nn.Module, x: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """A sampling loop: each step feeds the model's output back in (error grows over the steps)."""
    for _ in range(steps):
        x = x + 0.1 * model(x)
    return x


#: The models the factories below built, for tests that check a command refused before building.
BUILT: list[str] = []


def counted_model() -> torch.nn.Module:
    BUILT.append("counted_model")
    return NearTieMoE()


class Raises(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        msg = "the model's forward fails"
        raise RuntimeError(msg)


def scoped_model() -> torch.nn.Module:
    import fp32scope

    model = NearTieMoE()
    fp32scope.scope_modules(model, {"router": "highest"})
    return model


def meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return NearTieMoE()


def failing_loss(output: torch.Tensor) -> torch.Tensor:
    msg = "the loss fails"
    raise ValueError(msg)


class _Probe(torch.autograd.Function):
    """The identity, noting the matmul precision its forward and its backward run at."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list[tuple[str, str, str]], name: str) -> torch.Tensor:
        ctx.log, ctx.name = log, name
        log.append((name, "forward", torch.get_float32_matmul_precision()))
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.log.append((ctx.name, "backward", torch.get_float32_matmul_precision()))
        return grad, None, None


class ProbedLinear(torch.nn.Module):
    """A Linear whose own work notes the precision of its forward and of its backward."""

    def __init__(self, name: str, log: list[tuple[str, str, str]]) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.name, self.log = name, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Probe.apply(self.linear(x), self.log, self.name)  # type: ignore[no-untyped-call]
        return out


class Probed(torch.nn.Module):
    """Two probed nodes in a row; ``log`` holds what they noted, a ``("run", ...)`` entry at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, str]] = []
        self.first = ProbedLinear("first", self.log)
        self.second = ProbedLinear("second", self.log)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(("run", "", ""))
        out: torch.Tensor = self.second(torch.tanh(self.first(x)))
        return out
