"""``python -m fp32scope advise``: :func:`~fp32scope.advise` from the command line."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from fp32scope._tools.advise.arguments import _check_fast, _check_inputs, _check_tolerance
from fp32scope._tools.advise.search import advise
from fp32scope._tools.doctor import load_model
from fp32scope._tools.targets import TargetError, call_factory, resolve

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "run"]

DESCRIPTION = """\
Find which nodes of a model need full float32: run the model on the given batches in full
float32 (the reference), at the fast setting (--fast, --autocast), and under candidate
policies, and print each node's sensitivity and a 1-minimal policy that keeps the error
within --tolerance."""

EPILOG = """\
MODULE:ATTR targets: the model is a torch.nn.Module, or a function or class returning one
when called without arguments; the inputs are a batch (a tuple of positional arguments, a
dict of keyword arguments or a tensor), a list of batches, or a function returning one;
the loss is a callable (output) -> scalar tensor, taken as it is.

--output FILE.json writes the policy, which fp32scope.scope_modules loads as it is (with
autocast=False when --autocast is given).

Exit status: 0 when the policy meets the tolerance (an empty policy included), 1 when
it does not, 2 for a bad option or a target that cannot be loaded."""

_AUTOCAST_WORDS = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def add_arguments(parser: Any) -> None:
    """Add the ``advise`` command's arguments to ``parser``."""
    parser.add_argument("model", metavar="MODULE:ATTR", help="the model, or a factory of one")
    parser.add_argument(
        "--inputs", metavar="MODULE:ATTR", required=True, help="a batch, a list of batches, or a factory of one"
    )
    parser.add_argument("--fast", metavar="WORD", help="the fast matmul precision (default: the process's)")
    parser.add_argument("--autocast", metavar="bf16|fp16", help="run the model under torch.autocast with this dtype")
    parser.add_argument("--tolerance", metavar="T", default="1e-3", help="the largest error allowed (default 1e-3)")
    parser.add_argument("--loss", metavar="MODULE:ATTR", help="a loss (output) -> scalar: gradients count too")
    parser.add_argument("--output", metavar="FILE.json", help="write the policy as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="save the sensitivity chart (needs matplotlib)")


def _load(target: str, what: str, *, call: bool) -> Any:
    obj, attribute = resolve(target, example="engine.data:batches")
    if call and callable(obj) and not isinstance(obj, (torch.Tensor, tuple, list, Mapping)):
        obj = call_factory(obj, attribute)
    if not call and not callable(obj):
        msg = f"{what} {attribute} is not callable; got an object of type {type(obj).__name__}"
        raise TargetError(msg)
    return obj


def run(args: Any) -> int:  # noqa: C901, PLR0911  (one check per option, each its own exit)
    """Run ``advise`` for the command line; 0 when the tolerance is met, 1 when not, 2 for a bad argument."""
    import json

    def refuse(option: str, reason: str) -> int:
        print(f"fp32scope advise: {option}: {reason}", file=sys.stderr)
        return 2

    try:
        model = load_model(args.model)
    except TargetError as error:
        return refuse(args.model, str(error))
    try:
        inputs = _load(args.inputs, "--inputs", call=True)
        _check_inputs(inputs)
    except (TargetError, TypeError, ValueError) as error:
        return refuse(f"--inputs {args.inputs}", str(error))
    loss = None
    if args.loss is not None:
        try:
            loss = _load(args.loss, "--loss", call=False)
        except TargetError as error:
            return refuse(f"--loss {args.loss}", str(error))
    try:
        fast = _check_fast(args.fast)
    except (TypeError, ValueError) as error:
        return refuse(f"--fast {args.fast}", str(error))
    dtype = None
    if args.autocast is not None:
        dtype = _AUTOCAST_WORDS.get(args.autocast.lower())
        if dtype is None:
            return refuse(f"--autocast {args.autocast}", "expected bf16 or fp16")
    try:
        tolerance = _check_tolerance(float(args.tolerance))
    except ValueError as error:
        return refuse(f"--tolerance {args.tolerance}", str(error) if "tolerance" in str(error) else "not a number")
    if args.plot is not None:
        try:
            import matplotlib as mpl  # noqa: F401
        except ImportError:
            return refuse(f"--plot {args.plot}", "needs matplotlib: pip install fp32scope[plot]")
    advice = advise(model, inputs, fast=fast, autocast=dtype, tolerance=tolerance, loss=loss)
    print(advice.table())
    print()
    print("policy:")
    print(json.dumps(advice.policy, indent=2))
    if args.output is not None:
        with open(args.output, "w", encoding="utf-8") as f:  # noqa: PTH123  (a path the user gave)
            json.dump(advice.policy, f, indent=2)
            f.write("\n")
        hint = ", autocast=False" if advice.autocast is False else ""
        print(f"wrote {args.output}: fp32scope.scope_modules(model, json.load(f){hint})")
    if args.plot is not None:
        advice.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0 if advice.met else 1
