"""A tiny Hugging Face GPT-2 for the tests: random weights, no download, or a skip saying why there is none."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests._support.advise_models import tiny_mixtral
from tests._support.probe import probe
from tests._support.releases import TORCH_RELEASE

__all__ = ["ATTENTIONS", "cache_argument", "gpt2_unavailable", "probe_attentions", "tiny_gpt2", "tiny_llama"]


def gpt2_unavailable() -> str | None:
    """Why transformers' GPT-2 cannot run here, or None where it can."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (the test extra installs it: pip install -e .[test])"
    try:
        transformers = importlib.import_module("transformers")
        transformers.GPT2Config, transformers.GPT2LMHeadModel  # noqa: B018  (the import is the check)
    except Exception as error:  # transformers 5.x imports its models only with torch >= 2.6
        why = f"transformers' GPT-2 does not import with torch {TORCH_RELEASE} (transformers 5 needs torch >= 2.6)"
        return f"{why}: {error}"
    if not transformers.is_torch_available():  # transformers 5.x disables its models for torch < 2.6
        return f"transformers {transformers.__version__} does not run its models on torch {TORCH_RELEASE}"
    return None


def cache_argument(model: Any) -> str:
    """The name under which ``model``'s ``forward`` takes a KV cache: ``cache`` (transformers >= 5.25) or the old one.

    Passed under the other name the cache would go into the forward's ``**kwargs``, unused,
    and the model would run with a cache of its own (as on Python 3.10, where transformers
    5.20 is the newest).
    """
    names = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def tiny_gpt2() -> Any:
    """A tiny GPT-2 with random weights (no download), or a skip that says why there is none."""
    reason = gpt2_unavailable()
    if reason is not None:
        pytest.skip(reason)
    transformers = importlib.import_module("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_llama() -> Any:
    """A tiny two-layer Llama with random weights (no download), or a skip that says why there is none."""
    reason = gpt2_unavailable()  # the same check: transformers' models run on this torch
    if reason is not None:
        pytest.skip(reason.replace("GPT-2", "Llama"))
    transformers = importlib.import_module("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _tiny_mixtral() -> Any:
    from tests._support.advise_models import tiny_mixtral

    return tiny_mixtral()


#: Each tiny model with attentions: how to build it, and the pattern naming its attentions.
ATTENTIONS: dict[str, tuple[Callable[[], Any], str]] = {
    "llama": (tiny_llama, r"re:model\.layers\.\d+\.self_attn"),
    "gpt2": (tiny_gpt2, r"re:transformer\.h\.\d+\.attn"),
    "mixtral": (tiny_mixtral, r"re:model\.layers\.\d+\.self_attn"),
}


def probe_attentions(model: torch.nn.Module, pattern: str) -> int:
    """Pass each matching attention's output through a probe tagged "attention"; how many there are."""

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        return (probe(output[0], "attention"), *output[1:])

    found = 0
    for name, module in model.named_modules():
        if re.fullmatch(pattern.removeprefix("re:"), name):
            module.register_forward_hook(hook)
            found += 1
    return found
