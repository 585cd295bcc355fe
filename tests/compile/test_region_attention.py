"""Hugging Face attentions as in-graph regions: a compiled training step with ``fullgraph=True``.

An attention takes more than tensors: Llama's and Mixtral's take their rotary embedding as
a tuple ``(cos, sin)``, and all take ``None`` and constants by keyword. Each model is
compiled whole with every attention a region in full float32, under a TF32 default, and
compared step by step with its twin scoped eagerly (the wrappers' own tests check those
against hand-set precisions): loss and every gradient. A forward hook on each bare attention
passes its output through a probe, which reads the precision where the attention runs,
forward and backward.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from fp32scope import current_fp32_precision, scope_modules, set_process_default
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL
from tests._support.compiled import python_frames
from tests._support.hf import ATTENTIONS, probe_attentions
from tests._support.probe import phases

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

KEPT = {"matmul": "highest", "cudnn_allow_tf32": False}


@pytest.fixture(autouse=True)
def _clear_probes() -> None:
    _probe.SEEN.clear()


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # The next-token loss, taken outside the model (a model's own loss may warn once inside
    # its forward, which Dynamo cannot trace with fullgraph=True, fp32scope or not).
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _skip_where_torch_fails_without_fp32scope(build: Callable[[], Any], error: Exception) -> None:
    """Skip, saying why, where the same unscoped model's compiled training step fails too."""
    torch._dynamo.reset()
    model = build()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    try:
        compiled: Callable[..., Any] = torch.compile(model, fullgraph=True)
        torch.autograd.backward(_loss(compiled(input_ids=ids, use_cache=False).logits, ids))
    except Exception as plain:  # whatever torch raises: the control's own failure
        first = str(plain).strip().splitlines()[0] if str(plain).strip() else type(plain).__name__
        pytest.skip(f"torch.compile of this model's training step fails here without fp32scope too: {first}")
    raise error


def _compare_with_twin(loss: torch.Tensor, model: Any, twin: Any, ids: torch.Tensor, step: int) -> None:
    """The eager scoped twin's step on the same ids: the same loss and every gradient."""
    expected = _loss(twin(input_ids=ids, use_cache=False).logits, ids)
    torch.autograd.backward(expected)
    torch.testing.assert_close(loss, expected)
    for (pname, got), want in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (got.grad is None) == (want.grad is None), pname
        if got.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, msg=f"{pname}.grad, step {step}")


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_attentions_as_regions_train_as_their_eager_scoped_twin(name: str) -> None:
    build, pattern = ATTENTIONS[name]
    set_process_default(DEFAULT)
    model = build()
    probe_attentions(model, pattern)
    twin = copy.deepcopy(model)
    scope_modules(model, {pattern: KEPT}, in_graph=True)
    scope_modules(twin, {pattern: KEPT})
    compiled: Callable[..., Any] = torch.compile(model, fullgraph=True)
    vocab = model.config.vocab_size
    for step in range(2):
        ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(step))
        _probe.SEEN.clear()
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        try:
            loss = _loss(compiled(input_ids=ids, use_cache=False).logits, ids)
            torch.autograd.backward(loss)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            # (transformers' Mixtral on some installs: its grouped-mm backward fails Inductor's lowering.)
            _skip_where_torch_fails_without_fp32scope(build, error)
        assert phases("fwd")["attention"] == [FULL] * 2  # each layer's attention, in its precision
        assert phases("bwd")["attention"] == [FULL] * 2
        assert current_fp32_precision() == DEFAULT
        _compare_with_twin(loss, model, twin, ids, step)
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_attentions_compiled_inside_their_regions_train_as_their_eager_scoped_twin(name: str) -> None:
    # Without hooks each attention is compiled by Inductor inside its region: no Python frame
    # of its forward runs once warm (tests/compile/test_inner.py reads the precision inside
    # such nodes with probes, forward and backward, and where Inductor generates their code).
    build, pattern = ATTENTIONS[name]
    set_process_default(DEFAULT)
    model = build()
    attention = type(next(m for n, m in model.named_modules() if re.fullmatch(pattern.removeprefix("re:"), n)))
    twin = copy.deepcopy(model)
    scope_modules(model, {pattern: KEPT}, in_graph=True)
    scope_modules(twin, {pattern: KEPT})
    compiled: Callable[..., Any] = torch.compile(model, fullgraph=True)
    vocab = model.config.vocab_size
    for step in range(2):
        ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(step))
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        # Counted warm only: a profiler while Dynamo and Inductor compile slows them down many times.
        with python_frames(attention.forward.__code__) if step else contextlib.nullcontext([0]) as frames:
            loss = _loss(compiled(input_ids=ids, use_cache=False).logits, ids)
            torch.autograd.backward(loss)
        if step:
            assert frames == [0]  # warm: each attention ran as Inductor's code
        assert current_fp32_precision() == DEFAULT
        _compare_with_twin(loss, model, twin, ids, step)
    assert sum(counters["graph_break"].values()) == 0
