"""node_fp32_precision: what a node declares, read through compiled modules and proxies."""

from __future__ import annotations

import pytest
import torch

from fp32scope import Fp32Precision, Fp32ScopedModule, node_fp32_precision


class FullFp32(torch.nn.Linear):
    float32_matmul_precision = "highest"
    cudnn_allow_tf32 = False


def test_class_attributes() -> None:
    assert node_fp32_precision("head", FullFp32(2, 2)) == Fp32Precision("highest", False)


def test_instance_attributes_and_partial_declarations() -> None:
    module = torch.nn.Linear(2, 2)
    assert node_fp32_precision("n", module) is None
    module.cudnn_allow_tf32 = True  # type: ignore[assignment]
    assert node_fp32_precision("n", module) == Fp32Precision(None, True)
    module.float32_matmul_precision = "medium"  # type: ignore[assignment]
    assert node_fp32_precision("n", module) == Fp32Precision("medium", True)


def test_instance_overrides_class() -> None:
    module = FullFp32(2, 2)
    module.float32_matmul_precision = "high"
    assert node_fp32_precision("n", module) == Fp32Precision("high", False)


def test_compiled_module_reads_through_to_the_module_it_wraps() -> None:
    compiled = torch.compile(FullFp32(2, 2), backend="eager")  # nothing compiles until called
    assert node_fp32_precision("head", compiled) == Fp32Precision("highest", False)
    assert node_fp32_precision("body", torch.compile(torch.nn.Linear(2, 2), backend="eager")) is None


def test_proxy_reads_through() -> None:
    proxy = Fp32ScopedModule(torch.compile(FullFp32(2, 2), backend="eager"), Fp32Precision("high"))
    assert node_fp32_precision("head", proxy) == Fp32Precision("highest", False)


def test_any_object_can_declare() -> None:
    class Callable:
        float32_matmul_precision = "high"

        def __call__(self) -> None:
            pass

    assert node_fp32_precision("fn", Callable()) == Fp32Precision("high", None)


class _DeclaresAutocast(torch.nn.Linear):
    autocast: object = False


class _DeclaresAutocastBadly(torch.nn.Linear):
    autocast: object = "off"


def test_a_node_module_declares_its_autocast() -> None:
    # autocast = False beside the precision: the node runs without the caller's autocast.
    node = Fp32ScopedModule(_DeclaresAutocast(4, 4), Fp32Precision("highest", False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert node(torch.ones(2, 4)).dtype == torch.float32
    with pytest.raises(TypeError) as caught:
        Fp32ScopedModule(_DeclaresAutocastBadly(4, 4), Fp32Precision("highest", False), name="head")
    assert str(caught.value) == (
        "autocast of node 'head' must be False (run the node without the caller's torch.autocast, its "
        "floating-point arguments cast to float32), True (keep the caller's autocast) or None (keep it, and "
        "warn if the node asks for full float32); got 'off' of type str."
    )
