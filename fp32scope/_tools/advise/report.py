"""What :func:`~fp32scope.advise` found, and how it is shown: the table, the chart, JSON."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch

from fp32scope._flags.precision import Fp32Precision
from fp32scope._wrappers.policy import scope_modules

__all__ = ["FULL_FLOAT32", "Fp32Advice", "Fp32AdviceNode"]

#: The precision every kept node gets, as JSON holds it: full float32 for matmuls and cuDNN.
FULL_FLOAT32: dict[str, Any] = {"matmul": "highest", "cudnn_allow_tf32": False}


class Fp32AdviceNode(NamedTuple):
    """One candidate node of :func:`advise`: what it is, what it costs, and how sensitive it is."""

    #: Qualified name, as ``model.named_modules()`` gives it.
    name: str
    #: The module's class name.
    type: str
    #: Parameters held by the node and its submodules (each tensor once).
    parameters: int
    #: Share of the model's forward FLOPs (torch's FLOP counter) run by the node and its submodules.
    flop_share: float
    #: The error with only this node's own work fast and every other candidate's in full float32
    #: (nan where not measured: every node fast met the tolerance).
    sensitivity: float
    #: Whether the advised policy keeps it in full float32.
    kept: bool


@dataclasses.dataclass(frozen=True)
class Fp32Advice:
    """What :func:`advise` found: the policy, the errors measured with and without it, and each node.

    ``policy`` is ``{qualified name: {"matmul": "highest", "cudnn_allow_tf32": False}}``, a
    mapping :func:`~fp32scope.scope_modules` takes as it is or after a round trip through
    JSON; ``autocast`` is what to pass to it with the policy (False when the model runs under
    ``torch.autocast``: the kept nodes then run without it; else None).
    """

    #: {qualified name: full float32}, JSON-ready; empty when every node may run fast.
    policy: dict[str, dict[str, Any]]
    #: The ``autocast`` argument of :func:`~fp32scope.scope_modules` for this policy.
    autocast: bool | None
    #: The error with the policy applied (through scope_modules), the largest over the batches.
    error: float
    #: The error with every node at the fast precision (no policy).
    fast_error: float
    #: The tolerance the policy was searched for.
    tolerance: float
    #: Whether ``error <= tolerance``.
    met: bool
    #: How many times the model ran (one call per batch, each setting).
    runs: int
    #: Seconds :func:`advise` took.
    seconds: float
    #: The fast precision the model was measured at, and the autocast dtype (None: none).
    fast: Fp32Precision
    autocast_dtype: torch.dtype | None
    #: Every candidate node, in module order.
    nodes: tuple[Fp32AdviceNode, ...]
    #: Why the tolerance is not met (None when it is).
    reason: str | None = None

    #: Share of the model's forward FLOPs that the policy runs in full float32.
    kept_flop_share: float = 0.0
    #: Share of the model's parameters held by the nodes the policy keeps (and their submodules).
    kept_parameter_share: float = 0.0

    @property
    def kept(self) -> tuple[str, ...]:
        """The names of the nodes the policy keeps in full float32."""
        return tuple(self.policy)

    def apply(self, model: torch.nn.Module) -> dict[str, Fp32Precision]:
        """Scope ``model`` with the policy: ``scope_modules(model, policy, autocast=...)``."""
        return scope_modules(model, self.policy, autocast=self.autocast)

    def table(self) -> str:
        """The nodes as a plain text table, then the errors and the share kept in full float32.

        The ``kept`` column says ``yes`` for a node of the policy and ``inside`` for one that
        runs in full float32 because a node of the policy encloses it.
        """
        header = ("node", "class", "params", "FLOPs", "sensitivity", "kept")
        rows = [
            (
                n.name,
                n.type,
                str(n.parameters),
                f"{n.flop_share:.1%}",
                "-" if math.isnan(n.sensitivity) else f"{n.sensitivity:.3g}",
                "yes" if n.kept else "inside" if any(n.name.startswith(f"{k}.") for k in self.policy) else "",
            )
            for n in self.nodes
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        fast = f"matmul {self.fast.matmul!r}" + (
            f" under autocast {str(self.autocast_dtype).removeprefix('torch.')}" if self.autocast_dtype else ""
        )
        lines += [
            "",
            f"fast ({fast}) error: {self.fast_error:.3g}; tolerance {self.tolerance:.3g}",
            (
                f"advised error: {self.error:.3g} with {len(self.policy)} node(s) in full float32 "
                f"({self.kept_flop_share:.1%} of FLOPs, {self.kept_parameter_share:.1%} of parameters); "
                f"{'met' if self.met else 'NOT met'} ({self.runs} runs, {self.seconds:.1f} s)"
            ),
        ]
        if self.reason is not None:
            lines.append(f"why: {self.reason}")
        return "\n".join(lines)

    def plot(self, path: str | Any) -> None:
        """Save a bar chart of each node's sensitivity (log scale) with the tolerance line to ``path``.

        Needs matplotlib: ``pip install fp32scope[plot]``.
        """
        try:
            import matplotlib as mpl

            mpl.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError as error:
            msg = "Fp32Advice.plot needs matplotlib: pip install fp32scope[plot]"
            raise ImportError(msg) from error
        floor = self.tolerance * 1e-3
        finite = [n.sensitivity for n in self.nodes if math.isfinite(n.sensitivity)]
        top = max([1.0, *finite])
        # Not measured (nan): at the floor; an infinite error: at the top of the chart.
        values = [
            floor if math.isnan(n.sensitivity) else top if math.isinf(n.sensitivity) else max(n.sensitivity, floor)
            for n in self.nodes
        ]
        colors = ["tab:red" if n.kept else "tab:blue" for n in self.nodes]
        fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(self.nodes) + 2), 4.5))
        try:
            ax.bar(range(len(values)), values, color=colors)
            ax.set_yscale("log")
            ax.axhline(self.tolerance, color="black", linestyle="--", linewidth=1, label="tolerance")
            ax.set_xticks(range(len(values)))
            ax.set_xticklabels([n.name for n in self.nodes], rotation=75, ha="right", fontsize=7)
            ax.set_ylabel("error with only this node fast")
            ax.set_title(
                f"fast error {self.fast_error:.2g}, advised {self.error:.2g} "
                f"({len(self.policy)} kept, red; tolerance {self.tolerance:.2g})",
                fontsize=9,
            )
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(path)
        finally:
            plt.close(fig)


# Pickles, reprs and tracebacks name the public home, which stays when private modules move.
Fp32Advice.__module__ = "fp32scope"
Fp32AdviceNode.__module__ = "fp32scope"
