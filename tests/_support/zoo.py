"""The zoo's models: tiny random Hugging Face and diffusers models (no download), their inputs and losses.

Each :class:`Architecture` builds its model from a small config (hidden width 32, one or two
layers, a vocabulary of 64 or 128), names its attentions with a ``re:`` pattern for
:func:`fp32scope.scope_modules`, and makes a batch for a forward call and one for a
training step. A builder skips, saying why, where transformers or diffusers (or the
architecture's classes) do not run on this torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch

from tests._support.advise_models import tiny_mixtral
from tests._support.hf import gpt2_unavailable, tiny_gpt2, tiny_llama
from tests._support.probe import probe
from tests._support.releases import TORCH_RELEASE

__all__ = [
    "ARCHITECTURES",
    "NEW_TOKENS",
    "PROMPT",
    "Architecture",
    "output_tensors",
    "probe_modules",
    "without_dropout",
]

_Module = TypeVar("_Module", bound=torch.nn.Module)

#: Tokens in a prompt: longer than the sliding windows below (4), so that a window slides.
PROMPT = 6
#: Tokens ``generate`` adds to a prompt: ten, over which its graphs are counted against plain torch's.
NEW_TOKENS = 10
#: The sliding window of Mistral and Gemma 3: shorter than the prompt.
WINDOW = 4
VOCAB = 64
BATCH = 2


def _transformers(*names: str, arch: str) -> Any:
    """transformers, where its ``names`` import and run on this torch; else a skip saying why not."""
    reason = gpt2_unavailable()  # the same check for every architecture: transformers' models run on this torch
    if reason is not None:
        pytest.skip(reason.replace("GPT-2", arch))
    transformers = importlib.import_module("transformers")
    missing = [name for name in names if not hasattr(transformers, name)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {', '.join(missing)} ({arch})")
    return transformers


def _decoder_config(**extra: Any) -> dict[str, Any]:
    """What every tiny decoder's config says: two layers, width 32, four heads sharing two key-value heads."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        **extra,
    }


def tiny_mistral() -> Any:
    """A two-layer Mistral whose sliding window (4) is shorter than the prompt."""
    transformers = _transformers("MistralConfig", "MistralForCausalLM", arch="Mistral")
    config = transformers.MistralConfig(**_decoder_config(sliding_window=WINDOW))
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).eval()


def tiny_qwen3() -> Any:
    """A two-layer Qwen3 (its query and key norms inside the attention)."""
    transformers = _transformers("Qwen3Config", "Qwen3ForCausalLM", arch="Qwen3")
    config = transformers.Qwen3Config(**_decoder_config(head_dim=8))
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval()


def tiny_gemma3() -> Any:
    """A two-layer text-only Gemma 3: a sliding-window layer (window 4) and a full-attention one."""
    transformers = _transformers("Gemma3TextConfig", "Gemma3ForCausalLM", arch="Gemma3")
    config = transformers.Gemma3TextConfig(
        **_decoder_config(
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
    )
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config).eval()


def tiny_phi3() -> Any:
    """A two-layer Phi-3 (fused query-key-value projection)."""
    transformers = _transformers("Phi3Config", "Phi3ForCausalLM", arch="Phi3")
    # Phi-3's default padding token (32000) lies outside a 64-token vocabulary.
    config = transformers.Phi3Config(**_decoder_config(pad_token_id=0, bos_token_id=1, eos_token_id=2))
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(config).eval()


def tiny_t5() -> Any:
    """A T5 with one encoder and one decoder block."""
    transformers = _transformers("T5Config", "T5ForConditionalGeneration", arch="T5")
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()


def tiny_bert() -> Any:
    """A two-layer BERT with its masked-language-model head."""
    transformers = _transformers("BertConfig", "BertForMaskedLM", arch="BERT")
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config).eval()


IMAGE = 8  # pixels a side: four 4x4 patches
LABELS = 4


def tiny_vit() -> Any:
    """A two-layer ViT image classifier on 8x8 images (four patches)."""
    transformers = _transformers("ViTConfig", "ViTForImageClassification", arch="ViT")
    config = transformers.ViTConfig(
        image_size=IMAGE,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(config).eval()


def diffusers_unavailable() -> str | None:
    """Why diffusers' FLUX transformer cannot run here, or None where it can."""
    if importlib.util.find_spec("diffusers") is None:
        return "diffusers is not installed (the test extra installs it: pip install -e .[test])"
    try:
        diffusers = importlib.import_module("diffusers")
        diffusers.FluxTransformer2DModel  # noqa: B018  (the import is the check)
    except Exception as error:  # diffusers 0.42 uses torch.accelerator, which torch 2.4 lacks
        return f"diffusers' FluxTransformer2DModel does not import with torch {TORCH_RELEASE}: {error}"
    return None


TEXT = 4  # text tokens of a FLUX batch
IMAGE_TOKENS = 8  # image tokens (patches) of a FLUX batch
FLUX_CHANNELS = 16
FLUX_TEXT_WIDTH = 32


def tiny_flux() -> Any:
    """diffusers' FLUX transformer with one double-stream and one single-stream block (the facts' tiny config)."""
    reason = diffusers_unavailable()
    if reason is not None:
        pytest.skip(reason)
    diffusers = importlib.import_module("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=FLUX_CHANNELS,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=FLUX_TEXT_WIDTH,
        pooled_projection_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    return model.eval()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(model: Any, length: int = PROMPT, seed: int = 0) -> torch.Tensor:
    # Token 0 (padding for some) and the first few (beginning and end of sequence) left out.
    return torch.randint(3, model.config.vocab_size, (BATCH, length), generator=_generator(seed))


def _causal_lm(model: Any, *, train: bool) -> dict[str, Any]:
    ids = _ids(model)
    return {"input_ids": ids, "labels": ids} if train else {"input_ids": ids}


def _seq2seq(model: Any, *, train: bool) -> dict[str, Any]:
    ids, target = _ids(model), _ids(model, length=4, seed=1)
    if train:
        return {"input_ids": ids, "labels": target}
    return {"input_ids": ids, "decoder_input_ids": target}


def _masked_lm(model: Any, *, train: bool) -> dict[str, Any]:
    ids = _ids(model)
    return {"input_ids": ids, "labels": ids} if train else {"input_ids": ids}


def _images(model: Any, *, train: bool) -> dict[str, Any]:
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=_generator(0))
    if train:
        return {"pixel_values": pixels, "labels": torch.tensor([1, 3])}
    return {"pixel_values": pixels}


def _flux(_model: Any, *, train: bool) -> dict[str, Any]:
    del train  # the loss is taken from the output: the same batch
    g = _generator(0)
    return {
        "hidden_states": torch.randn(BATCH, IMAGE_TOKENS, FLUX_CHANNELS, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, FLUX_TEXT_WIDTH, generator=g),
        "pooled_projections": torch.randn(BATCH, 32, generator=g),
        "timestep": torch.tensor([0.5, 0.25]),
        "img_ids": torch.randn(IMAGE_TOKENS, 3, generator=g),
        "txt_ids": torch.zeros(TEXT, 3),
    }


def _hf_loss(output: Any) -> torch.Tensor:
    loss: torch.Tensor = output.loss
    return loss


def _flux_loss(output: Any) -> torch.Tensor:
    loss: torch.Tensor = output.sample.square().mean()
    return loss


@dataclass(frozen=True)
class Architecture:
    """One zoo architecture: how to build it, its attentions, its batches, its loss, what it can do."""

    build: Callable[[], Any]
    #: The ``re:`` selector of its attention modules.
    attentions: str
    #: A batch for a forward call (``train=False``) or a training step (``train=True``, with labels).
    batch: Callable[..., dict[str, Any]]
    #: The training loss of an output of a ``train=True`` batch.
    loss: Callable[[Any], torch.Tensor] = _hf_loss
    #: Whether it has ``generate``: a decoder or an encoder-decoder language model.
    generates: bool = True


_LAYERS = r"re:model\.layers\.\d+\.self_attn"

#: The zoo, by name.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(tiny_llama, _LAYERS, _causal_lm),
    "mistral": Architecture(tiny_mistral, _LAYERS, _causal_lm),
    "qwen3": Architecture(tiny_qwen3, _LAYERS, _causal_lm),
    "gemma3": Architecture(tiny_gemma3, _LAYERS, _causal_lm),
    "phi3": Architecture(tiny_phi3, _LAYERS, _causal_lm),
    "gpt2": Architecture(tiny_gpt2, r"re:transformer\.h\.\d+\.attn", _causal_lm),
    "mixtral": Architecture(tiny_mixtral, _LAYERS, _causal_lm),
    "t5": Architecture(
        tiny_t5, r"re:(encoder|decoder)\.block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)", _seq2seq
    ),
    "bert": Architecture(tiny_bert, r"re:bert\.encoder\.layer\.\d+\.attention", _masked_lm, generates=False),
    # ViT's layers are vit.layers in transformers 5.25, vit.encoder.layer (as BERT's) in earlier releases.
    "vit": Architecture(tiny_vit, r"re:vit\.(encoder\.layer|layers)\.\d+\.attention", _images, generates=False),
    "flux": Architecture(
        tiny_flux, r"re:(transformer_blocks|single_transformer_blocks)\.\d+\.attn", _flux, _flux_loss, generates=False
    ),
}


def probe_modules(model: torch.nn.Module, pattern: str, tag: str = "attention") -> int:
    """Pass the first tensor of each matching module's output through a probe tagged ``tag``; how many match.

    The hook goes on the bare module: called before scoping, it stays inside the scoped node.
    """

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return probe(output, tag)
        return (probe(output[0], tag), *output[1:])

    found = 0
    for name, module in model.named_modules():
        if re.fullmatch(pattern.removeprefix("re:"), name):
            module.register_forward_hook(hook)
            found += 1
    return found


def without_dropout(model: _Module) -> _Module:
    """``model`` with every Dropout's probability 0: a training step draws no random numbers."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def output_tensors(output: Any) -> dict[str, torch.Tensor]:
    """The tensors of a model's output (a ModelOutput's tensor fields, or the tensor itself), by name."""
    if isinstance(output, torch.Tensor):
        return {"output": output}
    fields: Mapping[str, Any] = output
    return {name: value for name, value in fields.items() if isinstance(value, torch.Tensor)}
