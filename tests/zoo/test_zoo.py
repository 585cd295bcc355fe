"""The model zoo: tiny random models of common architectures, compiled whole with their attentions scoped.

Each architecture of :data:`tests._support.zoo.ARCHITECTURES` (Llama, Mistral, Qwen3, Gemma 3,
Phi-3, GPT-2, Mixtral, T5, BERT, ViT, FLUX) is built offline from a tiny config, its
attentions scoped to full float32 under a TF32 process default, and compiled with
``fullgraph=True`` (Inductor), so that each attention is an in-graph region. Each check
compares it with its twin scoped eagerly (``in_graph=False``, not compiled):

- ``forward``: the outputs of a forward call;
- ``train``: the loss and every parameter's gradient of one training step;
- ``generate-dynamic``, ``generate-static``: the tokens of a greedy ``generate`` with the
  model's ``forward`` compiled, with the default (dynamic) cache and with the static one.

Each also asserts no graph break, the precision read where each attention runs (a forward
hook on each bare attention passes its output through a probe, which records the flags in
forward and in backward), and the process default after; ``generate`` compiles no more
graphs than plain torch over the same decode. Plain torch is the baseline:
the same check runs first on the unscoped model compiled the same way, and where plain
torch.compile cannot do it (an error, a graph break, other results than eager) the test
skips saying so. What fp32scope cannot do yet where plain torch can is in
:data:`KNOWN_FAILURES`, a strict xfail each.

CI's default run checks a few architectures (:data:`DEFAULT_RUN`); the rest carry the
``zoo`` marker and run with ``FP32SCOPE_ZOO=1`` (``nox -s zoo``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from _pytest.mark import ParameterSet
from torch._dynamo.utils import counters

from fp32scope import Fp32ScopeError, current_fp32_precision, scope_modules, set_process_default
from tests._support import probe as _probe
from tests._support.common import DEFAULT, FULL
from tests._support.probe import backward, phases
from tests._support.zoo import ARCHITECTURES, NEW_TOKENS, output_tensors, probe_modules, without_dropout

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("fresh_dynamo")]

#: The attentions' precision: full float32 (as tests/compile/test_region_caches.py keeps them).
KEPT = {"matmul": "highest", "cudnn_allow_tf32": False}

#: What each check does, as the skip of a plain-torch baseline says it.
CHECKS = {
    "forward": "compile the forward call with fullgraph=True",
    "train": "compile a training step with fullgraph=True",
    "generate-dynamic": "compile generate's forward with fullgraph=True with a dynamic cache",
    "generate-static": "compile generate's forward with fullgraph=True with a static cache",
}

#: The (architecture, check) pairs CI's default run checks; every other one runs in ``nox -s zoo``.
DEFAULT_RUN = {
    ("llama", "forward"),
    ("llama", "generate-static"),
    ("gpt2", "forward"),
    ("mistral", "forward"),
    ("mistral", "generate-static"),  # a static sliding layer: a graph per branch of its update
}

#: What fp32scope cannot do yet where plain torch can, by (architecture, check), each found by
#: running it: a strict xfail each (raising Fp32ScopeError), so that a fix fails the test until its entry goes.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}

ZOO = os.environ.get("FP32SCOPE_ZOO") == "1"


def _cases(*checks: str) -> list[ParameterSet]:
    """Each architecture that can do ``checks``, as (name, check) parameters with their marks."""
    cases = []
    for name, arch in ARCHITECTURES.items():
        for check in checks:
            if check.startswith("generate") and not arch.generates:
                continue
            marks: list[pytest.MarkDecorator] = []
            if (name, check) not in DEFAULT_RUN:
                reason = "the whole zoo runs in nox -s zoo (FP32SCOPE_ZOO=1)"
                marks += [pytest.mark.zoo, pytest.mark.skipif(not ZOO, reason=reason)]
            if (name, check) in KNOWN_FAILURES:
                why = f"issue 57: {KNOWN_FAILURES[name, check]}"
                marks.append(pytest.mark.xfail(raises=Fp32ScopeError, strict=True, reason=why))
            cases.append(pytest.param(name, check, marks=marks, id=f"{name}-{check}"))
    return cases


def _breaks() -> dict[str, int]:
    return dict(counters["graph_break"])


def _plain_torch(check: str, baseline: Callable[[], None]) -> int:
    """Run ``baseline`` (the check on the unscoped model); skip saying why where plain torch.compile cannot.

    Returns the graphs Dynamo compiled for it. Dynamo is reset afterwards: the scoped model
    compiles afresh, its breaks and graphs counted alone.
    """
    try:
        baseline()
    except Exception as error:  # any failure of plain torch is a reason to skip, said
        first_line = next(iter(str(error).splitlines()), "")  # (Dynamo's explanations and hints follow)
        pytest.skip(f"plain torch.compile cannot {CHECKS[check]}: {type(error).__name__}: {first_line}")
    if _breaks():
        pytest.skip(f"plain torch.compile cannot {CHECKS[check]} without a graph break: {_breaks()}")
    graphs = int(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    counters.clear()
    return graphs


def _saying(what: str) -> Callable[[str], str]:
    """An assert_close message that names what it compares, before torch's own."""
    return lambda message: f"{what}: {message}"


def _assert_outputs_equal(got: Any, want: Any) -> None:
    mine, theirs = output_tensors(got), output_tensors(want)
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(mine[name], tensor, msg=_saying(name))


def _scoped_pair(model: Any, attentions: str) -> tuple[Any, int]:
    """``model`` with its attentions probed and scoped as in-graph regions, its twin scoped eagerly; probed count."""
    probed = probe_modules(model, attentions)
    twin = copy.deepcopy(model)  # hooks and all
    scope_modules(model, {attentions: KEPT}, in_graph=True)
    scope_modules(twin, {attentions: KEPT}, in_graph=False)
    return twin, probed


@pytest.mark.parametrize(("name", "check"), _cases("forward"))
def test_a_zoo_model_compiled_fullgraph_with_attentions_scoped_matches_its_eager_twin(name: str, check: str) -> None:
    arch = ARCHITECTURES[name]
    set_process_default(DEFAULT)
    model = arch.build()
    batch = arch.batch(model, train=False)

    def plain() -> None:
        bare = copy.deepcopy(model)
        with torch.no_grad():
            compiled: Callable[..., Any] = torch.compile(bare, fullgraph=True)
            _assert_outputs_equal(compiled(**batch), bare(**batch))

    _plain_torch(check, plain)
    twin, probed = _scoped_pair(model, arch.attentions)
    compiled: Callable[..., Any] = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        want = twin(**batch)
        _probe.SEEN.clear()
        got = compiled(**batch)
    assert phases("fwd")["attention"] == [FULL] * probed  # each attention ran in its precision
    _assert_outputs_equal(got, want)
    assert current_fp32_precision() == DEFAULT
    assert _breaks() == {}


def _training_step(
    call: Callable[..., Any], model: torch.nn.Module, batch: dict[str, Any], loss_of: Callable[[Any], torch.Tensor]
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor | None]]]:
    """The loss of ``call(**batch)`` and, after its backward, each of ``model``'s gradients by name."""
    loss = loss_of(call(**batch))
    backward(loss)
    return loss.detach(), [(n, p.grad) for n, p in model.named_parameters()]


def _assert_steps_equal(
    got: tuple[torch.Tensor, list[tuple[str, torch.Tensor | None]]],
    want: tuple[torch.Tensor, list[tuple[str, torch.Tensor | None]]],
) -> None:
    torch.testing.assert_close(got[0], want[0], msg=_saying("loss"))
    assert [n for n, _ in got[1]] == [n for n, _ in want[1]]
    for (name, mine), (_, theirs) in zip(got[1], want[1], strict=True):
        assert (mine is None) == (theirs is None), f"gradient of {name}: {mine} against {theirs}"
        if mine is not None:
            torch.testing.assert_close(mine, theirs, msg=_saying(f"gradient of {name}"))


@pytest.mark.parametrize(("name", "check"), _cases("train"))
def test_a_zoo_model_compiled_fullgraph_with_attentions_scoped_trains_as_its_eager_twin(name: str, check: str) -> None:
    arch = ARCHITECTURES[name]
    set_process_default(DEFAULT)
    model = without_dropout(arch.build().train())
    batch = arch.batch(model, train=True)

    def plain() -> None:
        bare, eager = copy.deepcopy(model), copy.deepcopy(model)
        want = _training_step(eager, eager, batch, arch.loss)
        _assert_steps_equal(_training_step(torch.compile(bare, fullgraph=True), bare, batch, arch.loss), want)

    _plain_torch(check, plain)
    twin, probed = _scoped_pair(model, arch.attentions)
    want = _training_step(twin, twin, batch, arch.loss)
    _probe.SEEN.clear()
    got = _training_step(torch.compile(model, fullgraph=True), model, batch, arch.loss)
    assert phases("fwd")["attention"] == [FULL] * probed
    assert phases("bwd")["attention"] == [FULL] * probed
    _assert_steps_equal(got, want)
    assert current_fp32_precision() == DEFAULT
    assert _breaks() == {}


@pytest.mark.parametrize(("name", "check"), _cases("generate-dynamic", "generate-static"))
def test_a_zoo_model_with_its_forward_compiled_fullgraph_generates_its_eager_twins_tokens(
    name: str, check: str
) -> None:
    # What a plain-torch user writes: the model's forward compiled whole inside
    # transformers' own generate loop.
    arch = ARCHITECTURES[name]
    set_process_default(DEFAULT)
    model = arch.build()
    ids = arch.batch(model, train=False)["input_ids"]
    options: dict[str, Any] = {"attention_mask": torch.ones_like(ids), "max_new_tokens": NEW_TOKENS, "do_sample": False}
    if check == "generate-static":
        options["cache_implementation"] = "static"

    def plain() -> None:
        bare, eager = copy.deepcopy(model), copy.deepcopy(model)
        bare.forward = torch.compile(bare.forward, fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(bare.generate(ids, **options), eager.generate(ids, **options), rtol=0, atol=0)

    plain_graphs = _plain_torch(check, plain)
    twin, probed = _scoped_pair(model, arch.attentions)
    model.forward = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        _probe.SEEN.clear()
        want = twin.generate(ids, **options)
        calls = len(phases("fwd")["attention"])  # every attention of every step, eagerly
        assert calls >= probed
        _probe.SEEN.clear()
        got = model.generate(ids, **options)
    assert phases("fwd")["attention"] == [FULL] * calls
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert current_fp32_precision() == DEFAULT
    assert _breaks() == {}
    # Recompiles: no more than plain torch's over the same decode (Inductor compiles the
    # attentions inside their regions: every graph is the model's).
    assert 0 < int(counters["stats"]["unique_graphs"]) <= plain_graphs
