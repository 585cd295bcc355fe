"""``python -m fp32scope advise``: :func:`~fp32scope.advise` from the command line."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fp32scope._tools.advise.arguments import (
    _check_compile,
    _check_fast,
    _check_inputs,
    _check_margin,
    _check_reference,
    _check_tolerance,
)
from fp32scope._tools.advise.search import advise
from fp32scope._tools.doctor import load_model
from fp32scope._tools.targets import TargetError, call_factory, one_line, resolve

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "run"]

DESCRIPTION = """\
Find which nodes of a model need full float32: run the model on the given batches in full
float32 (the reference, twice), at the fast setting (--fast, --autocast), and under
candidate policies, and print each node's sensitivity and a policy, 1-minimal on the
--inputs batches, that keeps the error within --tolerance / --margin there; then measure
it on the --held-out batches. With --compile the fast runs are the model compiled whole
(torch.compile), and with --reference eager the reference is the model run eagerly at the
fast setting: the policy keeps eager the nodes whose compiled results drift."""

EPILOG = """\
MODULE:ATTR targets: the model is a torch.nn.Module, or a function or class returning one
when called without arguments; the inputs and held-out batches are a batch (a tuple of
positional arguments, a dict of keyword arguments or a tensor), a list of batches, or a
function returning one; the loss (output) -> scalar tensor and the run
run(model, *args, **kwargs) -> output are callables, taken as they are.

--output FILE.json writes the policy, which fp32scope.scope_modules loads as it is (with
autocast=False when --autocast is given); --report FILE.json writes the whole advice
(fp32scope.Fp32Advice.from_json reads it; its "policy" is what --output writes). Every
output path is checked before the model is built.

--compile-option KEY=VALUE (repeatable; implies --compile) passes one torch.compile
keyword argument: VALUE is read as JSON where it is JSON (true, false, null, numbers,
{"...": ...}) and as a string otherwise, e.g. --compile-option fullgraph=true
--compile-option backend=aot_eager --compile-option mode=max-autotune-no-cudagraphs.

Exit status: 0 when the policy meets the tolerance on every batch (an empty policy
included), 1 when it does not, 2 when anything is refused or raises: a bad option, a
target that cannot be loaded, a model that advise refuses or whose run raises (one line
on stderr names it; --traceback shows the whole traceback)."""

_AUTOCAST_WORDS = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def add_arguments(parser: Any) -> None:
    """Add the ``advise`` command's arguments to ``parser``."""
    parser.add_argument("model", metavar="MODULE:ATTR", help="the model, or a factory of one")
    parser.add_argument(
        "--inputs", metavar="MODULE:ATTR", required=True, help="a batch, a list of batches, or a factory of one"
    )
    parser.add_argument("--held-out", metavar="MODULE:ATTR", help="batches the policy is checked on, never searched")
    parser.add_argument("--fast", metavar="WORD", help="the fast matmul precision (default: the process's)")
    parser.add_argument("--autocast", metavar="bf16|fp16", help="run the model under torch.autocast with this dtype")
    parser.add_argument("--tolerance", metavar="T", default="1e-3", help="the largest error allowed (default 1e-3)")
    parser.add_argument(
        "--margin", metavar="M", default="1.5", help="search for tolerance / M, M >= 1 (default 1.5; 1: no margin)"
    )
    parser.add_argument("--loss", metavar="MODULE:ATTR", help="a loss (output) -> scalar: gradients count too")
    parser.add_argument(
        # Not `args.run`: the command line dispatches each command through that name.
        "--run",
        dest="run_target",
        metavar="MODULE:ATTR",
        help="run(model, *args, **kwargs) replaces the model's call",
    )
    parser.add_argument("--compile", action="store_true", help="the fast runs are the model compiled whole")
    parser.add_argument(
        "--compile-option",
        dest="compile_options",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a torch.compile keyword argument (repeatable; implies --compile; VALUE as JSON, else a string)",
    )
    parser.add_argument(
        "--reference",
        metavar="float32|eager",
        default="float32",
        help="measure against the model in full float32 (default) or run eagerly at the fast setting (needs --compile)",
    )
    parser.add_argument("--output", metavar="FILE.json", help="write the policy as JSON")
    parser.add_argument("--report", metavar="FILE.json", help="write the whole advice as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="save the sensitivity chart (needs matplotlib)")
    parser.add_argument("--traceback", action="store_true", help="on a failure, print the whole traceback")


def _load(target: str, what: str, *, call: bool) -> Any:
    obj, attribute = resolve(target, example="engine.data:batches")
    if call and callable(obj) and not isinstance(obj, (torch.Tensor, tuple, list, Mapping)):
        obj = call_factory(obj, attribute)
    if not call and not callable(obj):
        msg = f"{what} {attribute} is not callable; got an object of type {type(obj).__name__}"
        raise TargetError(msg)
    return obj


def _check_output(path: str) -> str | None:
    """Why ``path`` cannot be written (None: it can), checked without writing it."""
    target = Path(path)
    if target.is_dir():
        return "is a directory"
    parent = target.parent
    if not parent.is_dir():
        return f"its folder {str(parent)!r} does not exist"
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return "cannot be written (permission denied)"
    return None


class _RefusedError(Exception):
    """An option or target the command refuses: exit 2, one line."""

    def __init__(self, option: str, reason: str) -> None:
        super().__init__(f"{option}: {reason}")


def _options(args: Any) -> dict[str, Any]:  # noqa: C901  (one check per option)
    """Every option checked, before the model is built; :class:`_RefusedError` names the first bad one."""
    for option in ("output", "report", "plot"):
        path = getattr(args, option)
        if path is not None:
            problem = _check_output(path)
            if problem is not None:
                raise _RefusedError(f"--{option} {path}", problem)
    if args.plot is not None:
        try:
            import matplotlib as mpl  # noqa: F401
        except ImportError:
            raise _RefusedError(f"--plot {args.plot}", "needs matplotlib: pip install fp32scope[plot]") from None
    try:
        fast = _check_fast(args.fast)
    except (TypeError, ValueError) as error:
        raise _RefusedError(f"--fast {args.fast}", str(error)) from None
    dtype = None
    if args.autocast is not None:
        dtype = _AUTOCAST_WORDS.get(args.autocast.lower())
        if dtype is None:
            raise _RefusedError(f"--autocast {args.autocast}", "expected bf16 or fp16")
    try:
        tolerance = _check_tolerance(float(args.tolerance))
    except ValueError as error:
        reason = str(error) if "tolerance" in str(error) else "not a number"
        raise _RefusedError(f"--tolerance {args.tolerance}", reason) from None
    try:
        margin = _check_margin(float(args.margin))
    except ValueError as error:
        raise _RefusedError(
            f"--margin {args.margin}", str(error) if "margin" in str(error) else "not a number"
        ) from None
    compile_options = _compile_options(args)
    try:
        _check_reference(args.reference, compile_options)
    except (TypeError, ValueError) as error:
        raise _RefusedError(f"--reference {args.reference}", str(error)) from None
    return {
        "fast": fast,
        "autocast": dtype,
        "tolerance": tolerance,
        "margin": margin,
        "compile": compile_options if compile_options is not None else False,
        "reference": args.reference,
    }


def _compile_options(args: Any) -> dict[str, Any] | None:
    """torch.compile's keyword arguments from --compile and --compile-option (None: neither given)."""
    if not args.compile and not args.compile_options:
        return None
    options: dict[str, Any] = {}
    for item in args.compile_options:
        key, equals, text = item.partition("=")
        if not equals or not key:
            raise _RefusedError(f"--compile-option {item}", "expected KEY=VALUE, e.g. fullgraph=true")
        try:
            value = json.loads(text)
        except ValueError:
            value = text  # a word: backend=inductor, mode=max-autotune
        options[key] = value
    try:
        checked = _check_compile(options)
    except (TypeError, ValueError) as error:
        raise _RefusedError(f"--compile-option {' '.join(args.compile_options)}", str(error)) from None
    return checked


def _targets(args: Any) -> dict[str, Any]:
    """The batches, the loss and the run the targets name (the model aside)."""
    found: dict[str, Any] = {}
    for option, key in (("--inputs", "inputs"), ("--held-out", "held_out")):
        target = getattr(args, key)
        if target is None:
            continue
        try:
            found[key] = _load(target, option, call=True)
            _check_inputs(found[key], key)
        except (TargetError, TypeError, ValueError) as error:
            raise _RefusedError(f"{option} {target}", str(error)) from None
    for option, key, dest in (("--loss", "loss", "loss"), ("--run", "run", "run_target")):
        target = getattr(args, dest)
        if target is None:
            continue
        try:
            found[key] = _load(target, option, call=False)
        except TargetError as error:
            raise _RefusedError(f"{option} {target}", str(error)) from None
    return found


def run(args: Any) -> int:
    """Run ``advise`` for the command line: 0 when the tolerance is met, 1 when not, 2 when refused or raised."""
    try:
        options = _options(args)
        targets = _targets(args)
        try:
            model = load_model(args.model)
        except TargetError as error:
            raise _RefusedError(args.model, str(error)) from None
        advice = advise(model, **targets, **options)
    except _RefusedError as error:
        if args.traceback:
            traceback.print_exc()
        print(f"fp32scope advise: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001  (the model, loss or run raised, or advise refused: exit 2)
        if args.traceback:
            traceback.print_exc()
        print(f"fp32scope advise: {one_line(error)}", file=sys.stderr)
        return 2
    print(advice.table())
    print()
    print("policy:")
    print(json.dumps(advice.policy, indent=2))
    if args.output is not None:
        Path(args.output).write_text(json.dumps(advice.policy, indent=2) + "\n", encoding="utf-8")
        hint = ", autocast=False" if advice.autocast is False else ""
        then = "; then torch.compile the model as measured" if advice.compile is not None else ""
        print(f"wrote {args.output}: fp32scope.scope_modules(model, json.load(f){hint}){then}")
    if args.report is not None:
        Path(args.report).write_text(advice.to_json() + "\n", encoding="utf-8")
        print(f"wrote {args.report}: fp32scope.Fp32Advice.from_json(text)")
    if args.plot is not None:
        advice.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0 if advice.met else 1
