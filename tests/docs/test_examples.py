"""Each script in examples/ runs, exits 0 (or returns from its ``main()``) and prints what it shows.

A script whose point needs a fresh interpreter runs as a user would run it, in one: worker
processes (multiprocess_workers.py), pytest in subprocesses (pytest_plugin_suite.py). The
others' ``main()`` runs in this process, Dynamo reset around it, after a check that running
the file calls that ``main()``: a fresh interpreter for each would check nothing more, and
costs its start, its imports (transformers and diffusers take 8 s each) and its first
compile's warm-up, 10 to 16 s of each such test. (aoti_package.py still loads its package
in a fresh interpreter of its own: that is its point.)
"""

from __future__ import annotations

import pytest

from tests._support.examples import EXAMPLES, run_example, run_example_main
from tests._support.hf import gpt2_unavailable


def test_every_example_is_tested() -> None:
    tested = {"compiled_nodes.py", "cuda_graph_capture.py", "engine_threads.py", "multiprocess_workers.py"}
    tested |= {"pytest_plugin_suite.py", "ddp_training.py"}  # ddp_training.py: in test_backward.py
    tested |= {"fsdp2_training.py"}  # in test_sharded.py
    tested |= {"aoti_package.py"}
    tested |= {"training_loop.py"}
    tested |= {"amp_training.py"}
    tested |= {"advise_moe.py"}
    tested |= {"flux_fullgraph.py", "llama_attention_fullgraph.py"}
    tested |= {"flux_advise_compile.py"}  # in tests/tools/test_advise_flux.py
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_training_loop() -> None:
    out, _ = run_example_main("training_loop.py")
    router = "Fp32Precision(matmul='highest', cudnn_allow_tf32=False)"
    assert out.count(f"  router forward:  {router}") == 3
    assert out.count(f"  router backward: {router}") == 3
    assert out.count("after the step: Fp32Precision(matmul='high', cudnn_allow_tf32=True)") == 3
    assert "the loss went down" in out


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_nodes() -> None:
    out, _ = run_example_main("compiled_nodes.py")
    assert "inside head    Fp32Precision(matmul='highest', cudnn_allow_tf32=False)" in out
    assert "inside decode  Fp32Precision(matmul='medium', cudnn_allow_tf32=True)" in out
    assert "the process default is back after every call: Fp32Precision(matmul='high', cudnn_allow_tf32=True)" in out


@pytest.mark.usefixtures("fresh_dynamo")
def test_cuda_graph_capture() -> None:
    out, _ = run_example_main("cuda_graph_capture.py")
    if "No CUDA device" in out:
        assert "capture_cuda_graph on this machine: RuntimeError: capture_cuda_graph needs a CUDA device" in out
        assert "calling the proxy gives 'graph replayed', run in Fp32Precision(matmul='highest'" in out
        assert "the wrapped module holds it: True" in out
    else:
        assert "capture_cuda_graph: replay matches the eager call: True" in out
        assert "make_graphed_callables: graphed is the proxy: True" in out


@pytest.mark.usefixtures("fresh_dynamo")
def test_engine_threads() -> None:
    out, _ = run_example_main("engine_threads.py")
    assert "plan thread reads:              Fp32Precision(matmul='highest', cudnn_allow_tf32=False)" in out
    assert "plan thread got Fp32ScopeError: Cannot enter an fp32_precision_scope on thread 'plan'" in out
    assert "while thread 'forward'" in out
    assert "process default is back:        Fp32Precision(matmul='high', cudnn_allow_tf32=True)" in out


def test_multiprocess_workers() -> None:
    out = run_example("multiprocess_workers.py")
    assert "every worker ran with its own default and its node's precision" in out
    assert out.count("inside the node Fp32Precision(matmul='highest', cudnn_allow_tf32=False)") == 4


def test_pytest_plugin_suite() -> None:
    out = run_example("pytest_plugin_suite.py")
    assert "1. the suite, with --fp32scope-strict:\n   pytest exit status 0: 4 passed" in out
    assert "strict mode reports: torch.get_float32_matmul_precision(): 'highest' -> 'medium'" in out


def _aoti_missing() -> str | None:
    from fp32scope._export.export import _aoti_missing

    return _aoti_missing()


@pytest.mark.compile
@pytest.mark.skipif(_aoti_missing() is not None, reason=f"{_aoti_missing()}: the example compiles a package")
@pytest.mark.usefixtures("fresh_dynamo")
def test_aoti_package() -> None:
    out, _ = run_example_main("aoti_package.py")
    assert "exporting the scoped node: torch.export cannot export a scoped call" in out
    assert "'fp32scope.matmul': 'highest'" in out
    assert "loading process default: Fp32Precision(matmul='medium', cudnn_allow_tf32=True)" in out
    assert "precision_of(loaded package): Fp32Precision(matmul='highest', cudnn_allow_tf32=False)" in out
    for mode in ("grad", "no_grad", "inference_mode"):
        assert f"call under {mode:<15} ran in Fp32Precision(matmul='highest', cudnn_allow_tf32=False)" in out
    assert "after the calls the default is back: Fp32Precision(matmul='medium', cudnn_allow_tf32=True)" in out


@pytest.mark.usefixtures("fresh_dynamo")
def test_amp_training() -> None:
    out, _ = run_example_main("amp_training.py")
    router = "Fp32ScopedModule(precision=Fp32Precision(matmul='highest', cudnn_allow_tf32=False), name='Router'"
    assert f"router wrapper: {router}, backward=True, autocast=False," in out
    assert out.count("router weights torch.float32") == 10
    assert out.count("equal to the hand-written stack (outputs, gradients, parameters): True") == 5
    assert "the loss went down" in out


@pytest.mark.usefixtures("fresh_dynamo")
def test_advise_moe() -> None:
    out, _ = run_example_main("advise_moe.py")
    assert "policy: {'router': {'matmul': 'highest', 'cudnn_allow_tf32': False}}" in out
    assert "met (" in out
    assert "traced: router forward Fp32Precision(matmul='highest', cudnn_allow_tf32=False)" in out
    before, after = (float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.startswith("held-out error"))
    assert before > 2e-2  # the control: bf16 flips the router's choices on the held-out batch too
    assert after <= 2e-2


def _diffusers_imports() -> str | None:
    # diffusers 0.42 does not import on torch 2.4 (it uses torch.accelerator): why not, or None.
    try:
        import diffusers  # noqa: F401
    except Exception as error:
        return f"diffusers does not import with this torch: {type(error).__name__}: {error}"
    return None


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_flux_fullgraph() -> None:
    reason = _diffusers_imports()
    if reason is not None:
        pytest.skip(reason)
    out, _ = run_example_main("flux_fullgraph.py")
    full = "time_text_embed ran with Fp32Precision(matmul='highest', cudnn_allow_tf32=True)"
    assert out.count(full) == 3  # two compiled calls and the eager one
    assert "ran with Fp32Precision(matmul='high'," not in out
    assert "graphs: 1, graph breaks: 0" in out
    assert "process default after the calls: Fp32Precision(matmul='high', cudnn_allow_tf32=True)" in out


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_llama_attention_fullgraph() -> None:
    reason = gpt2_unavailable()  # transformers' models run on this torch (>= 2.6 for transformers 5)
    if reason is not None:
        pytest.skip(reason)
    out, _ = run_example_main("llama_attention_fullgraph.py")
    full = "ran with Fp32Precision(matmul='highest', cudnn_allow_tf32=True)"
    for layer in (0, 1):  # the compiled step and the eager one
        assert out.count(f"layer {layer} attention {full}") == 2
    assert "ran with Fp32Precision(matmul='high'," not in out
    assert "graphs: 1, graph breaks: 0" in out
    # To rounding: Inductor fuses the rest of the model (the norms, the MLPs) its own way.
    assert float(out.split("loss difference from the eager step: ")[1].split()[0]) < 1e-5
    assert float(out.split("largest gradient difference: ")[1].split()[0]) < 1e-5
    assert "process default after the steps: Fp32Precision(matmul='high', cudnn_allow_tf32=True)" in out
