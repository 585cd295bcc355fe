"""Cost of scoping a node's backward: training steps and inference calls, side by side.

Run with ``nox -s bench`` (or ``python benchmarks/bench_training.py``). For each model, one
training step (forward, loss, ``backward()``, gradients cleared) of the same module three
ways: bare, wrapped forward-only (``backward=False``: the scope around the forward call
only), and wrapped as users get it by default (forward and backward in the node's
precision). Every figure is the median over ``--repeats`` loops of ``--number`` steps,
the cases interleaved loop by loop, all in one process; each difference (and each ratio's
difference) is the median of the differences of two loops of the same round, so that it
compares like with like on a noisy machine. Inference calls under ``torch.no_grad()`` and
``torch.inference_mode()`` show that the default adds nothing there.

The floor: what any design that runs a node's backward apart from the caller's, in a
scope of its own and exception-safe, pays in torch itself: the same step with the module's
output handed through one custom ``autograd.Function`` whose backward runs autograd's
engine again from the real output to the parameters (no fp32scope, no flags). The backward
scope's addition minus the floor's is what fp32scope's own Python costs.

The MLP runs twice: under the engine default ``Fp32Precision("high", True)``, where the
scoped step's backward runs at "highest" and the forward-only one's at "high" (their ratio
is a precision difference, labelled so), and with the process default equal to the node's
precision, where all three steps run the same matmuls and the ratios are fp32scope's
overhead alone.

Also: the copy ops of one MLP training step, bare and scoped, counted with a dispatch mode
(equal: the scoped backward hands each parameter the engine's gradient buffer, as torch
does), and the cost per parameter tensor: stacks of ``Linear(16, 16)`` holding 1, 6 and 24
parameter tensors, the backward scope's addition for each, and its slope; and the slope of
fp32scope's own part alone, between the tiny node (2 parameter tensors) and the 24-tensor
stack, each less its floor (the floor's engine run grows with the parameters too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fp32scope
from fp32scope import Fp32Precision, Fp32ScopedModule
from fp32scope._flags import torch_flags as _flags

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

DEFAULT = Fp32Precision("high", True)
FULL = Fp32Precision("highest", False)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def median_us(fn: Callable[[], object], number: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Microseconds per call of ``fn`` over one loop of ``number`` calls."""
    return timeit.Timer(fn, timer=clock).timeit(number=number) / number * 1e6


def training_step(
    module: Callable[[torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter], x: torch.Tensor
) -> None:
    """forward, loss, backward; then clear the gradients (set_to_none, as optimizers do)."""
    torch.autograd.backward(module(x).square().mean())
    for p in params:
        p.grad = None


TINY = "Linear(16, 16), batch 4"
MLP = "MLP 512-512-512, batch 32"
#: The same MLP with the process default equal to the node's precision: every step runs its
#: matmuls in the same precision, so a ratio between them is fp32scope's overhead alone.
MLP_SAME = "MLP 512-512-512, batch 32, process default = the node's"
#: Models holding 1, 6 and 24 parameter tensors: the cost per parameter tensor.
PER_PARAMETER = {n: f"{n} parameter tensors (Linear(16, 16) stack), batch 4" for n in (1, 6, 24)}


def build(kind: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == TINY:
        return torch.nn.Linear(16, 16), torch.randn(4, 16)
    for n, name in PER_PARAMETER.items():
        if kind == name:
            if n == 1:
                return torch.nn.Linear(16, 16, bias=False), torch.randn(4, 16)
            return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(n // 2))), torch.randn(4, 16)
    assert kind in (MLP, MLP_SAME), kind
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    return model, torch.randn(32, 512)


class _FloorBoundary(torch.autograd.Function):
    """One node for a module's whole subgraph; its backward runs the engine on it again."""

    @staticmethod
    def forward(ctx: Any, held: list[torch.Tensor], *leaves: torch.Tensor) -> torch.Tensor:
        ctx.held = held
        ctx.leaves = leaves
        return held[0].detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        engine = torch.autograd.Variable._execution_engine
        grads = engine.run_backward(tuple(ctx.held), (grad,), False, False, ctx.leaves, True, False)
        return (None, *grads)


def floor_of(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module behind the floor's boundary (the real output held in a list: not an edge)."""
    leaves = tuple(module.parameters())

    def call(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _FloorBoundary.apply([module(x)], *leaves)  # type: ignore[no-untyped-call]
        return out

    return call


class _CountCopies(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the copy ops (and their bytes) that run while it is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0
        self.bytes = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in {"copy_", "clone", "_to_copy", "copy"}:
            first = out if isinstance(out, torch.Tensor) else args[0]
            self.count += 1
            self.bytes += first.numel() * first.element_size()
        return out


def count_copies() -> dict[str, tuple[int, int]]:
    """Copy ops and bytes of one MLP training step (gradients unset before it), bare and scoped."""
    result = {}
    for name, scoped in (("bare", False), ("scoped (forward and backward)", True)):
        module, x = build(MLP)
        params = list(module.parameters())
        step_of = Fp32ScopedModule(module, FULL) if scoped else module
        training_step(step_of, params, x)  # warm up
        with _CountCopies() as mode:
            training_step(step_of, params, x)
        result[name] = (mode.count, mode.bytes)
    return result


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0912, PLR0915  (one flat script)
    """Measure, print medians, differences and ratios (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=200, help="steps per timing loop")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or this process's CPU time (steadier where other processes share the cores)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a shared 2-core machine: one thread keeps the figures steadier
    fp32scope.set_process_default(DEFAULT)

    cases: dict[str, Callable[[], object]] = {}
    # The process default each case's loops run under (set between loops, never timed).
    defaults: dict[str, Fp32Precision] = {}
    for kind in (TINY, MLP, MLP_SAME, *PER_PARAMETER.values()):
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
        if kind == MLP_SAME:
            for how in ("bare module", "forward-only scope", "forward and backward scoped"):
                defaults[f"{kind}: train step, {how}"] = FULL
        if kind in (TINY, PER_PARAMETER[24]):
            floor = floor_of(module)

            def floor_step(m: object = floor, p: list[torch.nn.Parameter] = params, x: torch.Tensor = x) -> None:
                training_step(m, p, x)  # type: ignore[arg-type]

            cases[f"{kind}: train step, torch's floor (Function + engine again)"] = floor_step

    module, x = build(TINY)
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
            fp32scope.set_process_default(defaults.get(name, DEFAULT))
            samples[name].append(median_us(fn, number, CLOCKS[args.clock]))
    fp32scope.set_process_default(DEFAULT)
    if _flags.read_all() != before:
        print("error: the benchmark left the flags changed", file=sys.stderr)
        return 1
    med = {name: statistics.median(values) for name, values in samples.items()}

    print(f"torch {torch.__version__}, fp32scope {fp32scope.__version__}, 1 thread")
    print(f"median of {args.repeats} interleaved loops, microseconds ({args.clock} time) per step or call")
    width = max(map(len, med))
    for name, value in med.items():
        print(f"  {name:<{width}}  {value:9.2f}")
    tiny, mlp = TINY, MLP

    def paired(name: str, baseline: str) -> float:
        """The median, over the loops, of ``name`` minus ``baseline`` timed in the same round of loops.

        A small difference of two large figures: a slow stretch of the machine shifts both
        loops of a round, where the difference of the two medians keeps it.
        """
        return statistics.median(a - b for a, b in zip(samples[name], samples[baseline], strict=True))

    def adds(kind: str) -> float:
        return paired(f"{kind}: train step, forward and backward scoped", f"{kind}: train step, forward-only scope")

    def floor_adds(kind: str) -> float:
        return paired(
            f"{kind}: train step, torch's floor (Function + engine again)", f"{kind}: train step, bare module"
        )

    def ratio(name: str, baseline: str) -> float:
        return 1 + paired(name, baseline) / med[baseline]

    few, most = PER_PARAMETER[1], PER_PARAMETER[24]
    figures = {
        f"{tiny}: backward scope adds, us": adds(tiny),
        f"{tiny}: torch's floor adds, us": floor_adds(tiny),
        f"{tiny}: fp32scope's own part (scope adds - floor adds), us [goal <= 12]": adds(tiny) - floor_adds(tiny),
        f"{most}: torch's floor adds, us": floor_adds(most),
        f"{most}: fp32scope's own part (scope adds - floor adds), us": adds(most) - floor_adds(most),
        f"{MLP_SAME}: scoped / forward-only step, fp32scope's overhead [goal <= 1.05]": ratio(
            f"{MLP_SAME}: train step, forward and backward scoped", f"{MLP_SAME}: train step, forward-only scope"
        ),
        f"{MLP_SAME}: scoped / bare step, fp32scope's overhead": ratio(
            f"{MLP_SAME}: train step, forward and backward scoped", f"{MLP_SAME}: train step, bare module"
        ),
        f"{MLP_SAME}: backward scope adds, us": adds(MLP_SAME),
        # Not overhead: under the default "high" the forward-only step's backward runs at "high",
        # the scoped one's at "highest"; on a CPU with oneDNN's bf16 paths "high" may be slower.
        f"{mlp}: a precision difference, not overhead: scoped ('highest' backward) / forward-only "
        "('high' backward) step": ratio(
            f"{mlp}: train step, forward and backward scoped", f"{mlp}: train step, forward-only scope"
        ),
        **{f"{PER_PARAMETER[n]}: backward scope adds, us": adds(PER_PARAMETER[n]) for n in PER_PARAMETER},
        # The goal is on fp32scope's own part; torch's floor grows with the parameters too.
        "per parameter tensor: backward scope adds, torch's floor included, us (slope 1 -> 24)": (
            adds(most) - adds(few)
        )
        / 23,
        "per parameter tensor: fp32scope's own part, us (slope 2 -> 24) [goal <= 3]": (
            (adds(most) - floor_adds(most)) - (adds(tiny) - floor_adds(tiny))
        )
        / 22,
        "no_grad call: default - backward=False, us": paired(
            "Linear(16, 16): no_grad call, default (backward=True)", "Linear(16, 16): no_grad call, backward=False"
        ),
        "inference_mode call: default - backward=False, us": paired(
            "Linear(16, 16): inference_mode call, default (backward=True)",
            "Linear(16, 16): inference_mode call, backward=False",
        ),
    }
    print("differences and ratios (same run):")
    for name, value in figures.items():
        print(f"  {name}: {value:.2f}")
    copies = count_copies()
    print("copy ops in one MLP 512-512-512 training step (count, bytes) [goal: scoped == bare]:")
    for name, (count, size) in copies.items():
        print(f"  {name}: {count}, {size}")
    if args.json:
        print(json.dumps({"median_us": med, "figures": figures, "copies": copies}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
