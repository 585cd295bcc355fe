"""Cost of scoping a node's backward: training steps and inference calls, side by side.

Run with ``nox -s bench`` (or ``python benchmarks/bench_training.py``). For each model, one
training step (forward, loss, ``backward()``, gradients cleared) of the same module three
ways: bare, wrapped forward-only (``backward=False``: the scope around the forward call
only), and wrapped as users get it by default (forward and backward in the node's
precision). Every figure is the median over ``--repeats`` loops of ``--number`` steps,
the cases interleaved loop by loop, all in one process, so the differences and ratios
compare like with like on a noisy machine. Inference calls under ``torch.no_grad()`` and
``torch.inference_mode()`` show that the default adds nothing there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
import warnings
from collections.abc import Callable

import torch

import fp32scope
from fp32scope import Fp32Precision, Fp32ScopedModule, _flags

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

DEFAULT = Fp32Precision("high", True)
FULL = Fp32Precision("highest", False)


def median_us(fn: Callable[[], object], number: int) -> float:
    """Microseconds per call of ``fn`` over one loop of ``number`` calls."""
    return timeit.Timer(fn).timeit(number=number) / number * 1e6


def training_step(
    module: Callable[[torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter], x: torch.Tensor
) -> None:
    """forward, loss, backward; then clear the gradients (set_to_none, as optimizers do)."""
    torch.autograd.backward(module(x).square().mean())
    for p in params:
        p.grad = None


def build(kind: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "Linear(16, 16), batch 4":
        return torch.nn.Linear(16, 16), torch.randn(4, 16)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    return model, torch.randn(32, 512)


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0915  (one flat script)
    """Measure, print medians, differences and ratios (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=200, help="steps per timing loop")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a shared 2-core machine: one thread keeps the figures steadier
    fp32scope.set_process_default(DEFAULT)

    cases: dict[str, Callable[[], object]] = {}
    for kind in ("Linear(16, 16), batch 4", "MLP 512-512-512, batch 32"):
        module, x = build(kind)
        params = list(module.parameters())
        forward_only = Fp32ScopedModule(module, FULL, backward=False)
        both = Fp32ScopedModule(module, FULL)

        def bare_step(m: torch.nn.Module = module, p: list[torch.nn.Parameter] = params, x: torch.Tensor = x) -> None:
            training_step(m, p, x)

        def forward_only_step(
            m: object = forward_only, p: list[torch.nn.Parameter] = params, x: torch.Tensor = x
        ) -> None:
            training_step(m, p, x)  # type: ignore[arg-type]

        def both_step(m: object = both, p: list[torch.nn.Parameter] = params, x: torch.Tensor = x) -> None:
            training_step(m, p, x)  # type: ignore[arg-type]

        cases[f"{kind}: train step, bare module"] = bare_step
        cases[f"{kind}: train step, forward-only scope"] = forward_only_step
        cases[f"{kind}: train step, forward and backward scoped"] = both_step

    module, x = build("Linear(16, 16), batch 4")
    forward_only = Fp32ScopedModule(module, FULL, backward=False)
    both = Fp32ScopedModule(module, FULL)

    def no_grad_forward_only() -> None:
        with torch.no_grad():
            forward_only(x)

    def no_grad_both() -> None:
        with torch.no_grad():
            both(x)

    def inference_forward_only() -> None:
        with torch.inference_mode():
            forward_only(x)

    def inference_both() -> None:
        with torch.inference_mode():
            both(x)

    cases["Linear(16, 16): no_grad call, backward=False"] = no_grad_forward_only
    cases["Linear(16, 16): no_grad call, default (backward=True)"] = no_grad_both
    cases["Linear(16, 16): inference_mode call, backward=False"] = inference_forward_only
    cases["Linear(16, 16): inference_mode call, default (backward=True)"] = inference_both

    for fn in cases.values():
        for _ in range(20):
            fn()  # warm up: allocator, first-call imports
    before = _flags.read_all()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            number = args.number if "MLP" not in name else max(1, args.number // 4)
            samples[name].append(median_us(fn, number))
    if _flags.read_all() != before:
        print("error: the benchmark left the flags changed", file=sys.stderr)
        return 1
    med = {name: statistics.median(values) for name, values in samples.items()}

    print(f"torch {torch.__version__}, fp32scope {fp32scope.__version__}, 1 thread")
    print(f"median of {args.repeats} interleaved loops, microseconds per step or call")
    width = max(map(len, med))
    for name, value in med.items():
        print(f"  {name:<{width}}  {value:9.2f}")
    tiny = "Linear(16, 16), batch 4"
    mlp = "MLP 512-512-512, batch 32"
    figures = {
        f"{tiny}: backward scope adds, us [target <= 60]": med[f"{tiny}: train step, forward and backward scoped"]
        - med[f"{tiny}: train step, forward-only scope"],
        f"{mlp}: scoped / forward-only step [target <= 1.05]": med[f"{mlp}: train step, forward and backward scoped"]
        / med[f"{mlp}: train step, forward-only scope"],
        f"{mlp}: backward scope adds, us": med[f"{mlp}: train step, forward and backward scoped"]
        - med[f"{mlp}: train step, forward-only scope"],
        "no_grad call: default - backward=False, us": med["Linear(16, 16): no_grad call, default (backward=True)"]
        - med["Linear(16, 16): no_grad call, backward=False"],
        "inference_mode call: default - backward=False, us": med[
            "Linear(16, 16): inference_mode call, default (backward=True)"
        ]
        - med["Linear(16, 16): inference_mode call, backward=False"],
    }
    print("differences and ratios (same run):")
    for name, value in figures.items():
        print(f"  {name}: {value:.2f}")
    if args.json:
        print(json.dumps({"median_us": med, "figures": figures}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
