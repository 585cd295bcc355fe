"""A node's precision travels with its AOTInductor package.

The exporting process exports the bare node (a model with a scoped call cannot be exported:
one graph cannot carry a precision change), compiles it to a ``.pt2`` package in the
node's precision, which the package records, and starts a fresh process to load it. That
process has another default ("medium"); ``fp32scope.aoti_load_package`` reads the record and
runs every call of the package in the node's precision, with grad, under ``no_grad`` and
under ``inference_mode``. A probe custom op in the node reports the flags where it runs
(the loading process imports this file, which registers the op, as an engine would load
its custom ops' library).

Run it: ``python examples/aoti_package.py`` (one AOTInductor compile: 10 s to a minute).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import fp32scope
from fp32scope import Fp32Precision, Fp32ScopedModule, current_fp32_precision, precision_of, set_process_default

NODE_PRECISION = Fp32Precision("highest", cudnn_allow_tf32=False)
LOADER_DEFAULT = Fp32Precision("medium", cudnn_allow_tf32=True)
SEEN: list[Fp32Precision] = []


@torch.library.custom_op("fp32scope_examples::report", mutates_args=())
def report(x: torch.Tensor) -> torch.Tensor:
    """The identity; notes the flags when the package runs it."""
    SEEN.append(current_fp32_precision())
    return x.clone()


@report.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Head(torch.nn.Module):
    """The node: a projection that needs full fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = report(self.proj(x))
        return out


def export_and_compile(path: Path) -> None:
    head = Fp32ScopedModule(Head(), NODE_PRECISION)  # how the engine runs it in this process
    x = torch.randn(8, 64)
    try:
        torch.export.export(head, (x,), strict=False)  # type: ignore[arg-type]  # a transparent proxy
    except fp32scope.Fp32ScopeError as error:
        print(f"exporting the scoped node: {str(error)[:60]}...")
    exported = torch.export.export(head.__wrapped__, (x,))  # the bare node
    written = fp32scope.aoti_compile_and_package(exported, precision_of(head), package_path=path)
    # Read without loading the package's library where torch offers it (not in torch 2.8).
    read_early = getattr(torch._C._aoti.AOTIModelPackageLoader, "load_metadata_from_package", None)
    if read_early is not None:
        record = read_early(written, "model")
    else:
        record = torch._inductor.aoti_load_package(written).get_metadata()
    print("the package records:", {k: v for k, v in sorted(record.items()) if k.startswith("fp32scope")})


def load_and_run(path: str) -> None:
    set_process_default(LOADER_DEFAULT)
    print(f"loading process default: {current_fp32_precision()}")
    head = fp32scope.aoti_load_package(path)
    print(f"precision_of(loaded package): {precision_of(head)}")
    x = torch.randn(8, 64, requires_grad=True)
    for name, mode in (
        ("grad", torch.enable_grad),
        ("no_grad", torch.no_grad),
        ("inference_mode", torch.inference_mode),
    ):
        SEEN.clear()
        with mode():
            head(x)
        print(f"call under {name:<15} ran in {SEEN[0]}")
        assert SEEN == [NODE_PRECISION]
    assert current_fp32_precision() == LOADER_DEFAULT
    print(f"after the calls the default is back: {current_fp32_precision()}")


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "head.pt2"
        export_and_compile(path)
        # A fresh interpreter, as an engine's serving process would be.
        result = subprocess.run(  # noqa: S603
            [sys.executable, __file__, "--load", str(path)], capture_output=True, text=True, check=False
        )
        print(result.stdout, end="")
        if result.returncode != 0:
            print(result.stderr, file=sys.stderr)
            sys.exit(result.returncode)
    print("every call of the loaded package ran in the node's precision")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--load"]:
        load_and_run(sys.argv[2])
    else:
        main()
