"""Per-call cost of Fp32ScopedModule around a small compiled module, against the bare compiled call.

Runs on CUDA where there is a GPU (synchronising after each timed loop), else on the CPU.
Medians of interleaved loops, one process, one run; the ratio is proxy / bare.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from fp32scope import Fp32Precision, Fp32ScopedModule, set_process_default

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def main(argv: list[str] | None = None) -> int:
    """Measure and print the medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    set_process_default(Fp32Precision("high", True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).to(device)
    x = torch.randn(8, 64, device=device)
    bare = torch.compile(model, backend=args.backend)
    scoped = Fp32ScopedModule(torch.compile(model, backend=args.backend), Fp32Precision("highest", False))

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def loop(fn: Callable[[torch.Tensor], object]) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(args.number):
            fn(x)
        sync()
        return float((time.perf_counter() - start) / args.number * 1e6)

    with torch.no_grad():
        for fn in (bare, scoped):
            for _ in range(5):
                fn(x)  # compile, warm up
        samples: dict[str, list[float]] = {"bare compiled call": [], "Fp32ScopedModule call": []}
        for _ in range(args.repeats):
            samples["bare compiled call"].append(loop(bare))
            samples["Fp32ScopedModule call"].append(loop(scoped))
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"device {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), torch {torch.__version__}")
    for name, value in med.items():
        print(f"  {name:<24} {value:9.2f} us")
    over = med["Fp32ScopedModule call"] - med["bare compiled call"]
    ratio = med["Fp32ScopedModule call"] / med["bare compiled call"]
    print(f"  proxy overhead {over:.2f} us per call; ratio proxy/bare {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
