"""Fp32ScopedModule: transparency, scoped calls, self-returning methods, copies, repr."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from fp32scope import Fp32Precision, Fp32ScopedModule, precision_of
from fp32scope._flags import torch_flags as _flags
from fp32scope._wrappers.proxy import SELF_RETURNING_METHODS
from tests._support.common import FULL


class Probe(torch.nn.Module):
    """Records the precision its forward ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros(()))
        self.seen: list[tuple[str, bool]] = []

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        self.seen.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32))
        out: torch.Tensor = self.linear(x) * scale
        return out


@pytest.fixture
def default_high() -> None:
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


@pytest.mark.usefixtures("default_high")
def test_call_and_forward_run_inside_the_scope() -> None:
    module = Probe()
    proxy = Fp32ScopedModule(module, FULL)
    before = _flags.read_all()
    proxy(torch.ones(1, 4))
    proxy.forward(torch.ones(1, 4), scale=2.0)
    module(torch.ones(1, 4))  # the bare module is not scoped
    assert module.seen == [("highest", False), ("highest", False), ("high", True)]
    assert _flags.read_all() == before


@pytest.mark.usefixtures("default_high")
def test_a_keyword_named_self_reaches_the_module() -> None:
    class TakesSelf(torch.nn.Module):
        def __call__(*args: object, **kwargs: object) -> dict[str, object]:
            return {"precision": torch.get_float32_matmul_precision(), **kwargs}

    proxy = Fp32ScopedModule(TakesSelf(), FULL)
    assert proxy(self=3) == {"precision": "highest", "self": 3}


def test_transparency() -> None:
    module = Probe()
    proxy = Fp32ScopedModule(module, FULL)
    assert isinstance(proxy, Probe)
    assert isinstance(proxy, torch.nn.Module)
    assert proxy.__wrapped__ is module
    assert proxy.linear is module.linear
    assert list(proxy.state_dict()) == list(module.state_dict()) == ["steps", "linear.weight", "linear.bias"]
    assert [p for p in proxy.parameters()] == [p for p in module.parameters()]
    assert [n for n, _ in proxy.named_modules()] == ["", "linear"]
    assert [n for n, _ in proxy.named_buffers()] == ["steps"]
    proxy.extra = 5  # type: ignore[assignment]  # attribute set reaches the module
    assert module.__dict__["extra"] == 5
    del proxy.extra
    assert not hasattr(module, "extra")
    other = Probe()
    proxy.load_state_dict(other.state_dict())
    assert torch.equal(module.linear.weight, other.linear.weight)


@pytest.mark.usefixtures("default_high")
def test_hooks_run_inside_the_scope() -> None:
    module = Probe()
    proxy = Fp32ScopedModule(module, FULL)
    seen: list[str] = []
    handle = proxy.register_forward_pre_hook(lambda m, args: seen.append(torch.get_float32_matmul_precision()))
    proxy(torch.ones(1, 4))
    handle.remove()
    proxy(torch.ones(1, 4))
    assert seen == ["highest"]


def test_self_returning_methods_return_the_proxy() -> None:
    proxy = Fp32ScopedModule(Probe(), FULL)
    assert proxy.to("cpu") is proxy
    assert proxy.to(torch.float64) is proxy
    assert proxy.linear.weight.dtype == torch.float64
    assert proxy.float().eval() is proxy
    assert proxy.training is False
    assert proxy.train() is proxy
    assert proxy.cpu() is proxy
    assert proxy.double() is proxy
    assert proxy.half() is proxy
    assert proxy.bfloat16() is proxy
    assert proxy.type(torch.float32) is proxy
    assert proxy.requires_grad_(False) is proxy
    assert proxy.apply(lambda m: None) is proxy
    assert proxy.share_memory() is proxy
    assert proxy.to_empty(device="cpu") is proxy
    model = proxy.to("cpu").eval()
    assert precision_of(model) == FULL


def test_the_list_of_self_returning_methods_is_every_one_torch_has() -> None:
    expected = {"to", "cpu", "eval", "train", "float", "half", "bfloat16", "double", "type", "requires_grad_", "apply"}
    assert expected | {"share_memory", "to_empty"} <= set(SELF_RETURNING_METHODS)
    module = Probe()
    for name in SELF_RETURNING_METHODS:
        if name in {"cuda", "xpu", "ipu", "mtia"}:
            continue  # need their devices
        method = getattr(module, name)
        args: tuple[object, ...] = {"to": ("cpu",), "type": (torch.float32,), "apply": (lambda m: None,)}.get(name, ())
        kwargs = {"device": "cpu"} if name == "to_empty" else {}
        assert method(*args, **kwargs) is module, f"torch's {name} no longer returns self"
        assert getattr(Fp32ScopedModule(module, FULL), name).__qualname__ == f"Fp32ScopedModule.{name}"


@pytest.mark.usefixtures("default_high")
@pytest.mark.parametrize(
    "roundtrip",
    [
        copy.copy,
        copy.deepcopy,
        lambda p: pickle.loads(pickle.dumps(p)),  # noqa: S301  (our own object)
        lambda p: _torch_roundtrip(p),  # noqa: PLW0108  (defined below)
    ],
    ids=["copy", "deepcopy", "pickle", "torch.save"],
)
def test_copies_keep_the_proxy_and_its_precision(roundtrip: object) -> None:
    module = Probe()
    proxy = Fp32ScopedModule(module, FULL, name="head")
    clone = roundtrip(proxy)  # type: ignore[operator]
    assert type(clone) is type(proxy)
    assert isinstance(clone, Fp32ScopedModule)
    assert precision_of(clone) == FULL
    assert clone._self_name == "head"
    assert torch.equal(clone.linear.weight, module.linear.weight)
    clone(torch.ones(1, 4))
    assert clone.__wrapped__.seen[-1] == ("highest", False)


def test_copy_copies_the_module_deepcopy_copies_parameters() -> None:
    proxy = Fp32ScopedModule(Probe(), FULL)
    shallow, deep = copy.copy(proxy), copy.deepcopy(proxy)
    assert shallow.__wrapped__ is not proxy.__wrapped__
    assert shallow.linear is proxy.linear
    assert deep.linear is not proxy.linear


def _torch_roundtrip(proxy: Fp32ScopedModule) -> Fp32ScopedModule:
    buffer = io.BytesIO()
    torch.save(proxy, buffer)
    buffer.seek(0)
    loaded: Fp32ScopedModule = torch.load(buffer, weights_only=False)
    return loaded


def test_repr_shows_precision_name_and_module() -> None:
    proxy = Fp32ScopedModule(torch.nn.Linear(2, 2), FULL, name="head")
    text = repr(proxy)
    assert "Fp32ScopedModule(precision=Fp32Precision(matmul='highest', cudnn_allow_tf32=False)" in text
    assert "name='head'" in text
    assert "Linear(in_features=2, out_features=2, bias=True)" in text


def test_precision_of() -> None:
    module = torch.nn.Linear(2, 2)
    assert precision_of(module) is None
    assert precision_of(Fp32ScopedModule(module, FULL)) == FULL
    assert precision_of(Fp32ScopedModule(module, None)) is None
    assert precision_of(len) is None


@pytest.mark.usefixtures("default_high")
def test_a_none_precision_adds_no_scope() -> None:
    module = Probe()
    Fp32ScopedModule(module, None)(torch.ones(1, 4))
    Fp32ScopedModule(module, Fp32Precision())(torch.ones(1, 4))
    assert module.seen == [("high", True)] * 2


@pytest.mark.usefixtures("default_high")
def test_forward_assignment_lands_on_the_wrapped_module() -> None:
    # What torch.cuda.make_graphed_callables does: module.forward = graphed. The proxy's
    # call must then run the new forward, inside the scope.
    module = Probe()
    # A graph-break proxy's ``forward``, read eagerly, is bound to the forward of that time
    # (an in-graph region's calls the wrapped module's forward as found at each call).
    proxy = Fp32ScopedModule(module, FULL, in_graph=False)
    original = proxy.forward
    calls: list[str] = []

    def replacement(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.get_float32_matmul_precision())
        out: torch.Tensor = original(x)
        return out

    proxy.forward = replacement
    assert module.forward is replacement
    proxy(torch.ones(1, 4))
    assert calls == ["highest"]
    assert module.seen == [("highest", False)]
    del proxy.forward
    proxy(torch.ones(1, 4))
    assert calls == ["highest"]
    assert len(module.seen) == 2


@pytest.mark.usefixtures("default_high")
def test_the_block_raising_restores_and_propagates() -> None:
    class Fails(torch.nn.Module):
        def forward(self) -> None:
            raise KeyboardInterrupt

    before = _flags.save_raw_state()
    with pytest.raises(KeyboardInterrupt):
        Fp32ScopedModule(Fails(), FULL)()
    assert _flags.save_raw_state() == before
