"""What ``fp32scope.advise`` costs on a GPT-2-sized model: runs, seconds, and the bound on runs.

Run with ``python benchmarks/bench_advise.py`` (defaults: 12 layers, width 768, 12 heads,
vocabulary 50257: GPT-2 small, 124M parameters, built offline from transformers' config
with random weights). The model runs under bf16 autocast on the CPU (or the first CUDA
device with ``--device cuda``) on ``--batches`` calibration batches of ``--batch`` x
``--length`` tokens and ``--held-out`` held-out ones; the tolerance is a quarter of the
error with every node fast, measured here first, as issue 37's measurements took it.

It prints the candidates, the kept nodes, the runs advise made, the bound issue 37 sets
for one batch (candidates + 2 x kept + log2(candidates) + 4, times the calibration
batches, plus three runs per held-out batch: its reference twice and the policy), and the
seconds. ``--plot FILE.png`` saves the chart, ``--report FILE.json`` the whole advice. It
exits 1 when the runs exceed the bound, 2 where transformers cannot run its models here.
Smaller sizes (``--layers 1 --width 32``) run in seconds: the test suite runs it so.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time

import torch

import fp32scope


def build(layers: int, width: int, heads: int, vocabulary: int, length: int) -> torch.nn.Module:
    """GPT-2 of this size from its config: nothing downloaded, weights drawn at random (seed 0)."""
    transformers = importlib.import_module("transformers")  # the test extra installs it
    if not transformers.is_torch_available():  # transformers 5 disables its models below torch 2.6
        print(
            f"bench_advise: transformers {transformers.__version__} does not run its models"
            f" on torch {torch.__version__}",
            file=sys.stderr,
        )
        raise SystemExit(2)

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocabulary,
        n_positions=max(length, 64),
        bos_token_id=0,
        eos_token_id=0,
    )
    model: torch.nn.Module = transformers.GPT2LMHeadModel(config)
    return model.eval()


def batch(seed: int, size: int, length: int, vocabulary: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocabulary, (size, length), generator=generator)}


def fast_error(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], device: str) -> float:
    """The largest relative error of the logits under bf16 autocast, against full float32."""
    worst = 0.0
    with torch.no_grad(), fp32scope.fp32_precision_scope(fp32scope.Fp32Precision("highest", False)):
        for b in batches:
            reference = model(**b).logits.double()
            with torch.autocast(device, dtype=torch.bfloat16):
                fast = model(**b).logits.double()
            worst = max(worst, float((fast - reference).norm() / reference.norm()))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocabulary", type=int, default=50257)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batches", type=int, default=1, help="calibration batches")
    parser.add_argument("--held-out", type=int, default=0, help="held-out batches")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plot", metavar="FILE.png")
    parser.add_argument("--report", metavar="FILE.json", help="write the whole advice (Fp32Advice.to_json)")
    args = parser.parse_args(argv)
    model = build(args.layers, args.width, args.heads, args.vocabulary, args.length).to(args.device)
    batches = [
        {k: v.to(args.device) for k, v in batch(seed, args.batch, args.length, args.vocabulary).items()}
        for seed in range(args.batches + args.held_out)
    ]
    calibration, held_out = batches[: args.batches], batches[args.batches :]
    started = time.perf_counter()
    tolerance = fast_error(model, calibration, args.device) / 4
    measuring = time.perf_counter() - started
    advice = fp32scope.advise(
        model,
        calibration,
        held_out=held_out or None,
        autocast=torch.bfloat16,
        tolerance=tolerance,
        progress=False,
    )
    candidates, kept = len(advice.nodes), len(advice.policy)
    bound = args.batches * (candidates + 2 * kept + math.log2(max(candidates, 1)) + 4) + 3 * args.held_out
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"GPT-2 {args.layers} layers x {args.width} ({parameters / 1e6:.1f}M parameters), "
        f"{args.batches} batch(es) of {args.batch} x {args.length} tokens, {args.held_out} held out, "
        f"bf16 autocast on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )
    print(f"tolerance {tolerance:.3g} (a quarter of the fast error; measured in {measuring:.1f} s)")
    print(f"candidates {candidates}, kept {kept} ({advice.kept_flop_share:.1%} of FLOPs), met {advice.met}")
    per_run = advice.seconds / advice.runs
    print(f"runs {advice.runs} (bound {bound:.1f}), seconds {advice.seconds:.1f} ({per_run:.3f} per run)")
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:  # noqa: PTH123  (a path the user gave)
            f.write(advice.to_json())
    if args.plot:
        advice.plot(args.plot)
        print(f"chart: {args.plot}")
    return 0 if advice.runs <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
