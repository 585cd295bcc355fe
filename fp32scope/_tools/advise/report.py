"""What :func:`~fp32scope.advise` found, and how it is shown: the table, the chart, JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, NamedTuple

import torch

from fp32scope._flags.precision import Fp32Precision
from fp32scope._wrappers.policy import scope_modules

__all__ = ["FULL_FLOAT32", "Fp32Advice", "Fp32AdviceNode"]

#: The precision every kept node gets, as JSON holds it: full float32 for matmuls and cuDNN.
FULL_FLOAT32: dict[str, Any] = {"matmul": "highest", "cudnn_allow_tf32": False}

#: What ``to_json`` writes under "format"; ``from_json`` refuses any other.
JSON_FORMAT = "fp32scope.advice/1"
#: The chart draws at most this many nodes one per line; the rest share one line.
CHART_ROWS = 40

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class Fp32AdviceNode(NamedTuple):
    """One candidate node of :func:`advise`: what it is, what it costs, and how sensitive it is."""

    #: Qualified name, as ``model.named_modules()`` gives it.
    name: str
    #: The module's class name.
    type: str
    #: Parameters held by the node and its submodules (each tensor once).
    parameters: int
    #: Share of the model's FLOPs (torch's FLOP counter) run by the node and its submodules: their
    #: forward, and with a loss the backward of that forward too.
    flop_share: float
    #: The error with only this node's own work fast and every other candidate's in full float32
    #: (with ``compile=``: the model run eagerly at the reference's setting with only this node
    #: compiled, its candidate submodules kept eager; nan where not measured: every node fast
    #: met the tolerance / margin).
    sensitivity: float
    #: Whether the advised policy keeps it (in full float32, or eager with ``reference="eager"``).
    kept: bool


@dataclasses.dataclass(frozen=True)
class Fp32Advice:
    """What :func:`advise` found: the policy, the errors measured with and without it, and each node.

    ``policy`` is ``{qualified name: {"matmul": "highest", "cudnn_allow_tf32": False}}``
    (with ``compile=``, the rule also says ``"eager": True``: a full float32 node run as eager
    runs it, an in-graph region of the compiled model; with ``reference="eager"``, the value
    is the string ``"eager"``: the node runs as eager runs it), a mapping
    :func:`~fp32scope.scope_modules` takes as it is or after a round trip through JSON;
    ``autocast`` is what to pass to it with the policy (False when the model runs under
    ``torch.autocast`` and the kept nodes are full float32: they then run without it; else
    None). With ``compile``, compile the model after scoping it, with those
    arguments, as the advice measured it.

    What it promises: on every batch it was given (calibration and held-out) the policy's
    error, measured through :func:`~fp32scope.scope_modules`, is ``batch_errors``; ``met``
    says each is within ``tolerance``. It cannot promise anything for data it never saw.
    """

    #: {qualified name: full float32, or "eager"}, JSON-ready; empty when every node may run fast.
    policy: dict[str, Any]
    #: The ``autocast`` argument of :func:`~fp32scope.scope_modules` for this policy.
    autocast: bool | None
    #: The error with the policy applied (through scope_modules), the largest over the calibration batches.
    error: float
    #: The error with every node at the fast precision (no policy), the largest over the calibration batches.
    fast_error: float
    #: The tolerance the policy was searched for.
    tolerance: float
    #: Whether the policy's error is within the tolerance on every batch, calibration and held-out.
    met: bool
    #: How many times the model (or ``run``) was called: one call per batch, each setting.
    runs: int
    #: Seconds :func:`advise` took.
    seconds: float
    #: The fast precision the model was measured at, and the autocast dtype (None: none).
    fast: Fp32Precision
    autocast_dtype: torch.dtype | None
    #: Every candidate node, in module order.
    nodes: tuple[Fp32AdviceNode, ...]
    #: Why the tolerance is not met, naming the batch that misses (None when it is met).
    reason: str | None = None

    #: Share of the model's FLOPs that the policy runs in full float32.
    kept_flop_share: float = 0.0
    #: Share of the model's parameters held by the nodes the policy keeps (and their submodules).
    kept_parameter_share: float = 0.0
    #: The search met ``tolerance / margin`` on the calibration batches (1.0: no margin).
    margin: float = 1.0
    #: How far two full float32 runs of the same batches differ (the largest over the batches).
    noise: float = 0.0
    #: The policy's largest error over the held-out batches (None: none were given).
    held_out_error: float | None = None
    #: The policy's error on each batch: ``{"calibration": (...), "held_out": (...)}``.
    batch_errors: dict[str, tuple[float, ...]] = dataclasses.field(
        default_factory=lambda: {"calibration": (), "held_out": ()}
    )
    #: The torch version the advice was measured with.
    torch_version: str = torch.__version__
    #: What the errors are measured against: "float32" (the model in full float32, eagerly) or
    #: "eager" (the model run eagerly at the fast setting).
    reference: str = "float32"
    #: The torch.compile keyword arguments the fast runs were compiled with (None: eager runs);
    #: in JSON, a value JSON cannot hold (a backend callable) is its repr.
    compile: dict[str, Any] | None = None
    #: Whole-model compiles (one per policy measured, after torch.compiler.reset()).
    compiles: int = 0
    #: Compiles of one candidate alone (one per candidate measured for its sensitivity).
    node_compiles: int = 0
    #: Seconds spent in runs of compiled code, their compiles included.
    compile_seconds: float = 0.0

    @property
    def kept(self) -> tuple[str, ...]:
        """The names of the nodes the policy keeps in full float32."""
        return tuple(self.policy)

    def apply(self, model: torch.nn.Module) -> dict[str, Fp32Precision]:
        """Scope ``model`` with the policy: ``scope_modules(model, policy, autocast=...)``."""
        return scope_modules(model, self.policy, autocast=self.autocast)

    def _inside(self, name: str) -> bool:
        return any(name.startswith(f"{k}.") for k in self.policy)

    def table(self) -> str:
        """The nodes as a plain text table, then the errors and the share kept in full float32.

        The ``kept`` column says ``yes`` for a node of the policy and ``inside`` for one that
        runs in full float32 because a node of the policy encloses it. A sensitivity not
        measured reads ``-``.
        """
        header = ("node", "class", "params", "FLOPs", "sensitivity", "kept")
        rows = [
            (
                n.name,
                n.type,
                str(n.parameters),
                f"{n.flop_share:.1%}",
                "-" if math.isnan(n.sensitivity) else f"{n.sensitivity:.3g}",
                "yes" if n.kept else "inside" if self._inside(n.name) else "",
            )
            for n in self.nodes
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        fast = (
            f"matmul {self.fast.matmul!r}"
            + (f" under autocast {str(self.autocast_dtype).removeprefix('torch.')}" if self.autocast_dtype else "")
            + (", compiled" if self.compile is not None else "")
        )
        eager = self.reference == "eager"
        reference_runs = "eager" if eager else "full float32"
        target = self.tolerance / self.margin
        calibration = self.batch_errors.get("calibration", ())
        held = self.batch_errors.get("held_out", ())
        lines += [
            "",
            f"reference: {'the model run eagerly at the fast setting' if eager else 'the model in full float32'}",
            f"fast ({fast}) error: {self.fast_error:.3g}",
            (
                f"tolerance {self.tolerance:.3g}, searched for {target:.3g} (margin {self.margin:g}); "
                f"noise (two {reference_runs} runs) {self.noise:.3g}"
            ),
            (
                f"advised: {len(self.policy)} node(s) {'kept eager' if eager else 'in full float32'} "
                f"({self.kept_flop_share:.1%} of FLOPs, {self.kept_parameter_share:.1%} of parameters)"
            ),
            (
                f"advised error: {self.error:.3g} on {len(calibration) or 'the'} calibration batch(es)"
                + ("" if self.error <= target else " (within the tolerance, not its margin)")
                + (
                    ""
                    if self.held_out_error is None
                    else f", {self.held_out_error:.3g} on {len(held)} held-out batch(es)"
                )
                + f"; {'met' if self.met else 'NOT met'} ({self.runs} runs, {self.seconds:.1f} s)"
            ),
        ]
        for part in ("calibration", "held_out"):
            errors = self.batch_errors.get(part, ())
            if len(errors) > 1:
                shown = ", ".join(f"{e:.3g}" for e in errors[:12]) + (", ..." if len(errors) > 12 else "")
                lines.append(f"errors per {part.replace('_', '-')} batch: {shown}")
        if self.compile is not None:
            options = ", ".join(f"{k}={v!r}" for k, v in self.compile.items()) or "defaults"
            lines.append(
                f"compiled (torch.compile {options}): {self.compiles} whole-model compile(s), "
                f"{self.node_compiles} node compile(s), {self.compile_seconds:.1f} s in compiled runs"
            )
        if self.reason is not None:
            lines.append(f"why: {self.reason}")
        return "\n".join(lines)

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The whole advice as JSON text: ``json.loads(text)["policy"]`` is what scope_modules takes.

        A sensitivity not measured (nan) is written as null; an infinite error as the string
        ``"inf"``. :meth:`from_json` reads it back equal.
        """
        document = {
            "format": JSON_FORMAT,
            "policy": self.policy,
            "autocast": self.autocast,
            "tolerance": self.tolerance,
            "margin": self.margin,
            "met": self.met,
            "reason": self.reason,
            "error": _number(self.error),
            "fast_error": _number(self.fast_error),
            "held_out_error": None if self.held_out_error is None else _number(self.held_out_error),
            "batch_errors": {k: [_number(e) for e in v] for k, v in self.batch_errors.items()},
            "noise": _number(self.noise),
            "fast": {"matmul": self.fast.matmul, "cudnn_allow_tf32": self.fast.cudnn_allow_tf32},
            "autocast_dtype": None if self.autocast_dtype is None else str(self.autocast_dtype).removeprefix("torch."),
            "kept_flop_share": self.kept_flop_share,
            "kept_parameter_share": self.kept_parameter_share,
            "runs": self.runs,
            "seconds": self.seconds,
            "torch_version": self.torch_version,
            "reference": self.reference,
            "compile": None if self.compile is None else {k: _json_value(v) for k, v in self.compile.items()},
            "compiles": self.compiles,
            "node_compiles": self.node_compiles,
            "compile_seconds": self.compile_seconds,
            "nodes": [
                {
                    "name": n.name,
                    "type": n.type,
                    "parameters": n.parameters,
                    "flop_share": n.flop_share,
                    "sensitivity": _number(n.sensitivity),
                    "kept": n.kept,
                }
                for n in self.nodes
            ],
        }
        return json.dumps(document, indent=2, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Fp32Advice:
        """The advice :meth:`to_json` wrote."""
        document = json.loads(text)
        if not isinstance(document, dict) or document.get("format") != JSON_FORMAT:
            found = document.get("format") if isinstance(document, dict) else type(document).__name__
            msg = f"text is not an advice written by Fp32Advice.to_json (format {JSON_FORMAT!r}); found {found!r}."
            raise ValueError(msg)
        dtype = document["autocast_dtype"]
        return cls(
            policy=document["policy"],
            autocast=document["autocast"],
            error=_float(document["error"]),
            fast_error=_float(document["fast_error"]),
            tolerance=document["tolerance"],
            met=document["met"],
            runs=document["runs"],
            seconds=document["seconds"],
            fast=Fp32Precision(document["fast"]["matmul"], document["fast"]["cudnn_allow_tf32"]),
            autocast_dtype=None if dtype is None else _DTYPES[dtype],
            nodes=tuple(
                Fp32AdviceNode(
                    n["name"], n["type"], n["parameters"], n["flop_share"], _float(n["sensitivity"]), n["kept"]
                )
                for n in document["nodes"]
            ),
            reason=document["reason"],
            kept_flop_share=document["kept_flop_share"],
            kept_parameter_share=document["kept_parameter_share"],
            margin=document["margin"],
            noise=_float(document["noise"]),
            held_out_error=None if document["held_out_error"] is None else _float(document["held_out_error"]),
            batch_errors={k: tuple(_float(e) for e in v) for k, v in document["batch_errors"].items()},
            torch_version=document["torch_version"],
            # Advice written before compile= holds none of these: eager runs against full float32.
            reference=document.get("reference", "float32"),
            compile=document.get("compile"),
            compiles=document.get("compiles", 0),
            node_compiles=document.get("node_compiles", 0),
            compile_seconds=document.get("compile_seconds", 0.0),
        )

    # -- the chart -------------------------------------------------------------------------------

    def plot(self, path: str | Any) -> None:
        """Save a chart of each node's sensitivity and FLOP share to ``path``.

        One line per node, most sensitive first: its sensitivity (log scale, the tolerance
        and the searched ``tolerance / margin`` as lines) and beside it its FLOP share. Kept
        nodes are red, nodes kept through a kept parent orange, the others blue; a node
        never measured (nan) is a grey hatched bar marked "not measured", apart from any
        measured value. Past 40 nodes, 40 are drawn (the kept ones first, then the most
        sensitive) and one last line sums up the rest: how many, how many of them kept, their
        largest sensitivity and their FLOPs. Labels are never cut: the figure grows to fit.

        Needs matplotlib: ``pip install fp32scope[plot]``.
        """
        fig = self._figure()
        try:
            fig.savefig(path, bbox_inches="tight", dpi=110)  # "tight": the figure grows to hold every label
        finally:
            import matplotlib.pyplot as plt

            plt.close(fig)

    def _figure(self) -> Any:
        """The chart as a matplotlib figure (the caller closes it)."""
        try:
            import matplotlib as mpl

            mpl.use("Agg", force=False)
            import matplotlib.pyplot as plt
            from matplotlib.patches import Patch
        except ImportError as error:
            msg = "Fp32Advice.plot needs matplotlib: pip install fp32scope[plot]"
            raise ImportError(msg) from error
        rows = _chart_rows(self)
        measured = [n.sensitivity for n, _ in rows if n is not None and math.isfinite(n.sensitivity)]
        positive = [v for v in [*measured, self.tolerance] if v > 0]
        low = min(positive) / 10
        high = max([*positive, self.fast_error if math.isfinite(self.fast_error) else 0]) * 10
        longest = max(len(label) for _, label in rows)
        fig, (left, right) = plt.subplots(
            1,
            2,
            sharey=True,
            figsize=(6.5 + 0.065 * longest, 2.2 + 0.24 * len(rows)),
            gridspec_kw={"width_ratios": [3, 1.2]},
            layout="constrained",  # room for every label and the legend below
        )
        ys = list(range(len(rows)))
        for y, (node, _label) in zip(ys, rows, strict=True):
            if node is None:
                continue
            color = "tab:red" if node.kept else "tab:orange" if self._inside(node.name) else "tab:blue"
            if math.isnan(node.sensitivity):
                left.barh(y, high - low, left=low, color="none", edgecolor="grey", hatch="//", linewidth=0.6)
                left.text(math.sqrt(low * high), y, "not measured", va="center", ha="center", fontsize=7)
            else:
                value = high if math.isinf(node.sensitivity) else max(node.sensitivity, low)
                left.barh(y, value - low, left=low, color=color)
                if node.sensitivity == 0:
                    left.text(low, y, " 0", va="center", ha="left", fontsize=7)
            right.barh(y, node.flop_share * 100, color=color)
        left.set_xscale("log")
        left.set_xlim(low, high)
        left.axvline(self.tolerance, color="black", linestyle="--", linewidth=1, label="tolerance")
        if self.margin != 1:
            target = self.tolerance / self.margin
            left.axvline(target, color="black", linestyle=":", linewidth=1, label="tolerance / margin")
        left.set_yticks(ys)
        left.set_yticklabels([label for _, label in rows], fontsize=7)
        left.invert_yaxis()
        alone = "compiled" if self.compile is not None else "fast"
        left.set_xlabel(f"error with only this node {alone}", fontsize=8)
        right.set_xlabel("share of FLOPs (%)", fontsize=8)
        handles = [
            *left.get_legend_handles_labels()[0],
            Patch(color="tab:red", label="kept"),
            Patch(color="tab:orange", label="kept (inside a kept node)"),
            Patch(color="tab:blue", label="compiled" if self.compile is not None else "fast"),
            Patch(facecolor="none", edgecolor="grey", hatch="//", label="not measured"),
        ]
        fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncol=3)
        held = "" if self.held_out_error is None else f", held-out {self.held_out_error:.2g}"
        fig.suptitle(
            f"fast error {self.fast_error:.2g}; advised {self.error:.2g}{held} with {len(self.policy)} kept "
            f"({self.kept_flop_share:.0%} of FLOPs); tolerance {self.tolerance:.2g}, "
            f"{'met' if self.met else 'NOT met'}",
            fontsize=9,
        )
        return fig


def _chart_rows(advice: Fp32Advice) -> list[tuple[Fp32AdviceNode | None, str]]:
    """The chart's lines, most sensitive first: (node, label), and (None, summary) for the rest."""
    ranked = sorted(
        advice.nodes,
        key=lambda n: (
            not (n.kept or advice._inside(n.name)),  # kept ones first, those kept through a parent too
            -(n.sensitivity if not math.isnan(n.sensitivity) else -1.0),
            -n.flop_share,
        ),
    )
    shown = ranked[:CHART_ROWS]
    rows: list[tuple[Fp32AdviceNode | None, str]] = [(n, f"{n.name} ({n.type})") for n in shown]
    rest = ranked[CHART_ROWS:]
    if rest:
        finite = [n.sensitivity for n in rest if math.isfinite(n.sensitivity)]
        top = f", each at most {max(finite):.2g}" if finite else ""
        share = sum(n.flop_share for n in rest)
        kept = sum(1 for n in rest if n.kept or advice._inside(n.name))
        also = f" ({kept} of them kept)" if kept else ""
        rows.append((None, f"... {len(rest)} more nodes{also}{top}, {share:.0%} of FLOPs together"))
    return rows


def _number(value: float) -> float | str | None:
    """A float as strict JSON holds it: nan as null, infinities as strings."""
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _json_value(value: Any) -> Any:
    """``value`` as JSON holds it: itself where JSON can, else its repr (a backend callable)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _float(value: float | str | None) -> float:
    if value is None:
        return math.nan
    return float(value)


# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
Fp32Advice.__module__ = "fp32scope"
Fp32AdviceNode.__module__ = "fp32scope"
