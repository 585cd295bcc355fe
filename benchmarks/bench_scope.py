"""Per-call cost of fp32scope's scopes and wrappers, against torch's own helpers and the floor.

Run with ``nox -s bench`` (or ``python benchmarks/bench_scope.py``). Every figure is the
median over ``--repeats`` timing loops of ``--number`` calls each, all in one process and
one run, so that the ratios compare like with like on a noisy, shared machine. Overheads
are the figure minus the bare call. What a wrapper adds on top of a scope (and what a
feature adds when on) is the median of the differences of two loops timed one after the
other: each is a small difference of two large figures.
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
from fp32scope import Fp32Precision, Fp32ScopedModule, fp32_precision_scope, with_fp32_precision
from fp32scope._flags import torch_flags as _flags
from fp32scope._flags.hooks import open_ranges as _ranges
from fp32scope._flags.hooks import open_traces as _traces
from fp32scope._flags.hooks import profiler_state as _profiler_state
from fp32scope._training.backward import grad_enabled
from fp32scope._wrappers.autocast import any_autocast
from fp32scope._wrappers.param_dtype import warn_low_precision_parameters
from fp32scope._wrappers.trampoline import active_callback

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

_C = torch._C


def noop() -> None:
    """The bare call every figure wraps."""


def median_ns(fn: Callable[[], object], number: int, repeats: int) -> float:
    """Median nanoseconds per call of ``fn`` over ``repeats`` loops of ``number`` calls."""
    timer = timeit.Timer(fn)
    times = timer.repeat(repeat=repeats, number=number)
    return statistics.median(times) / number * 1e9


def floor_switch_both() -> None:
    """The raw _C calls that the library's exact switch of both fields issues, inline.

    The same calls, in the same order and the same state, as the switching path from the
    usual engine default, Fp32Precision("high", True), to Fp32Precision("highest", False):
    entry checks and exact save (the legacy values, and each slot's reading against its
    parent's to tell its raw value), the writes, the exit checks and the restore. Nothing
    else: no Python function, no branch.
    """
    g = _C._get_fp32_precision_getter
    # enter matmul: held? no; save (reading vs parent reading decides the raw value); apply
    _C._get_float32_matmul_precision()
    g("cuda", "matmul")
    g("cuda", "all")
    g("mkldnn", "matmul")
    g("mkldnn", "all")
    _C._set_float32_matmul_precision("highest")
    # enter cudnn: held? no; save (cuda/all was read above); apply
    _C._get_cudnn_allow_tf32()
    g("cuda", "conv")
    g("cuda", "rnn")
    _C._set_cudnn_allow_tf32(False)
    noop()
    # exit cudnn: still held? then restore
    _C._get_cudnn_allow_tf32()
    g("cuda", "all")
    _C._set_cudnn_allow_tf32(True)
    # exit matmul: still held? then restore
    _C._get_float32_matmul_precision()
    _C._set_float32_matmul_precision("high")


def legacy_floor_switch_both() -> None:
    """The same, on a torch without the per-backend API (before 2.9): the legacy calls alone.

    There the legacy enum and bool are the whole state: enter reads and writes each field,
    exit reads (still held?) and writes back.
    """
    _C._get_float32_matmul_precision()
    _C._set_float32_matmul_precision("highest")
    _C._get_cudnn_allow_tf32()
    _C._set_cudnn_allow_tf32(False)
    noop()
    _C._get_cudnn_allow_tf32()
    _C._set_cudnn_allow_tf32(True)
    _C._get_float32_matmul_precision()
    _C._set_float32_matmul_precision("high")


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0915  (one flat script)
    """Measure, print the figures and ratios (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    n, r = args.number, args.repeats

    default = Fp32Precision("high", True)
    full = Fp32Precision("highest", False)
    matmul_only = Fp32Precision("highest", None)
    fp32scope.set_process_default(default)

    def scope_both() -> None:
        with fp32_precision_scope(full):
            noop()

    def scope_matmul() -> None:
        with fp32_precision_scope(matmul_only):
            noop()

    def scope_fast() -> None:
        with fp32_precision_scope(default):
            noop()

    def cudnn_flags() -> None:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            noop()

    decorated = with_fp32_precision(full)(noop)  # an in-graph region under torch.compile (the default)
    decorated_break = with_fp32_precision(full, in_graph=False)(noop)

    class Tiny(torch.nn.Module):
        def forward(self) -> None:
            return None

    bare_module = Tiny()
    proxy = Fp32ScopedModule(bare_module, full)  # an in-graph region under torch.compile (the default)
    break_proxy = Fp32ScopedModule(bare_module, full, in_graph=False)  # a graph break under torch.compile
    reused = fp32_precision_scope(full)
    reused_fast = fp32_precision_scope(default)

    def bare_scope_fast() -> None:
        with reused_fast:
            noop()

    def bare_scope_both() -> None:
        with reused:
            noop()

    def call_module() -> None:
        bare_module()

    def call_proxy() -> None:
        proxy()

    def scope_module() -> None:
        with reused:
            bare_module()

    no_grad = torch.no_grad()

    def call_proxy_no_grad() -> None:
        with no_grad:
            proxy()

    def call_break_proxy_no_grad() -> None:
        with no_grad:
            break_proxy()

    def scope_module_no_grad() -> None:
        with no_grad, reused:
            bare_module()

    class TinyArg(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            del x

    bare_arg = TinyArg()
    autocast_off = Fp32ScopedModule(bare_arg, full, autocast=False)
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    bf16_autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    def call_autocast_off() -> None:
        with no_grad, bf16_autocast:
            autocast_off(bf16)

    def by_hand_autocast_off() -> None:
        # What a hand-written float32 sub-module does: autocast off, the input cast, the scope.
        with no_grad, bf16_autocast, torch.autocast("cpu", enabled=False), reused:
            bare_arg(bf16.float())

    def autocast_only() -> None:
        with no_grad, bf16_autocast:
            noop()

    def call_proxy_traced() -> None:
        with no_grad:
            proxy()

    def observer_checks() -> None:
        # What every scoped call adds for trace() and the profiler when neither records: on
        # entry the list of open traces and torch's profiler flag, on exit the list of open
        # ranges; the same global reads as the scope's.
        if _traces or _profiler_state["_is_profiler_enabled"]:
            noop()
        if _ranges:
            noop()
        noop()

    # Each feature, on: under autocast (a node that keeps the caller's autocast; its one
    # warning is given before the timing), inside a profiler (a fresh one per timing loop,
    # below), and the parameter-dtype check a full-float32 node makes on its first call.
    keeps_autocast = Fp32ScopedModule(bare_arg, full)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with bf16_autocast:
            keeps_autocast(bf16)

    def proxy_under_autocast() -> None:
        with no_grad, bf16_autocast:
            keeps_autocast(bf16)

    def scope_under_autocast() -> None:
        with no_grad, bf16_autocast, reused:
            bare_arg(bf16)

    def proxy_with_an_argument() -> None:
        with no_grad:
            keeps_autocast(bf16)

    def scope_with_an_argument() -> None:
        with no_grad, reused:
            bare_arg(bf16)

    def proxy_profiled() -> None:
        with no_grad:
            proxy()

    def scope_profiled() -> None:
        with no_grad, reused:
            bare_module()

    linear = torch.nn.Linear(16, 16)

    def parameter_check() -> None:
        warn_low_precision_parameters(linear, full, "Linear")

    def own_attribute_read() -> None:
        proxy._self_check_parameters  # noqa: B018  (the read each call makes for the check)

    cases: dict[str, Callable[[], object]] = {
        "bare no-op call": noop,
        "floor: raw _C calls of an exact switch, inline": (
            floor_switch_both if _flags.HAS_NEW_API else legacy_floor_switch_both
        ),
        "fp32_precision_scope, both fields switch": scope_both,
        "fp32_precision_scope, matmul only switches": scope_matmul,
        "fp32_precision_scope, flags already match (fast path)": scope_fast,
        "torch.backends.cudnn.flags(allow_tf32=False)": cudnn_flags,
        "one scope object reused, both switch": bare_scope_both,
        # A kept scope learns that its entries find the flags held and checks just that:
        # what every call of a wrapper (proxy, decorator) whose precision is held runs.
        "one scope object reused, flags already match (fast path)": bare_scope_fast,
        "with_fp32_precision-decorated no-op, both switch": decorated,
        "with_fp32_precision(in_graph=False)-decorated no-op, both switch": decorated_break,
        "bare nn.Module call": call_module,
        "Fp32ScopedModule call, both switch": call_proxy,
        "one scope object reused around the bare nn.Module call": scope_module,
        "Fp32ScopedModule call under no_grad, both switch": call_proxy_no_grad,
        "Fp32ScopedModule(in_graph=False) call under no_grad, both switch": call_break_proxy_no_grad,
        "one scope object reused around the bare nn.Module call, under no_grad": scope_module_no_grad,
        # While a trace() is open every scoped call reads the flags and appends an event; a
        # fresh trace is opened around each timing loop (below).
        "Fp32ScopedModule call under no_grad, both switch, inside fp32scope.trace()": call_proxy_traced,
        "the trace/profiler checks of a scoped call, neither recording": observer_checks,
        # Part of every wrapper call: whether a compiled caller's Dynamo is active (then the
        # wrapped callable is compiled in the scope; see fp32scope._wrappers.trampoline).
        "reading Dynamo's frame callback (one C call)": active_callback,
        # Part of every wrapper call: whether any autocast is on (then see fp32scope._wrappers.autocast).
        "reading whether any autocast is on (one C call)": any_autocast,
        # Part of every wrapper call: whether grad mode is on (then its backward is scoped too).
        "reading whether grad mode is on (one C call)": grad_enabled,
        "no_grad + torch.autocast('cpu', bf16) around a no-op": autocast_only,
        "Fp32ScopedModule(autocast=False) under no_grad + autocast, one bf16 argument": call_autocast_off,
        "by hand: autocast(enabled=False) + x.float() + reused scope, same call": by_hand_autocast_off,
        "Fp32ScopedModule call keeping the caller's autocast, under no_grad + autocast": proxy_under_autocast,
        "one scope object reused around the bare call, under no_grad + autocast": scope_under_autocast,
        "the same proxy call with its bf16 argument, under no_grad, no autocast": proxy_with_an_argument,
        "one scope object reused around the same bare call, under no_grad, no autocast": scope_with_an_argument,
        "Fp32ScopedModule call under no_grad, inside torch.profiler.profile()": proxy_profiled,
        "one scope object reused around the bare nn.Module call, under no_grad, inside the profiler": scope_profiled,
        "the parameter-dtype check of a first call, Linear(16, 16) in float32": parameter_check,
        "one read of the proxy's own attribute (the check's flag)": own_attribute_read,
    }
    profiled = {
        "Fp32ScopedModule call under no_grad, inside torch.profiler.profile()",
        "one scope object reused around the bare nn.Module call, under no_grad, inside the profiler",
    }
    # Interleave repeats across cases so that a noisy stretch hits every case alike.
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm up (first calls import, allocate, mark code for Dynamo)
    before = _flags.read_all()
    traced = "Fp32ScopedModule call under no_grad, both switch, inside fp32scope.trace()"
    for _ in range(r):
        for name, fn in cases.items():
            if name == traced:
                with fp32scope.trace() as events:
                    samples[name].append(median_ns(fn, n, 1))
                if len(events) != n:
                    print(f"error: the trace holds {len(events)} events for {n} calls", file=sys.stderr)
                    return 1
                continue
            if name in profiled:
                # A fresh profiler per loop, of fewer calls: it keeps every event it records.
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                    samples[name].append(median_ns(fn, max(1, n // 10), 1))
                continue
            samples[name].append(median_ns(fn, n, 1))
    if _flags.read_all() != before:
        print("error: the benchmark left the flags changed", file=sys.stderr)
        return 1
    med = {name: statistics.median(values) for name, values in samples.items()}

    def paired(name: str, baseline: str) -> float:
        """The median, over the loops, of ``name`` minus ``baseline`` timed next to it in the same loop.

        A difference of two figures that are each much larger than it (a proxy call against
        the same call's scope): the pair's loops run one after the other, so a slow stretch
        of the machine shifts both, where the difference of the two medians keeps it.
        """
        return statistics.median(a - b for a, b in zip(samples[name], samples[baseline], strict=True))

    bare = med["bare no-op call"]
    floor = med["floor: raw _C calls of an exact switch, inline"] - bare
    switch = med["fp32_precision_scope, both fields switch"] - bare
    matmul = med["fp32_precision_scope, matmul only switches"] - bare
    fast = med["fp32_precision_scope, flags already match (fast path)"] - bare
    cudnn = med["torch.backends.cudnn.flags(allow_tf32=False)"] - bare
    kept_switch = med["one scope object reused, both switch"] - bare
    kept_fast = med["one scope object reused, flags already match (fast path)"] - bare
    proxy_over = paired("Fp32ScopedModule call, both switch", "one scope object reused around the bare nn.Module call")
    # In grad mode the proxy also checks whether the call records autograd history (to scope
    # its backward): the no_grad pair shows the proxy alone, as an inference engine calls it.
    proxy_no_grad_over = paired(
        "Fp32ScopedModule call under no_grad, both switch",
        "one scope object reused around the bare nn.Module call, under no_grad",
    )
    region_over = paired(
        "Fp32ScopedModule call under no_grad, both switch",
        "Fp32ScopedModule(in_graph=False) call under no_grad, both switch",
    )
    region_decorated_over = paired(
        "with_fp32_precision-decorated no-op, both switch",
        "with_fp32_precision(in_graph=False)-decorated no-op, both switch",
    )
    decorated_over = paired("with_fp32_precision-decorated no-op, both switch", "one scope object reused, both switch")

    print(f"torch {torch.__version__}, fp32scope {fp32scope.__version__}, new API: {_flags.HAS_NEW_API}")
    print(f"median of {r} loops x {n} calls, ns per call")
    width = max(map(len, med))
    for name, value in med.items():
        print(f"  {name:<{width}}  {value:9.1f}")
    ratios = {
        # A kept scope: what each call of a wrapper (an engine's node) runs.
        "kept scope: switch overhead (both) / floor overhead [goal <= 2.4; aim 2]": kept_switch / floor,
        "kept scope: fast-path overhead / switch overhead [goal <= 0.6]": kept_fast / kept_switch,
        # A new scope per `with`: the same, plus making the scope object.
        "new scope per call: switch overhead (both) / floor overhead": switch / floor,
        "new scope per call: fast-path overhead / switch overhead": fast / switch,
        "switch overhead (both) / cudnn.flags() overhead [goal <= 0.25]": switch / cudnn,
        "matmul-only overhead / switch overhead": matmul / switch,
    }
    print("overheads (minus the bare call), ns:")
    print(f"  floor {floor:.1f}; switch both {switch:.1f}; matmul only {matmul:.1f}; fast path {fast:.1f}")
    print(f"  kept scope: switch both {kept_switch:.1f}; fast path {kept_fast:.1f}")
    print(f"  cudnn.flags() {cudnn:.1f}")
    print(f"  proxy on top of the scope around the same call, under no_grad {proxy_no_grad_over:.1f} [goal <= 150]")
    print(f"  proxy on top of the scope around the same call, grad mode {proxy_over:.1f}")
    print(f"  a region proxy (the default) on top of an in_graph=False one, under no_grad {region_over:.1f}")
    traced_over = med[traced] - med["Fp32ScopedModule call under no_grad, both switch"]
    print(f"  a proxy call inside fp32scope.trace(), on top of the same call outside it {traced_over:.1f}")
    print(f"  decorator on top of the scope around the same call {decorated_over:.1f}")
    print(f"  a region decorator (the default) on top of an in_graph=False one {region_decorated_over:.1f}")
    checks = med["the trace/profiler checks of a scoped call, neither recording"] - bare
    print(f"  the trace/profiler checks of a scoped call, neither recording {checks:.1f}")
    callback = med["reading Dynamo's frame callback (one C call)"]
    print(f"  of which reading Dynamo's frame callback (the call itself, not minus the bare call) {callback:.1f}")
    autocast_read = med["reading whether any autocast is on (one C call)"]
    print(f"  of which reading whether autocast is on (likewise) {autocast_read:.1f}")
    grad_read = med["reading whether grad mode is on (one C call)"]
    print(
        "  the proxy's three C reads alone (autocast, grad mode, Dynamo's callback: part of the proxy's "
        f"figure above) {autocast_read + grad_read + callback:.1f}"
    )
    autocast_region = med["no_grad + torch.autocast('cpu', bf16) around a no-op"]
    off_over = med["Fp32ScopedModule(autocast=False) under no_grad + autocast, one bf16 argument"] - autocast_region
    hand_over = med["by hand: autocast(enabled=False) + x.float() + reused scope, same call"] - autocast_region
    print(f"  autocast=False call under autocast (minus the autocast region) {off_over:.1f}; by hand {hand_over:.1f}")
    print("each feature's cost per scoped call, off -> on, ns (on: the proxy's call minus the same call's scope around")
    print("the bare module, both with the feature on):")
    checks_off = checks
    trace_on = traced_over
    prof_on = (
        paired(
            "Fp32ScopedModule call under no_grad, inside torch.profiler.profile()",
            "one scope object reused around the bare nn.Module call, under no_grad, inside the profiler",
        )
        - proxy_no_grad_over
    )
    autocast_on = paired(
        "Fp32ScopedModule call keeping the caller's autocast, under no_grad + autocast",
        "one scope object reused around the bare call, under no_grad + autocast",
    ) - paired(
        "the same proxy call with its bf16 argument, under no_grad, no autocast",
        "one scope object reused around the same bare call, under no_grad, no autocast",
    )
    read = med["one read of the proxy's own attribute (the check's flag)"] - bare
    check_once = med["the parameter-dtype check of a first call, Linear(16, 16) in float32"] - bare
    print(f"  trace(): off {checks_off:.1f} (the trace/profiler checks, shared); on +{trace_on:.1f}")
    print(f"  profiler: off (the same checks); on +{prof_on:.1f} (its range, beside the profiler's own cost)")
    print(f"  autocast: off {autocast_read - bare:.1f} (reading whether any is on); on +{autocast_on:.1f}")
    print(f"  parameter-dtype check: off {read:.1f} (one attribute read); on {check_once:.1f}, once per node")
    feature_costs = {
        "trace_on_ns": trace_on,
        "profiler_on_ns": prof_on,
        "autocast_off_ns": autocast_read - bare,
        "autocast_on_ns": autocast_on,
        "parameter_check_off_ns": read,
        "parameter_check_once_ns": check_once,
        "observer_checks_off_ns": checks_off,
    }
    print("ratios:")
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}")
    if args.json:
        figures = {
            "proxy_over_ns": proxy_over,
            "proxy_no_grad_over_ns": proxy_no_grad_over,
            "autocast_off_over_ns": off_over,
            "autocast_off_by_hand_over_ns": hand_over,
        }
        print(json.dumps({"median_ns": med, "ratios": ratios, **figures, **feature_costs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
