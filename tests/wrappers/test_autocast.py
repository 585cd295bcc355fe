"""Scoped nodes under torch.autocast: ``autocast=False`` runs them in float32, the default warns (issue 18).

The reference throughout is the same stack written by hand, as Hugging Face models and
torch's ``custom_fwd(cast_inputs=torch.float32)`` do it: inside the module, autocast
disabled and the inputs cast to float32, in the node's precision scope. Step by step, the
outputs, gradients and parameters of the wrapped stack must equal it exactly.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.backends.debugging import aot_eager

from fp32scope import (
    Fp32AutocastWarning,
    Fp32ParameterDtypeWarning,
    Fp32Precision,
    Fp32ScopedModule,
    _compat,
    fp32_precision_scope,
    with_fp32_precision,
)
from fp32scope._tools.doctor import environment_overrides
from fp32scope._wrappers import autocast as _autocast
from fp32scope._wrappers import decorator as _decorator
from fp32scope._wrappers import proxy as _proxy
from tests._support.autocast_model import BF16, STEPS, HandRouter, Router, pair, train
from tests._support.common import FULL, ROOT, run_module
from tests._support.compiled import node_graphs


def autocast_state() -> tuple[bool, torch.dtype, bool]:
    """What torch.autocast keeps for the CPU on this thread (and its weight cache switch)."""
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()


def assert_same_steps(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert len(a) == len(b), step
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert u.dtype == v.dtype, (step, i)
            assert torch.equal(u, v), (step, i, (u.double() - v.double()).abs().max().item())


# -- forward: float32 under autocast, and the caller's autocast back -----------------------


def test_autocast_false_computes_in_float32_under_bf16_autocast() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    exact = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    with fp32_precision_scope(FULL):
        float32 = lin(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Fp32AutocastWarning)
        with torch.autocast("cpu", dtype=BF16):
            kept = Fp32ScopedModule(lin, FULL)(x)
            off = Fp32ScopedModule(lin, FULL, autocast=False)(x)
    assert kept.dtype == BF16
    assert (kept.double() - exact).abs().max() > 1e-3  # what autocast does to the node otherwise
    assert off.dtype == torch.float32
    assert torch.equal(off, float32)
    assert (off.double() - exact).abs().max() < 1e-5


def test_caller_autocast_is_back_after_the_call_and_after_an_error() -> None:
    seen: list[tuple[bool, torch.dtype, bool]] = []

    @with_fp32_precision(FULL, autocast=False)
    def node(fail: bool) -> None:
        seen.append(autocast_state())
        if fail:
            msg = "node failed"
            raise ValueError(msg)

    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        before = autocast_state()
        node(False)
        assert autocast_state() == before
        with pytest.raises(ValueError, match="node failed"):
            node(True)
        assert autocast_state() == before
    assert seen == [(False, torch.float16, False)] * 2
    assert not torch.is_autocast_enabled("cpu")


def test_outside_autocast_nothing_is_cast() -> None:
    received: list[torch.Tensor] = []

    @with_fp32_precision(FULL, autocast=False)
    def node(x: torch.Tensor) -> torch.Tensor:
        received.append(x)
        return x

    x = torch.ones(2, dtype=BF16)
    assert node(x) is x
    assert received[0] is x


class Pair(NamedTuple):
    a: torch.Tensor
    b: object


def test_floating_arguments_are_cast_also_inside_containers() -> None:
    received: list[Any] = []

    @with_fp32_precision(None, autocast=False)
    def node(*args: Any, **kwargs: Any) -> None:
        received.append((args, kwargs))

    half = torch.ones(2, dtype=BF16)
    ints = torch.ones(2, dtype=torch.int64)
    double = torch.ones(2, dtype=torch.float64)
    with torch.autocast("cpu", dtype=BF16):
        node(half, [half, ints], (double, "s"), Pair(half, 3), {"k": half, "n": [half]}, scale=2.0, w=half)
    (x, lst, tup, pair_, dct), kwargs = received[0]
    assert x.dtype == torch.float32
    assert [t.dtype for t in lst] == [torch.float32, torch.int64]
    assert isinstance(tup, tuple)
    assert tup[0] is double
    assert tup[1] == "s"
    assert isinstance(pair_, Pair)
    assert pair_.a.dtype == torch.float32
    assert pair_.b == 3
    assert dct["k"].dtype == torch.float32
    assert dct["n"][0].dtype == torch.float32
    assert kwargs["scale"] == 2.0
    assert kwargs["w"].dtype == torch.float32


def test_autocast_inside_the_node_still_works() -> None:
    seen: list[bool] = []

    @with_fp32_precision(FULL, autocast=False)
    def node(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        with torch.autocast("cpu", dtype=BF16):
            seen.append(torch.is_autocast_enabled("cpu"))
            y = x @ x
        seen.append(torch.is_autocast_enabled("cpu"))
        return y

    with torch.autocast("cpu", dtype=BF16):
        assert node(torch.ones(2, 2)).dtype == BF16
        assert torch.is_autocast_enabled("cpu")
    assert seen == [False, True, False]


@settings(max_examples=40, deadline=None)
@given(
    outer=st.sampled_from([None, torch.bfloat16, torch.float16]),
    cache=st.booleans(),
    mode=st.sampled_from([False, True, None]),
    fail=st.booleans(),
    via_forward=st.booleans(),
)
def test_autocast_state_inside_and_after_any_call(
    outer: torch.dtype | None, cache: bool, mode: bool | None, fail: bool, via_forward: bool
) -> None:
    """Inside: autocast on exactly when the caller's is and the node keeps it. After: as before."""
    module = Router()
    proxy = Fp32ScopedModule(module, Fp32Precision("high"), autocast=mode)
    call = proxy.forward if via_forward else proxy
    x = torch.ones(2, 16) if not fail else torch.ones(2, 3)  # a wrong width raises inside the node
    region = (
        torch.autocast("cpu", dtype=outer, cache_enabled=cache)
        if outer is not None
        else torch.autocast("cpu", enabled=False)
    )
    with region:
        before = autocast_state()
        if fail:
            with pytest.raises(RuntimeError):
                call(x)
        else:
            out = call(x)
            assert out.dtype == (outer if outer is not None and mode is not False else torch.float32)
        assert autocast_state() == before
    enabled, _, _ = module.seen[0]
    assert enabled is (outer is not None and mode is not False)
    assert module.seen[0][1] == torch.float32


# -- forward and backward against the hand-written stack ------------------------------------


def test_training_matches_the_hand_written_stack_step_by_step() -> None:
    wrapped, hand = pair()
    expected = train(hand)
    got = train(wrapped)
    assert_same_steps(got, expected)
    router = wrapped.router.__wrapped__
    assert isinstance(router, Router)
    assert router.seen == [(False, torch.float32, FULL)] * STEPS


def test_gradients_equal_a_float32_reference_of_the_node() -> None:
    # The rest of the model under autocast, the node in float32: the node's gradients are
    # those of its float32 computation on the (cast) input it received.
    torch.manual_seed(0)
    router = Router()
    node = Fp32ScopedModule(router, FULL, autocast=False)
    h = torch.randn(8, 16).to(BF16).requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        out = node(h)
    out.square().sum().backward()
    reference = Router()
    reference.load_state_dict(router.state_dict())
    h32 = h.detach().float().requires_grad_()
    with fp32_precision_scope(FULL):
        reference(h32).square().sum().backward()
    assert h.grad is not None
    assert h32.grad is not None
    assert h.grad.dtype == BF16
    assert torch.equal(h.grad, h32.grad.to(BF16))
    for p, q in zip(router.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None
        assert q.grad is not None
        assert torch.equal(p.grad, q.grad)


def test_decorated_function_matches_the_hand_written_stack() -> None:
    torch.manual_seed(0)
    pre = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    x = torch.randn(8, 16)

    def gate(h: torch.Tensor) -> torch.Tensor:
        return (h @ w).softmax(-1)

    def by_hand(h: torch.Tensor) -> torch.Tensor:
        with fp32_precision_scope(FULL), torch.autocast("cpu", enabled=False):
            return gate(h.float())

    results = []
    for fn in (with_fp32_precision(FULL, autocast=False)(gate), by_hand):
        with torch.autocast("cpu", dtype=BF16):
            out = fn(torch.tanh(x @ pre))
        torch.autograd.backward(out.square().sum())
        assert w.grad is not None
        assert pre.grad is not None
        results.append((out.detach(), w.grad.clone(), pre.grad.clone()))
        w.grad = pre.grad = None
    assert results[0][0].dtype == torch.float32
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)


def test_activation_checkpointing_matches_the_hand_written_stack() -> None:
    wrapped, hand = pair(use_checkpoint=True)
    expected = train(hand)
    got = train(wrapped)
    assert_same_steps(got, expected)
    # The recomputation in the backward ran without autocast too.
    router = wrapped.router.__wrapped__
    assert isinstance(router, Router)
    assert [seen[:2] for seen in router.seen] == [(False, torch.float32)] * (2 * STEPS)


def test_forward_attribute_runs_without_autocast() -> None:
    wrapped, hand = pair()
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=BF16):
        got = wrapped.router.forward(torch.tanh(wrapped.pre(x)))
        expected = hand.router(torch.tanh(hand.pre(x)))
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


# -- the default: warn once for a full-float32 node -----------------------------------------


def calls_under_autocast(node: Callable[..., Any], times: int = 2) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=BF16), torch.no_grad():
            for _ in range(times):
                node(torch.ones(2, 16))
    return [w for w in caught if issubclass(w.category, Fp32AutocastWarning)]


def test_default_warns_once_per_node_that_asks_for_full_float32() -> None:
    router = Router()
    caught = calls_under_autocast(Fp32ScopedModule(router, FULL, name="router"))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'router'" in message
    assert "cpu (torch.bfloat16)" in message
    assert "autocast=False" in message
    assert "autocast=True" in message
    assert caught[0].filename == __file__
    # Once per wrapper: another wrapper of the same module warns again.
    assert len(calls_under_autocast(Fp32ScopedModule(router, FULL, name="router"))) == 1
    assert len(calls_under_autocast(Fp32ScopedModule(router, Fp32Precision(None, cudnn_allow_tf32=False)))) == 1
    assert len(calls_under_autocast(with_fp32_precision(FULL)(router.forward))) == 1


@pytest.mark.parametrize(
    ("precision", "autocast"),
    [
        (Fp32Precision("high", False), True),
        (FULL, True),
        (Fp32Precision("high", True), None),
        (Fp32Precision("medium"), None),
        (Fp32Precision(None, cudnn_allow_tf32=True), None),
        (FULL, False),
    ],
)
def test_no_warning_for_reduced_precision_or_an_explicit_choice(
    precision: Fp32Precision, autocast: bool | None
) -> None:
    assert calls_under_autocast(Fp32ScopedModule(Router(), precision, autocast=autocast)) == []


def test_no_warning_outside_autocast() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp32AutocastWarning)
        Fp32ScopedModule(Router(), FULL)(torch.ones(2, 16))


@pytest.mark.parametrize("precision", [Fp32Precision("high"), FULL], ids=["high", "highest"])
def test_a_node_called_twice_in_one_autocast_region_trains_like_the_bare_node_without_a_warning(
    precision: Fp32Precision,
) -> None:
    # The second call gets autocast's cached bf16 weight, made (with its ToCopy node) by the
    # first: a tensor from before the call that the node did not get as an argument, which
    # is not a closure over an activation and must not be warned about as one.
    torch.manual_seed(0)
    bare = torch.nn.Linear(16, 16)
    wrapped = copy.deepcopy(bare)
    node = Fp32ScopedModule(wrapped, precision, autocast=True)
    x = torch.randn(4, 16)
    for _ in range(2):  # the cache is emptied when the region ends: a second region too
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for module, net in ((bare, bare), (wrapped, node)):
                with torch.autocast("cpu", dtype=BF16):
                    y = net(x) * net(x + 1)
                y.float().square().sum().backward()
                assert module.weight.grad is not None
        assert wrapped.weight.grad is not None
        assert bare.weight.grad is not None
        # The two calls' parts reach the weight through the one cached cast: the bare engine
        # sums them in bf16 before the cast back, the scoped node in float32 after it.
        torch.testing.assert_close(wrapped.weight.grad, bare.weight.grad, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(wrapped.bias.grad, bare.bias.grad, rtol=1e-2, atol=1e-2)


# -- a node whose parameters are not float32 (FSDP2's param_dtype, or a cast) ----------------
# FSDP2 itself: tests/training/test_sharded.py (the unit's policy, and bf16 parameters of a
# node inside a bf16 unit).


def parameter_warnings(node: Any, x: torch.Tensor, calls: int = 2) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            node(x)
    return [w for w in caught if issubclass(w.category, Fp32ParameterDtypeWarning)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_node_with_reduced_precision_parameters_warns_once(dtype: torch.dtype) -> None:
    router = Router().to(dtype)
    caught = parameter_warnings(Fp32ScopedModule(router, FULL, name="router"), torch.ones(2, 16, dtype=dtype))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"Scoped node 'router' asks for full float32 ({FULL}) but its parameter 'lin.weight'")
    assert f"its matmuls run in {dtype}" in message
    assert "fully_shard(node, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))" in message
    assert caught[0].filename == __file__
    # Per wrapper, as the autocast warning: another wrapper of the module warns again.
    assert len(parameter_warnings(Fp32ScopedModule(router, FULL), torch.ones(2, 16, dtype=dtype))) == 1


def test_the_warning_comes_before_the_dtype_error_of_autocast_false() -> None:
    node = Fp32ScopedModule(Router().to(BF16), FULL, name="router", autocast=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=BF16), pytest.raises(RuntimeError, match="same dtype"):
            node(torch.ones(2, 16))
    assert [w.category for w in caught] == [Fp32ParameterDtypeWarning]


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        (FULL, torch.float32),
        (FULL, torch.float64),
        (Fp32Precision("high", True), torch.bfloat16),
        (Fp32Precision("medium"), torch.bfloat16),
        (None, torch.bfloat16),
    ],
)
def test_no_parameter_warning_for_float32_parameters_or_reduced_precision(
    precision: Fp32Precision | None, dtype: torch.dtype
) -> None:
    node = Fp32ScopedModule(Router().to(dtype), precision)
    assert parameter_warnings(node, torch.ones(2, 16, dtype=dtype)) == []


def test_parameters_are_checked_at_the_first_call_only() -> None:
    # The check costs one attribute read after the first call; what changes later is not seen.
    router = Router()
    node = Fp32ScopedModule(router, FULL)
    assert parameter_warnings(node, torch.ones(2, 16), calls=1) == []
    router.to(BF16)
    assert parameter_warnings(node, torch.ones(2, 16, dtype=BF16)) == []


# -- arguments and declarations ---------------------------------------------------------


@pytest.mark.parametrize("value", ["no", 0, 1, "False", torch.bfloat16])
def test_bad_autocast_values_are_refused(value: object) -> None:
    with pytest.raises(TypeError, match=r"^autocast must be False .* True .* or None .*got") as info:
        Fp32ScopedModule(Router(), FULL, autocast=value)  # type: ignore[arg-type]
    assert repr(value) in str(info.value)
    with pytest.raises(TypeError, match=r"^autocast must be False"):
        with_fp32_precision(FULL, autocast=value)  # type: ignore[arg-type]


class Declared(Router):
    autocast = False


class BadlyDeclared(Router):
    autocast = "off"


def test_a_module_declares_autocast_false() -> None:
    node = Fp32ScopedModule(Declared(), FULL)
    with torch.autocast("cpu", dtype=BF16):
        assert node(torch.ones(2, 16)).dtype == torch.float32
        # The argument overrides the declaration.
        assert Fp32ScopedModule(Declared(), FULL, autocast=True)(torch.ones(2, 16)).dtype == BF16
    # Through the decorator too, also without a precision (then only autocast is changed).
    assert isinstance(with_fp32_precision(None)(Declared()), Fp32ScopedModule)
    plain = Router()
    assert with_fp32_precision(None)(plain) is plain
    with torch.autocast("cpu", dtype=BF16):
        assert with_fp32_precision(None)(Declared())(torch.ones(2, 16)).dtype == torch.float32


def test_a_bad_declaration_names_the_node_and_the_attribute() -> None:
    with pytest.raises(TypeError, match=r"^autocast of node 'router' must be False .*got 'off' of type str"):
        Fp32ScopedModule(BadlyDeclared(), FULL, name="router")


def test_copies_and_pickles_keep_autocast() -> None:
    node = Fp32ScopedModule(Router(), FULL, autocast=False)
    buffer = io.BytesIO()
    torch.save(node, buffer)
    buffer.seek(0)
    copies = [
        copy.copy(node),
        copy.deepcopy(node),
        pickle.loads(pickle.dumps(node)),  # noqa: S301
        torch.load(buffer, weights_only=False),
    ]
    for other in copies:
        assert other._self_autocast.mode is False
        with torch.autocast("cpu", dtype=BF16):
            assert other(torch.ones(2, 16)).dtype == torch.float32
    assert "autocast=False" in repr(node)


# -- composition: compiled, exported, distributed ---------------------------------------


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("in_graph", [False, None], ids=["graph-break", "region"])
def test_scoped_child_of_a_compiled_parent_matches_the_eager_hand_written_stack(in_graph: bool | None) -> None:
    # The parent compiles under the caller's autocast; the child is an in-graph region (the
    # default) run with autocast off, or graph-breaks out and its own graph compiles (and
    # runs) with autocast off. The reference is the eager stack: torch 2.13 compiles the
    # hand-written stack's backward of the autocast-off region under the caller's autocast
    # (its router weight gradient comes out in bf16 precision).
    wrapped, hand = pair(record=False, in_graph=in_graph)
    expected = train(hand)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        return aot_eager(gm, inputs)

    compiled = torch.compile(wrapped, backend=backend)
    got = train(wrapped, compiled)
    assert_same_steps(got, expected)
    codes = [gm.code for gm in graphs]
    if in_graph is None:  # one graph, compiled once, holding the router as one region
        # (and the router's own, compiled by the same backend in its op, once)
        assert len(codes) == 1 + node_graphs(backend), codes
        assert "region_call" in codes[0], codes
        return
    # Compiled once (no recompiles on later steps): the parent around the router, and the
    # router as a graph of its own.
    assert len(codes) == 3, codes
    # The router's Linear: inlined as its parameter (torch >= 2.5), a call_module before.
    assert sum("modules_lin_parameters_weight" in code or "L__fn___lin(" in code for code in codes) == 1, codes


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_node_matches_the_eager_hand_written_stack() -> None:
    wrapped, hand = pair(record=False)
    router = wrapped.router.__wrapped__
    assert isinstance(router, Router)
    wrapped.router = Fp32ScopedModule(torch.compile(router, backend="aot_eager"), FULL, autocast=False)  # type: ignore[assignment]
    assert_same_steps(train(wrapped), train(hand))


@pytest.mark.skipif(
    not _compat.EXPORT_HOLDS_AUTOCAST_REGIONS,
    reason=f"torch {_compat.TORCH_RELEASE} cannot export an autocast region (no wrap_with_autocast; torch >= 2.5)",
)
def test_export_under_autocast_holds_an_autocast_off_region() -> None:
    # A node without a precision exports (one with a precision is exported bare and saved
    # with it, see the export guide): the program holds the autocast-off region, as the
    # hand-written stack's does, so it runs in float32 under a caller's autocast too.
    torch.manual_seed(0)
    router = Router()
    router.record = False  # torch 2.8's export fails a forward that grows a list attribute ("Node arity mismatch")
    hand = HandRouter()
    hand.load_state_dict(router.state_dict())
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=BF16):
        node: torch.nn.Module = Fp32ScopedModule(router, None, autocast=False)  # type: ignore[assignment]
        program = torch.export.export(node, (x,))
        bare = torch.export.export(router, (x,))
    assert "wrap_with_autocast" in program.graph_module.code
    assert "wrap_with_autocast" not in bare.graph_module.code
    with torch.autocast("cpu", dtype=BF16):
        got = program.module()(x)
        expected = hand(x)
        assert bare.module()(x).dtype == BF16  # the bare node's program: autocast applies again
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over a file store: Linux and macOS")
def test_ddp_matches_the_hand_written_stack() -> None:
    proc = run_module("tests._support.autocast_ddp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("step equal to the hand-written stack") == STEPS, proc.stdout


# -- the TF32 overrides ---------------------------------------------------------------------


def test_cublas_override_message() -> None:
    on = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}
    message = _autocast.cublas_override_message(FULL, on, True, "head")
    assert message is not None
    assert "'head'" in message
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in message
    assert "TF32" in message
    assert _autocast.cublas_override_message(FULL, on, False, "head") is None
    assert _autocast.cublas_override_message(Fp32Precision("high"), on, True, "head") is None
    assert _autocast.cublas_override_message(Fp32Precision(None, False), on, True, "head") is None
    for value in ("0", "", "true"):
        environ = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": value}
        assert _autocast.cublas_override_message(FULL, environ, True, "head") is None


def test_one_warning_per_process_for_a_full_float32_node_under_the_cublas_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This machine has no CUDA: what torch.cuda.is_available() answers is the one stand-in.
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    monkeypatch.setattr(_autocast, "_warned_override", [])
    monkeypatch.setattr(_autocast, "_cuda_available", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Fp32ScopedModule(Router(), Fp32Precision("high"))
        Fp32ScopedModule(Router(), FULL, name="router")
        with_fp32_precision(FULL)(len)
        Fp32ScopedModule(Router(), FULL)
    found = [w for w in caught if "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in str(w.message)]
    assert len(found) == 1
    assert found[0].category is RuntimeWarning
    assert "'router'" in str(found[0].message)
    monkeypatch.setattr(_autocast, "_warned_override", [])
    monkeypatch.setattr(_autocast, "_cuda_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Fp32ScopedModule(Router(), FULL)


def test_the_cublas_override_makes_a_fresh_process_read_high() -> None:
    env = {**os.environ, "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}
    code = "import torch; print(torch.get_float32_matmul_precision())"
    proc = subprocess.run(  # noqa: S603
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == "high"


def test_doctor_names_the_overrides() -> None:
    assert environment_overrides({}) == ()
    assert environment_overrides({"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0", "NVIDIA_TF32_OVERRIDE": "1"}) == ()
    found = environment_overrides({"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1", "NVIDIA_TF32_OVERRIDE": "0"})
    assert len(found) == 2
    assert found[0].startswith("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1: ")
    assert "'highest' runs its CUDA matmuls in TF32" in found[0]
    assert found[1].startswith("NVIDIA_TF32_OVERRIDE=0: ")
    assert "never use TF32" in found[1]


@pytest.mark.parametrize("variable", ["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1", "NVIDIA_TF32_OVERRIDE=0"])
def test_doctor_exits_1_on_an_override(variable: str) -> None:
    name, value = variable.split("=")
    env = {**os.environ, name: value, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "fp32scope", "doctor"], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "TF32 OVERRIDDEN by the environment: 1 variable(s):" in proc.stdout
    assert f"  - {variable}: " in proc.stdout


def test_only_a_policy_with_something_to_do_asks_whether_autocast_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # The docs: outside autocast the read is the wrapper's one cost, and only while its policy
    # has something to do under autocast. Counted on the wrappers' own binding of torch's call.
    reads: list[bool] = []

    def counted() -> bool:
        reads.append(True)
        return _autocast.any_autocast()

    monkeypatch.setattr(_proxy, "any_autocast", counted)
    monkeypatch.setattr(_decorator, "any_autocast", counted)
    x = torch.randn(2, 4)
    keep = Fp32ScopedModule(torch.nn.Linear(4, 4), FULL, autocast=True)
    high = with_fp32_precision(Fp32Precision("high"))(torch.nn.functional.relu)
    with torch.no_grad():
        keep(x)
        keep.forward(x)
        high(x)
    assert reads == []
    full = Fp32ScopedModule(torch.nn.Linear(4, 4), FULL)  # warns once under autocast
    with torch.no_grad():
        full(x)
        assert len(reads) == 1
        with torch.autocast("cpu", torch.bfloat16), pytest.warns(Fp32AutocastWarning):
            full(x)
        assert len(reads) == 2
        full(x)  # warned: nothing left to do under autocast
        full.forward(x)
    assert len(reads) == 2
