"""A tiny Hugging Face GPT-2 for the tests: random weights, no download, or a skip saying why there is none."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest
import torch

from tests._support.releases import TORCH_RELEASE

__all__ = ["tiny_gpt2"]


def tiny_gpt2() -> Any:
    """A tiny GPT-2 with random weights (no download), or a skip that says why there is none."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (the test extra installs it: pip install -e .[test])")
    try:
        transformers = importlib.import_module("transformers")
        config_class, model_class = transformers.GPT2Config, transformers.GPT2LMHeadModel
    except Exception as error:  # transformers 5.x imports its models only with torch >= 2.6
        reason = f"transformers' GPT-2 does not import with torch {TORCH_RELEASE} (transformers 5 needs torch >= 2.6)"
        pytest.skip(f"{reason}: {error}")
    if not transformers.is_torch_available():  # transformers 5.x disables its models for torch < 2.6
        pytest.skip(f"transformers {transformers.__version__} does not run its models on torch {TORCH_RELEASE}")
    config = config_class(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return model_class(config).eval()
