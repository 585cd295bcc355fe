"""scope_modules, unscope_modules, scoped_modules: scoping a model one did not write (issue 19)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    precision_of,
    scope_modules,
    scoped_modules,
    set_process_default,
    unscope_modules,
)
from fp32scope._flags.precision import MATMUL_PRECISIONS
from fp32scope._wrappers.policy import _walk
from tests._support.common import DEFAULT, FULL
from tests._support.compiled import WIDTH, Recording, check_dynamo_never_failed_in_the_package, run
from tests._support.hf import tiny_gpt2 as _gpt2

HIGHEST = Fp32Precision("highest")
SEEN: list[tuple[str, str]] = []


class Probe(torch.nn.Linear):
    """A Linear that notes, per call, its qualified label and the matmul precision it ran with."""

    def __init__(self, label: str) -> None:
        super().__init__(4, 4)
        self.label = label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append((self.label, torch.get_float32_matmul_precision()))
        return super().forward(x)


class Block(torch.nn.Module):
    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label
        self.attn = Probe(f"{label}.attn")
        self.mlp = torch.nn.Sequential(Probe(f"{label}.mlp.0"), torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append((self.label, torch.get_float32_matmul_precision()))
        out: torch.Tensor = self.mlp(self.attn(x))
        return out


class Head(Probe):
    float32_matmul_precision = "highest"
    cudnn_allow_tf32 = False


class Model(torch.nn.Module):
    """embed -> layers (ModuleList of Blocks) -> heads (ModuleDict) : a tree with every container."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = Probe("embed")
        self.layers = torch.nn.ModuleList([Block("layers.0"), Block("layers.1")])
        self.heads = torch.nn.ModuleDict({"out": Head("heads.out")})
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        out: torch.Tensor = self.heads["out"](h) * self.scale
        return out


@pytest.fixture(autouse=True)
def default_high() -> Iterator[None]:
    set_process_default(DEFAULT)
    SEEN.clear()
    yield
    SEEN.clear()


def tree(model: torch.nn.Module) -> list[tuple[str, int]]:
    """Every slot of the model and the object in it: the structure, identity included."""
    return [(slot.name, id(slot.stored)) for slot in _walk(model)]


def ran(model: torch.nn.Module) -> dict[str, str]:
    SEEN.clear()
    model(torch.randn(2, 4))
    return dict(SEEN)


# -- selectors ---------------------------------------------------------------------------------


def test_each_kind_of_selector_scopes_what_it_selects() -> None:
    model = Model()
    got = scope_modules(
        model,
        {
            "embed": "highest",
            r"re:layers\.\d+\.attn": "medium",
            Block: {"matmul": "highest", "cudnn_allow_tf32": False},
            lambda name, module: name == "heads.out": HIGHEST,
        },
    )
    assert got == {
        "embed": HIGHEST,
        "layers.0": FULL,
        "layers.0.attn": Fp32Precision("medium"),
        "layers.1": FULL,
        "layers.1.attn": Fp32Precision("medium"),
        "heads.out": HIGHEST,
    }
    assert ran(model) == {
        "embed": "highest",
        "layers.0": "highest",
        "layers.1": "highest",
        "layers.0.attn": "medium",
        "layers.0.mlp.0": "highest",  # inside its block's scope
        "layers.1.attn": "medium",
        "layers.1.mlp.0": "highest",
        "heads.out": "highest",
    }
    assert torch.get_float32_matmul_precision() == "high"


def test_a_pattern_must_match_the_whole_name() -> None:
    model = Model()
    with pytest.raises(ValueError, match=re.escape("policy selector(s) 're:layer' match no submodule")):
        scope_modules(model, {"re:layer": "highest", "re:layers.0": "highest"})
    assert scope_modules(model, {"re:layers.0": "highest"}) == {"layers.0": HIGHEST}


def test_a_name_selects_only_that_module_not_one_ending_in_it() -> None:
    model = Model()
    with pytest.raises(ValueError, match=re.escape("'attn' match no submodule")):
        scope_modules(model, {"attn": "highest"})


def test_the_callable_gets_the_qualified_name_and_the_module() -> None:
    model = Model()
    calls: list[tuple[str, type]] = []

    def select(name: str, module: torch.nn.Module) -> bool:
        calls.append((name, type(module)))
        return name == "embed"

    scope_modules(model, {select: "highest"})
    assert [name for name, _ in calls] == ["", *(name for name, _ in model.named_modules() if name)]
    assert dict(calls)["layers.0"] is Block


def test_precedence_exact_then_pattern_then_class_then_callable() -> None:
    model = Model()
    always: Callable[[str, torch.nn.Module], bool] = lambda name, module: name.endswith("attn")  # noqa: E731
    got = scope_modules(
        model,
        {
            always: "medium",
            Probe: "high",
            r"re:.*\.attn": FULL,
            "layers.1.attn": "highest",
        },
    )
    assert got["layers.1.attn"] == HIGHEST  # exact beats the rest
    assert got["layers.0.attn"] == FULL  # the pattern beats class and callable
    assert got["embed"] == Fp32Precision("high")  # class; the callable does not select it


def test_within_a_kind_the_first_in_the_mapping_decides() -> None:
    model = Model()
    got = scope_modules(model, {"re:layers\\.0.*attn": "medium", "re:.*attn": "highest", Head: "high", Probe: FULL})
    assert got["layers.0.attn"] == Fp32Precision("medium")
    assert got["layers.1.attn"] == HIGHEST
    assert got["heads.out"] == Fp32Precision("high")
    assert got["embed"] == FULL


def test_none_excludes_a_module_from_a_broader_selector() -> None:
    model = Model()
    got = scope_modules(model, {Probe: "highest", "layers.1.attn": None, "embed": {}})
    assert "layers.1.attn" not in got
    assert "embed" not in got
    assert "layers.0.attn" in got
    assert not isinstance(model.layers[1].attn, Fp32ScopedModule)


# A model of the rule: which selectors match, and which one decides.


def _selector_model(kind: str, value: Any, key: Any) -> Callable[[str, torch.nn.Module], bool]:
    """Whether the selector of ``kind`` (written ``value``) matches a (name, module)."""
    if kind == "name":
        return lambda name, _module: name == value
    if kind == "re":
        return lambda name, _module: re.fullmatch(value, name) is not None
    if kind == "class":
        return lambda _name, module: isinstance(module, value)
    return cast("Callable[[str, torch.nn.Module], bool]", key)


NAMES = ["embed", "layers", "layers.0", "layers.0.attn", "layers.0.mlp", "layers.0.mlp.0", "heads.out"]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                ("name", "layers.0.attn"),
                ("name", "embed"),
                ("re", r"layers\.0.*"),
                ("re", r".*attn"),
                ("re", r".*"),
                ("class", Probe),
                ("class", Block),
                ("callable", "ends-0"),
                ("callable", "has-mlp"),
            ]
        ),
        min_size=1,
        max_size=5,
        unique=True,
    ),
    st.data(),
)
def test_precedence_property(selectors: list[tuple[str, Any]], data: st.DataObject) -> None:
    model = Model()
    predicates = {"ends-0": lambda n, m: n.endswith("0"), "has-mlp": lambda n, m: "mlp" in n}
    words = ["highest", "high", "medium"]
    policy: dict[Any, str] = {}
    kinds: list[tuple[str, Callable[[str, torch.nn.Module], bool], str]] = []
    for kind, value in selectors:
        word = data.draw(st.sampled_from(words))
        key: Any = {"name": value, "re": f"re:{value}", "class": value}.get(kind) or predicates[value]
        test = _selector_model(kind, value, key)
        policy[key] = word
        kinds.append((kind, test, word))
    modules = dict(model.named_modules())
    order = ["name", "re", "class", "callable"]
    expected: dict[str, str] = {}
    for name, module in modules.items():
        if not name:
            continue
        hits = [(order.index(k), i, w) for i, (k, t, w) in enumerate(kinds) if t(name, module)]
        if hits:
            expected[name] = min(hits)[2]
    root_hit = any(t("", model) for _, t, _ in kinds)
    unmatched = not root_hit and any(not any(t(n, m) for n, m in modules.items() if n) for _, t, _ in kinds)
    before = tree(model)
    if root_hit:
        with pytest.raises(ValueError, match="root module"):
            scope_modules(model, policy)
    elif unmatched:
        with pytest.raises(ValueError, match="match no submodule"):
            scope_modules(model, policy)
    else:
        got = scope_modules(model, policy)
        assert {n: p.matmul for n, p in got.items()} == expected
        assert scoped_modules(model) == got
        unscope_modules(model)
    assert tree(model) == before


# -- precisions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (FULL, FULL),
        ("medium", Fp32Precision("medium")),
        ({"matmul": "highest"}, HIGHEST),
        ({"cudnn_allow_tf32": False}, Fp32Precision(None, False)),
        ({"matmul": "high", "cudnn_allow_tf32": True}, Fp32Precision("high", True)),
    ],
)
def test_a_precision_may_be_written_three_ways(value: object, expected: Fp32Precision) -> None:
    model = Model()
    assert scope_modules(model, {"embed": value}) == {"embed": expected}
    assert precision_of(model.embed) == expected


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            "HIGHEST",
            ValueError,
            f"policy['embed'] must be one of {', '.join(map(repr, MATMUL_PRECISIONS))} or None; got 'HIGHEST'",
        ),
        ("tf32", ValueError, "for 'tf32' write 'high'"),
        ({"matmul": "highest", "cudnn": False}, ValueError, "policy['embed'] has unknown key(s) 'cudnn'"),
        ({"matmul": 1}, TypeError, "policy['embed']['matmul'] must be a str"),
        ({"cudnn_allow_tf32": "no"}, TypeError, "policy['embed']['cudnn_allow_tf32'] must be True, False or None"),
        (3, TypeError, "policy['embed'] must be an fp32scope.Fp32Precision, a matmul precision"),
        (("highest", None), TypeError, "policy['embed'] must be an fp32scope.Fp32Precision"),
        (Fp32Precision("fast"), ValueError, "policy['embed'].matmul must be one of"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_precision_is_named_and_nothing_changes(value: object, error: type[Exception], message: str) -> None:
    model = Model()
    before = tree(model)
    with pytest.raises(error, match=re.escape(message)):
        scope_modules(model, {"layers.0": "highest", "embed": value})
    assert tree(model) == before


@pytest.mark.parametrize(
    ("selector", "error", "message"),
    [
        (3, TypeError, "policy selector 3 of type int is not a selector"),
        (int, TypeError, "policy selector builtins.int is a class but not a torch.nn.Module subclass"),
        ("re:layers[", ValueError, "policy selector 're:layers[' is not a valid regular expression"),
        ("nope", ValueError, "policy selector(s) 'nope' match no submodule of Model"),
        ("re:nope.*", ValueError, "policy selector(s) 're:nope.*' match no submodule"),
        (torch.nn.Conv2d, ValueError, "torch.nn.modules.conv.Conv2d match no submodule"),
    ],
)
def test_a_bad_selector_is_named_and_nothing_changes(selector: object, error: type[Exception], message: str) -> None:
    model = Model()
    before = tree(model)
    with pytest.raises(error, match=re.escape(message)):
        scope_modules(model, {"layers.0": "highest", selector: "highest"})
    assert tree(model) == before


def test_a_callable_must_answer_true_or_false() -> None:
    model = Model()
    before = tree(model)
    with pytest.raises(TypeError, match=re.escape("must return True or False; for module '' it returned 'yes'")):
        scope_modules(model, {lambda name, module: "yes": "highest"})
    assert tree(model) == before


def test_policy_and_keywords_are_checked() -> None:
    model = Model()
    with pytest.raises(TypeError, match=re.escape("policy must be a mapping from selectors to precisions, or None")):
        scope_modules(model, ["embed"])  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=re.escape("autocast must be False (run the node without the caller's torch.autocast")
    ):
        scope_modules(model, {"embed": "highest"}, autocast="on")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("backward must be True")):
        scope_modules(model, {"embed": "highest"}, backward=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("model must be a torch.nn.Module")):
        scope_modules(lambda x: x, {"embed": "highest"})  # type: ignore[arg-type]
    assert scoped_modules(model) == {}


def test_autocast_none_and_backward_reach_the_wrappers() -> None:
    model = Model()
    scope_modules(model, {"embed": "highest", "layers.0": "highest"}, autocast=None, backward=False)
    assert isinstance(model.embed, Fp32ScopedModule)
    assert model.embed._self_backward is False
    assert model.embed._self_name == "embed"
    assert model.layers[0]._self_name == "layers.0"


def test_autocast_false_reaches_the_wrappers() -> None:
    model = Model()
    scope_modules(model, {"embed": "highest"}, autocast=False)
    x = torch.randn(2, 4)
    node = model.embed
    assert isinstance(node, Fp32ScopedModule)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert node(x).dtype == torch.float32  # the node ran without the caller's autocast
        assert node.__wrapped__(x).dtype == torch.bfloat16  # the bare module does not


# -- declarations (policy=None) ----------------------------------------------------------------


def test_no_policy_scopes_what_declares_a_precision() -> None:
    model = Model()
    assert scope_modules(model) == {"heads.out": FULL}
    assert ran(model)["heads.out"] == "highest"
    assert ran(model)["embed"] == "high"


def test_a_bad_declaration_is_named_and_nothing_changes() -> None:
    model: Any = Model()
    model.layers[1].attn.float32_matmul_precision = "fp32"
    before = tree(model)
    with pytest.raises(ValueError, match=re.escape("float32_matmul_precision of node 'layers.1.attn' must be one of")):
        scope_modules(model)
    assert tree(model) == before


def test_a_root_that_declares_is_not_replaced() -> None:
    model = Head("root")
    with pytest.raises(
        ValueError, match=re.escape("Wrap it instead: model = fp32scope.Fp32ScopedModule(model, precision)")
    ):
        scope_modules(model)


# -- structure ---------------------------------------------------------------------------------


def test_the_root_cannot_be_selected() -> None:
    model = Model()
    for selector in ("", "re:.*", Model, lambda name, module: not name):
        with pytest.raises(
            ValueError, match=r"selects the root module \(Model\).*Fp32ScopedModule\(model, precision\)"
        ):
            scope_modules(model, {selector: "highest"})
    assert scoped_modules(model) == {}


def test_nested_selections_nest_their_scopes() -> None:
    model: Any = Model()
    scope_modules(model, {"layers.0": "highest", "layers.0.mlp.0": "medium"})
    outer = model.layers[0]
    assert isinstance(outer, Fp32ScopedModule)
    inner = outer.__wrapped__.mlp[0]
    assert isinstance(inner, Fp32ScopedModule)
    assert precision_of(inner) == Fp32Precision("medium")
    seen = ran(model)
    assert (seen["layers.0"], seen["layers.0.attn"], seen["layers.0.mlp.0"]) == ("highest", "highest", "medium")
    assert (seen["layers.1"], seen["layers.1.attn"]) == ("high", "high")
    assert unscope_modules(model) == ["layers.0", "layers.0.mlp.0"]
    assert not isinstance(model.layers[0], Fp32ScopedModule)
    assert not isinstance(model.layers[0].mlp[0], Fp32ScopedModule)


def test_already_scoped_same_precision_is_left_other_precision_is_an_error() -> None:
    model: Any = Model()
    hand = Fp32ScopedModule(model.embed, HIGHEST, name="mine")
    model.embed = hand
    assert scope_modules(model, {"embed": "highest", "layers.0": "medium"}) == {"layers.0": Fp32Precision("medium")}
    assert model.embed is hand
    before = tree(model)
    with pytest.raises(
        ValueError, match=re.escape("module 'embed' is scoped already with Fp32Precision(matmul='highest'")
    ):
        scope_modules(model, {"embed": "medium", "layers.1": "medium"})
    assert tree(model) == before


def test_a_compiled_model_is_walked_through() -> None:
    model = Model()
    compiled = torch.compile(model, backend="eager")
    assert scope_modules(compiled, {"embed": "highest"}) == {"embed": HIGHEST}  # type: ignore[arg-type]
    assert isinstance(model.embed, Fp32ScopedModule)
    assert scoped_modules(compiled) == {"embed": HIGHEST}  # type: ignore[arg-type]


def test_a_compiled_submodule_is_one_node_with_what_it_compiles() -> None:
    model: Any = Model()
    model.embed = torch.compile(model.embed, backend="eager")
    # Its declaration is read through the compiled module; its _orig_mod is not scoped again.
    model.embed.float32_matmul_precision = "highest"  # reaches the Probe
    got = scope_modules(model)
    assert set(got) == {"embed", "heads.out"}
    assert isinstance(model.embed, Fp32ScopedModule)
    # Names under it are state_dict's: embed._orig_mod.weight, and the class selects the node.
    assert "embed._orig_mod.weight" in model.state_dict()


def test_a_shared_module_is_wrapped_once_everywhere() -> None:
    model = Model()
    shared = model.layers[0]
    model.again = shared
    got = scope_modules(model, {Block: "highest"})
    assert set(got) == {"layers.0", "layers.1", "again"}
    assert model.again is model.layers[0]
    unscope_modules(model)
    with pytest.raises(ValueError, match="is the same module as"):
        scope_modules(model, {"again": "highest", "layers.0": "medium"})


def test_unscope_puts_the_very_modules_back() -> None:
    model = Model()
    before = tree(model)
    originals = dict(model.named_modules())
    scope_modules(model, {Probe: "highest", Block: FULL})
    assert tree(model) != before
    names = unscope_modules(model)
    assert names == [n for n in originals if n and isinstance(originals[n], (Probe, Block))]
    assert tree(model) == before
    assert unscope_modules(model) == []


def test_scoped_modules_lists_hand_made_wrappers_too() -> None:
    model: Any = Model()
    model.heads["out"] = Fp32ScopedModule(model.heads["out"], FULL)
    model.embed = Fp32ScopedModule(model.embed, None)
    scope_modules(model, {"layers.1.mlp": "medium"})
    assert scoped_modules(model) == {
        "embed": Fp32Precision(),
        "layers.1.mlp": Fp32Precision("medium"),
        "heads.out": FULL,
    }


# -- nothing else changes ----------------------------------------------------------------------


def test_state_dict_parameters_and_outputs_are_unchanged() -> None:
    model, control = Model(), Model()
    keys = list(model.state_dict())
    names = [name for name, _ in model.named_parameters()]
    params = [id(p) for p in model.parameters()]
    orders = {name: list(m._modules) for name, m in model.named_modules()}
    x = torch.randn(3, 4)
    scope_modules(model, {"layers.0": "high", "re:layers\\.1\\..*": "high", "heads.out": "high"})
    assert list(model.state_dict()) == keys
    assert [name for name, _ in model.named_parameters()] == names
    assert [id(p) for p in model.parameters()] == params
    assert {name: list(m._modules) for name, m in model.named_modules()} == orders
    # Under the same precision as the process default: the same outputs, bit for bit.
    torch.testing.assert_close(model(x), control(x), rtol=0, atol=0)
    # Strict loads both ways.
    model.load_state_dict(control.state_dict(), strict=True)
    control.load_state_dict(model.state_dict(), strict=True)


def test_gradients_flow_as_before() -> None:
    model, control = Model(), Model()
    scope_modules(model, {"layers.0": "high", "heads.out": "high"})
    x = torch.randn(3, 4)
    model(x).sum().backward()
    control(x).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), control.named_parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_parent_calling_a_scoped_childs_forward_runs_it_in_scope() -> None:
    class CallsForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Probe("child")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.child.forward(x)
            return out

    model = CallsForward()
    scope_modules(model, {"child": "highest"})
    assert ran(model) == {"child": "highest"}


# -- Hugging Face --------------------------------------------------------------------------------


HF_POLICY = {"lm_head": "highest", r"re:transformer\.h\.\d+\.attn": {"matmul": "highest", "cudnn_allow_tf32": False}}


def test_hugging_face_gpt2_saves_and_loads_with_tied_weights(tmp_path: Path) -> None:
    model = _gpt2()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = model(ids).logits
    keys = list(model.state_dict())
    # The policy as a user keeps it: in a JSON file.
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps(HF_POLICY))
    got = scope_modules(model, json.loads(policy_file.read_text()))
    assert got == {"transformer.h.0.attn": FULL, "transformer.h.1.attn": FULL, "lm_head": HIGHEST}
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
    model.save_pretrained(tmp_path / "saved")
    # The same files as the unscoped model saves.
    _gpt2().save_pretrained(tmp_path / "bare")
    saved = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert saved == sorted(p.name for p in (tmp_path / "bare").iterdir())
    for name in saved:
        assert (tmp_path / "saved" / name).read_bytes() == (tmp_path / "bare" / name).read_bytes(), name
    loaded = type(model).from_pretrained(tmp_path / "saved").eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert list(loaded.state_dict()) == keys
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected)
    # Scoping the loaded model the same way gives the same model.
    assert scope_modules(loaded, HF_POLICY) == got
    loaded.load_state_dict(model.state_dict(), strict=True)


def test_hugging_face_gpt2_scoped_attention_runs_in_its_precision() -> None:
    model = _gpt2()
    seen: list[str] = []
    scope_modules(model, HF_POLICY)
    model.transformer.h[1].attn.register_forward_pre_hook(lambda *_: seen.append(torch.get_float32_matmul_precision()))
    model.transformer.h[1].mlp.register_forward_pre_hook(lambda *_: seen.append(torch.get_float32_matmul_precision()))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert seen == ["highest", "high"]
    assert unscope_modules(model) == ["transformer.h.0.attn", "transformer.h.1.attn", "lm_head"]


# -- compiled: torch.compile(model) after scoping, and a parent calling child.forward() ----------


class Chain(torch.nn.Module):
    """pre -> block -> post, each called once (no loop over scoped children)."""

    def __init__(self, block: Callable[[], torch.nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(WIDTH, WIDTH)
        self.block = block()
        self.post = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.post(self.block(self.pre(x)))
        return out


class CallsForward(Chain):
    """The same chain whose forward calls ``self.block.forward(...)`` instead of ``self.block(...)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.post(self.block.forward(self.pre(x)))
        return out


class UserBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))


BLOCKS: dict[str, Callable[[], torch.nn.Module]] = {
    "user-module": UserBlock,
    "nn.Linear": lambda: torch.nn.Linear(WIDTH, WIDTH),
}


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("parent", [Chain, CallsForward], ids=["child(x)", "child.forward(x)"])
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_compiling_the_scoped_model_compiles_each_node_in_its_precision(
    kind: str, parent: type[Chain], grad: bool
) -> None:
    model = parent(BLOCKS[kind])
    control = parent(BLOCKS[kind])
    assert scope_modules(model, {"block": FULL}, in_graph=False) == {"block": FULL}
    recording = Recording()
    compiled = torch.compile(model, backend=recording.backend())
    run(compiled, control, grad=grad)  # the same outputs as the unscoped model; no recompiles
    # pre, block, post: three graphs; only the block's compiled in its precision.
    assert sorted(recording.forward) == ["high", "high", "highest"], recording.forward
    assert recording.forward[1] == "highest"
    assert sorted(recording.backward) == (["high", "high", "highest"] if grad else [])
    check_dynamo_never_failed_in_the_package()


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_parent_reads_a_scoped_childs_attributes() -> None:
    class ReadsWeight(Chain):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            block: Any = self.block
            out: torch.Tensor = self.post(block(self.pre(x)) * block.weight.sum())
            return out

    model = ReadsWeight(lambda: torch.nn.Linear(WIDTH, WIDTH))
    control = ReadsWeight(lambda: torch.nn.Linear(WIDTH, WIDTH))
    scope_modules(model, {"block": FULL})
    run(torch.compile(model, backend="eager"), control, grad=True)
    for m in (model, control):  # an in-place change: read afresh, not baked in
        cast("torch.nn.Linear", m.block).weight.data.mul_(2)
    x = torch.randn(2, WIDTH)
    torch.testing.assert_close(torch.compile(model, backend="eager")(x), control(x))


def test_the_proxys_dict_is_its_own_and_the_modules_stays_the_modules() -> None:
    module = torch.nn.Linear(WIDTH, WIDTH)
    proxy: Any = Fp32ScopedModule(module, FULL)
    assert vars(proxy) is not vars(module)
    assert "weight" not in vars(proxy)
    assert callable(vars(proxy)["forward"])
    proxy.extra = 5  # attribute writes still reach the module
    assert vars(module)["extra"] == 5
    assert "extra" not in vars(proxy)
    assert "forward" not in vars(Fp32ScopedModule(module, None))
