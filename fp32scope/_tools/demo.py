"""``python -m fp32scope demo``: an inference engine's run, in miniature.

Three nodes, each a small ``torch.compile``'d MLP, form a pipeline; the last one (``head``)
declares full float32 on its class. The engine sets the process default once, loads each
node's declaration with ``node_fp32_precision``, wraps the compiled module in
``Fp32ScopedModule``, and runs every forward (a warmup pass, then the measured steps) on one
dedicated forward thread. Per node it shows the precision read inside the node's call, the
process state before and after the call, how many graphs were compiled and recompiled,
and, where the device shows a numeric effect of the default, each node's error against a
float64 reference. On CUDA (``--device cuda``) each node is also captured in a CUDA graph
inside its scope, and the measured steps replay the graphs.

On a torch whose Dynamo turns a "medium" default into "high" whenever it compiles a frame
(2.4 to 2.8; ``dynamo_resets_medium`` in ``_dynamo_exclude``), the engine with a
"medium" default also scopes the nodes that declare nothing, with the default, so that
every call starts from "medium" again, and the output says why.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch

from fp32scope._export.cuda_graphs import capture_cuda_graph
from fp32scope._flags import torch_flags
from fp32scope._flags.dynamo_exclude import dynamo_resets_medium
from fp32scope._flags.precision import MATMUL_PRECISIONS, Fp32Precision
from fp32scope._flags.process import current_fp32_precision, set_process_default
from fp32scope._flags.scope import fp32_precision_scope
from fp32scope._wrappers.node import node_fp32_precision
from fp32scope._wrappers.policy import scope_modules
from fp32scope._wrappers.proxy import Fp32ScopedModule
from fp32scope._wrappers.trace import Fp32Trace, Fp32TraceEvent, trace

__all__ = ["DESCRIPTION", "EPILOG", "DemoResult", "NodeResult", "add_arguments", "render", "run", "run_demo"]

_FORWARD_THREAD = "fp32scope-forward"
_BATCH = 64
_FEATURES = 512
_STEPS = 3
_FULL_FP32 = Fp32Precision("highest", False)
_TRACE_TITLE = "fp32scope.trace() of the first request (it compiles the nodes; nodes without a scope make no event):"
_RECOMPILE_METHOD = (
    "a counting wrapper around the backend: graphs compiled during the warmup pass, and "
    "recompiles = graphs compiled after it"
)


class Embed(torch.nn.Module):
    """Node 1: a two-layer MLP; declares nothing, so it runs with the process default."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(_FEATURES // 2, _FEATURES)
        self.mix = torch.nn.Linear(_FEATURES, _FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed ``x``."""
        out: torch.Tensor = self.mix(torch.nn.functional.gelu(self.up(x)))
        return out


class Body(torch.nn.Module):
    """Node 2: a residual MLP block; declares nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(_FEATURES, _FEATURES)
        self.fc2 = torch.nn.Linear(_FEATURES, _FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One residual block."""
        out: torch.Tensor = x + self.fc2(torch.relu(self.fc1(x)))
        return out


class Head(torch.nn.Module):
    """Node 3: needs full float32 (say, a numerically sensitive output), and declares it."""

    float32_matmul_precision = "highest"
    cudnn_allow_tf32 = False

    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(_FEATURES, _FEATURES // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project ``x`` to the output."""
        return torch.tanh(self.out(x))


_NODES: tuple[tuple[str, type[torch.nn.Module]], ...] = (("embed", Embed), ("body", Body), ("head", Head))


class _CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it is asked to compile."""

    def __init__(self, backend: str) -> None:
        from torch._dynamo import lookup_backend

        self._inner = lookup_backend(backend)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        self.graphs += 1
        return self._inner(gm, example_inputs)


@dataclasses.dataclass
class NodeResult:
    """What the demo measured for one node."""

    name: str
    declared: Fp32Precision | None
    expected: Fp32Precision
    ran_with: Fp32Precision | None = None
    forward_thread: str | None = None
    before: Fp32Precision | None = None
    after: Fp32Precision | None = None
    graphs: int = 0
    recompiles: int = 0
    max_abs_error: float | None = None
    full_fp32_error: float | None = None
    cuda_graph: bool = False

    @property
    def ok(self) -> bool:
        """True when the node ran with its expected precision, left the default, and never recompiled."""
        return (
            self.ran_with == self.expected
            and self.before == self.after
            and self.recompiles == 0
            and self.forward_thread is not None
            and self.forward_thread.startswith(_FORWARD_THREAD)
        )


@dataclasses.dataclass
class DemoResult:
    """The whole run: its settings, the per-node results, and the numeric-effect probe."""

    device: str
    backend: str
    default: Fp32Precision
    steps: int
    nodes: list[NodeResult]
    graph_breaks: int
    recompile_counting: str
    effect_probe_max_abs_diff: float
    warmup_s: float
    steps_s: float
    dynamo_resets_medium: bool | None = None
    nodes_scoped_with_default: bool = False
    #: fp32scope.trace() of the first request (the warmup pass, which compiles each node).
    trace: list[Fp32TraceEvent] = dataclasses.field(default_factory=list)

    @property
    def numeric_effect(self) -> bool:
        """Whether the default gives different float32 matmul results from full fp32 on this device."""
        return self.effect_probe_max_abs_diff > 0.0

    @property
    def ok(self) -> bool:
        """True when every node is ok, ran from the process default, and no graph broke."""
        nodes_ok = all(node.ok and node.before == self.default for node in self.nodes)
        return self.graph_breaks == 0 and nodes_ok and all(event.matches for event in self.trace)

    def as_json(self) -> dict[str, Any]:
        """The result as JSON-ready data (the ``--json`` output)."""
        data = dataclasses.asdict(self)
        data["numeric_effect"] = self.numeric_effect
        data["ok"] = self.ok
        data["trace"] = [event._asdict() for event in self.trace]
        for node, raw in zip(self.nodes, data["nodes"], strict=True):
            raw["ok"] = node.ok
        converted: dict[str, Any] = _precisions_as_dicts(data)
        return converted


def _precisions_as_dicts(value: Any) -> Any:
    # dataclasses.asdict keeps NamedTuples as tuples; name their fields in the JSON.
    if isinstance(value, Fp32Precision):
        return value._asdict()
    if isinstance(value, dict):
        return {k: _precisions_as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_precisions_as_dicts(v) for v in value]
    return value


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _effect_probe(default: Fp32Precision, device: torch.device) -> float:
    # The device decides whether the default changes float32 results at all ("high" is TF32
    # on Ampere+ GPUs, but changes nothing on most CPUs): compare one matmul both ways.
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(256, 256, generator=generator).to(device)
    b = torch.randn(256, 256, generator=generator).to(device)
    with fp32_precision_scope(default):
        reduced = a @ b
    with fp32_precision_scope(_FULL_FP32):
        full = a @ b
    return float((reduced - full).abs().max())


def _expected(declared: Fp32Precision | None, default: Fp32Precision) -> Fp32Precision:
    # A declared field replaces the default's; a field left None keeps it.
    if declared is None:
        return default
    return Fp32Precision(
        declared.matmul if declared.matmul is not None else default.matmul,
        declared.cudnn_allow_tf32 if declared.cudnn_allow_tf32 is not None else default.cudnn_allow_tf32,
    )


class _Node:
    """One loaded node: the scoped compiled module, its counting backend, and its float64 twin."""

    def __init__(  # noqa: PLR0913
        self,
        name: str,
        module: torch.nn.Module,
        backend: str,
        default: Fp32Precision,
        *,
        scope_default: bool,
        policy: dict[str, Fp32Precision] | None = None,
    ) -> None:
        self.eager = module
        self.reference = copy.deepcopy(module).to("cpu", torch.float64)
        self.counter = _CountingBackend(backend)
        # torch.compile returns the module's OptimizedModule (typed as a plain callable).
        compiled = cast("torch.nn.Module", torch.compile(module, backend=self.counter))
        # With a policy (--policy), the policy decides the node's precision, not its class.
        declared = node_fp32_precision(name, compiled) if policy is None else policy.get(name)
        expected = _expected(declared, default)
        # scope_default: the node's scope also applies the default's fields it does not
        # declare, so that a default Dynamo changed while compiling is put back after each call.
        self.scoped = Fp32ScopedModule(compiled, expected if scope_default else declared, name=name)
        self.result = NodeResult(name, declared, expected)
        # A pre-hook on the compiled module runs eagerly inside the node's call, within its
        # scope and before the compiled graph: a read inside the compiled forward itself
        # would be a graph break.
        self.scoped.register_forward_pre_hook(self._record)
        self.call: Callable[[torch.Tensor], torch.Tensor] = self.scoped

    def _record(self, _module: torch.nn.Module, _args: tuple[Any, ...]) -> None:
        self.result.ran_with = Fp32Precision(
            torch.get_float32_matmul_precision(),  # type: ignore[arg-type]
            torch.backends.cudnn.allow_tf32,
        )
        self.result.forward_thread = threading.current_thread().name


def _warmup(nodes: list[_Node], x: torch.Tensor) -> None:
    with torch.inference_mode():
        for node in nodes:
            x = node.scoped(x)
    for node in nodes:
        node.result.graphs = node.counter.graphs


def _capture(nodes: list[_Node], x: torch.Tensor) -> None:
    # Warmup and capture run inside each node's scope (capture_cuda_graph takes the
    # precision from the proxy): the kernels are chosen, TF32 or not, when captured.
    with torch.inference_mode():
        for node in nodes:
            graph = capture_cuda_graph(node.scoped, [x.clone()])
            node.call = graph
            node.result.cuda_graph = True
            x = graph.static_output.clone()


def _max_abs_diff(a: torch.Tensor, reference: torch.Tensor) -> float:
    return float((a.to("cpu", torch.float64) - reference).abs().max())


def _step(nodes: list[_Node], x: torch.Tensor, measure_error: bool) -> None:
    with torch.inference_mode():
        for node in nodes:
            node.result.before = current_fp32_precision()
            y = node.call(x).clone()
            node.result.after = current_fp32_precision()
            if measure_error:
                # The same node, eager and in full float32 on the same input: the error the
                # node would have without the default's reduced precision.
                with fp32_precision_scope(_FULL_FP32):
                    full = node.eager(x)
                reference = node.reference(x.to("cpu", torch.float64))
                node.result.max_abs_error = _max_abs_diff(y, reference)
                node.result.full_fp32_error = _max_abs_diff(full, reference)
            x = y


def _node_policy(policy: Mapping[Any, Any]) -> dict[str, Fp32Precision]:
    # The precision a policy (as fp32scope.scope_modules takes it) gives each node. Its
    # selectors select whole nodes: one that selects none, or a part of one ("body.fc2"), is
    # a ValueError.
    nodes = torch.nn.ModuleDict({name: cls() for name, cls in _NODES})
    chosen = scope_modules(nodes, policy)
    inside = [name for name in chosen if "." in name]
    if inside:
        msg = (
            f"the demo's policy selects whole nodes ({', '.join(name for name, _ in _NODES)}); it selects "
            f"{', '.join(map(repr, inside))} inside one."
        )
        raise ValueError(msg)
    return chosen


def run_demo(
    *,
    default: str = "high",
    backend: str = "inductor",
    device: str = "cpu",
    steps: int = _STEPS,
    policy: Mapping[Any, Any] | None = None,
) -> DemoResult:
    """Run the demo and return what it measured; the caller's flags are restored afterwards.

    Resets Dynamo's caches first, so that every node compiles afresh and the counts are
    this run's own. ``policy`` (as :func:`~fp32scope.scope_modules` takes it, selecting whole
    nodes) decides the nodes' precisions instead of their declarations.
    """
    chosen = None if policy is None else _node_policy(policy)
    if default not in MATMUL_PRECISIONS:
        msg = f"default must be one of {', '.join(map(repr, MATMUL_PRECISIONS))}; got {default!r}."
        raise ValueError(msg)
    if steps < 1:
        msg = f"steps must be at least 1; got {steps}."
        raise ValueError(msg)
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        msg = "device is CUDA, but torch.cuda.is_available() is False on this machine."
        raise RuntimeError(msg)
    # Before anything is counted: the probe compiles a function of its own (once per process).
    resets = dynamo_resets_medium() if default == "medium" else None
    saved = torch_flags.save_raw_state()
    torch._dynamo.reset()
    breaks_before = _graph_breaks()
    try:
        precision = Fp32Precision(default, True)  # type: ignore[arg-type]
        set_process_default(precision)
        torch.manual_seed(0)
        nodes = [
            _Node(name, cls().to(target), backend, precision, scope_default=bool(resets), policy=chosen)
            for name, cls in _NODES
        ]
        x = torch.randn(_BATCH, _FEATURES // 2, generator=torch.Generator().manual_seed(0)).to(target)
        # An engine runs all forwards on one thread: the flags are process-wide, and
        # fp32scope refuses a scope on a second thread while one is active.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix=_FORWARD_THREAD) as forward:
            start = time.perf_counter()
            with trace() as first_request:
                forward.submit(_warmup, nodes, x).result()
            if target.type == "cuda" and torch.cuda.is_available():
                forward.submit(_capture, nodes, x).result()
            warmup_s = time.perf_counter() - start
            probe = forward.submit(_effect_probe, precision, target).result()
            start = time.perf_counter()
            for _ in range(steps):
                forward.submit(_step, nodes, x, probe > 0.0).result()
            steps_s = time.perf_counter() - start
        for node in nodes:
            node.result.recompiles = node.counter.graphs - node.result.graphs
        return DemoResult(
            device=str(target),
            backend=backend,
            default=precision,
            steps=steps,
            nodes=[node.result for node in nodes],
            graph_breaks=_graph_breaks() - breaks_before,
            recompile_counting=_RECOMPILE_METHOD,
            effect_probe_max_abs_diff=probe,
            warmup_s=warmup_s,
            steps_s=steps_s,
            dynamo_resets_medium=resets,
            nodes_scoped_with_default=bool(resets),
            trace=first_request,
        )
    finally:
        torch_flags.restore_raw_state(saved)


def _show(precision: Fp32Precision | None, none: str = "-") -> str:
    if precision is None:
        return none
    cudnn = {None: "", True: "/cudnn-tf32", False: "/cudnn-fp32"}[precision.cudnn_allow_tf32]
    return f"{precision.matmul or '-'}{cudnn}"


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def render(result: DemoResult) -> str:
    """The result as the short table the ``demo`` command prints."""
    r = result
    header = ["node", "declares", "ran with", "before call", "after call", "graphs", "recompiles"]
    if r.numeric_effect:
        # Only where the default changes float32 results on this device: elsewhere both
        # columns would read the same for every node.
        header += ["error vs float64", "same, in full fp32"]
    rows = [header]
    for n in r.nodes:
        row = [n.name, _show(n.declared, "nothing"), _show(n.ran_with), _show(n.before), _show(n.after)]
        row += [str(n.graphs), str(n.recompiles)]
        if r.numeric_effect:
            row += [_error(n.max_abs_error), _error(n.full_fp32_error)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    thread = r.nodes[0].forward_thread if r.nodes else None
    captured = ", CUDA graph capture" if any(n.cuda_graph for n in r.nodes) else ""
    lines = [
        (
            f"fp32scope demo: {len(r.nodes)} torch.compile'd nodes, backend {r.backend!r}, device {r.device}, "
            f"forwards on thread {thread!r}"
        ),
        f"process default: {_show(r.default)} (fp32scope.set_process_default, once at start-up)",
        f"warmup (compiles{captured}) {r.warmup_s:.1f} s; {r.steps} measured steps {r.steps_s:.3f} s",
        "",
        *table,
        "",
        (
            "Each precision reads matmul precision/cuDNN TF32. 'ran with' is read inside the node's call; "
            "'before call' and 'after call' are the process's precision around it. 'graphs' and 'recompiles' "
            f"count what torch.compile compiled at the first call and after it; graph breaks: {r.graph_breaks}."
        ),
    ]
    if r.numeric_effect:
        lines.append(
            f"At default {r.default.matmul!r} a 256x256 float32 matmul on {r.device} differs from 'highest' by up "
            f"to {r.effect_probe_max_abs_diff:.1e}. 'error vs float64': the largest difference between the "
            "node's output and a float64 copy of the node on the same input; 'same, in full fp32': that "
            "error for the node run eagerly in full float32."
        )
    else:
        elsewhere = "--device cuda on an Ampere-or-newer GPU shows one"
        if r.default.matmul != "medium":
            elsewhere = f"--default medium on a CPU with bf16 matmuls, or {elsewhere}"
        lines.append(
            f"No error columns: at default {r.default.matmul!r} a 256x256 float32 matmul on {r.device} gives "
            f"bit-identical results to 'highest', so every node's error would be the same under both "
            f"({elsewhere})."
        )
    if r.nodes_scoped_with_default:
        lines.append(
            f"torch {torch.__version__}: every torch.compile (Dynamo) compile turns a 'medium' default into "
            "'high' (Dynamo writes the cuBLAS TF32 flag back through a setter that writes 'high'; torch 2.4 to "
            "2.8). So this engine also scopes the nodes that declare nothing, with the default: each call "
            "starts from 'medium' again (a node's compiling call itself runs under 'high'). Without that, "
            "every node after the first compile would run 'high'. See 'A medium default on torch 2.4 to 2.8' "
            "in the compiled-code guide."
        )
    lines += ["", _TRACE_TITLE, str(Fp32Trace(r.trace))]
    lines.append("all nodes ok." if r.ok else "PROBLEM: a node ran with the wrong precision, recompiled, or broke.")
    return "\n".join(lines)


#: The ``demo --help`` text: plain text for a terminal.
DESCRIPTION = """\
Run an inference engine in miniature: three small torch.compile'd nodes in a
pipeline, every forward on one forward thread. The last node, head, declares
full float32; the others run with the process default. The engine sets the
default once, reads each node's declaration (fp32scope.node_fp32_precision) and
wraps each compiled node in fp32scope.Fp32ScopedModule.

Per node the table shows the precision it declares, the precision it ran with
(read inside its call), the process's precision before and after each call,
the graphs torch.compile made and any recompiles, and, where the default
changes float32 results on the device, each node's error against float64.
With --device cuda each node is also captured in a CUDA graph inside its
scope, and the measured steps replay the graphs."""

#: The ``demo --help`` closing lines.
EPILOG = """\
exit status: 0 when every node ran with its precision, left the default as it
found it and compiled once; 1 otherwise; 2 for a bad option."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` command's options to ``parser``."""
    parser.add_argument(
        "--default",
        choices=MATMUL_PRECISIONS,
        default="high",
        help="the process default matmul precision (default: high; on a bf16-capable CPU, medium shows an effect)",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device (default: cpu)")
    parser.add_argument("--steps", type=int, default=_STEPS, help=f"measured steps after warmup (default: {_STEPS})")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--policy",
        metavar="FILE.json",
        help=(
            "a JSON object mapping node selectors (names, 're:' patterns) to precisions, as "
            "fp32scope.scope_modules takes them; replaces the nodes' declarations"
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo and print it; 0 when every node behaved, 1 otherwise, 2 for a bad request."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fp32scope demo: --device cuda, but torch.cuda.is_available() is False on this machine.", file=sys.stderr)
        return 2
    backends = torch._dynamo.list_backends(exclude_tags=())
    if args.backend not in backends:
        known = ", ".join(backends)
        print(f"fp32scope demo: unknown --backend {args.backend!r}; torch.compile knows {known}.", file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"fp32scope demo: --steps must be at least 1; got {args.steps}.", file=sys.stderr)
        return 2
    policy = None
    if args.policy is not None:
        try:
            policy = json.loads(Path(args.policy).read_text())
            _node_policy(policy)
        except (OSError, ValueError, TypeError) as error:
            print(f"fp32scope demo: --policy {args.policy}: {error}", file=sys.stderr)
            return 2
    result = run_demo(default=args.default, backend=args.backend, device=args.device, steps=args.steps, policy=policy)
    print(json.dumps(result.as_json(), indent=2) if args.json else render(result))
    return 0 if result.ok else 1
