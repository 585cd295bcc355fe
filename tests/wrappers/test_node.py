"""node_fp32_precision: what a node declares, read through compiled modules and proxies."""

from __future__ import annotations

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
