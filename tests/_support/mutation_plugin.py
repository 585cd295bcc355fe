"""Pytest plugin for the mutation session only (``nox -s mutation``): fewer Hypothesis examples, one thread.

Each mutant runs every selected test that reaches the mutated function; at the suite's own
example counts (up to 1000 state-machine runs of 40 steps) one surviving mutant costs
minutes on a small machine. Under this plugin every Hypothesis test runs at most
``MAX_EXAMPLES`` examples, derandomized (the same examples on every run, so that a
mutant's verdict does not depend on luck), without shrinking and without the example
database. The regular test sessions never load it: there the full counts run.

torch runs its CPU kernels on one thread here: mutmut forks each mutant's test run from a
process that ran tests already, and a fork of a process whose OpenMP thread pool has run
hangs at its first parallel kernel (seen: every mutant reached by a 512-wide matmul
recorded as a timeout, that is, as killed).
"""

from __future__ import annotations

from typing import Any

import hypothesis
import torch

MAX_EXAMPLES = 10

_settings_init = hypothesis.settings.__init__


def _capped_init(self: hypothesis.settings, parent: hypothesis.settings | None = None, **kwargs: Any) -> None:
    if "max_examples" in kwargs:
        kwargs["max_examples"] = min(kwargs["max_examples"], MAX_EXAMPLES)
    _settings_init(self, parent, **kwargs)


# Patched at plugin load, before any test module builds its settings(max_examples=...).
hypothesis.settings.__init__ = _capped_init  # type: ignore[method-assign]
# No shrinking: a mutant is killed by the first failing example; shrinking it only costs time.
hypothesis.settings.register_profile(
    "fp32scope-mutation",
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
)
hypothesis.settings.load_profile("fp32scope-mutation")

# Before any test runs a kernel: the OpenMP pool is then never started, in the process mutmut
# forks from or in its children.
torch.set_num_threads(1)
