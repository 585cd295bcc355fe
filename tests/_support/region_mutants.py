"""Hand-made mutants of the in-graph region code, and whether the region tests kill each.

mutmut cannot mutate ``_wrappers/region/``, ``_wrappers/carriers.py``,
``_wrappers/layouts.py`` and ``_wrappers/inner/`` usefully: their tests compile, and
Dynamo cannot trace mutmut's trampolines. So each mutant here is one edit a plausible wrong implementation would make (a
copy left out, a scope not entered, a write-back skipped), named with what it breaks.
``nox -s mutation-regions`` (or ``python tests/_support/region_mutants.py`` from the
repository root) copies the repository to temporary folders, one per mutant run side by
side (``-n``, two by default), applies one mutant at a time there and runs ``TESTS``
against it, stopping at the first failure; it prints each mutant's fate, the test that
killed it and the score, and exits non-zero when the score is under ``TARGET`` or a
mutant's text is no longer in its file (the list must follow the code). The working tree
is never changed, but for ``DATA``.

What makes a whole run fit in half an hour: ``DATA`` (``region_mutants.json``, kept in
the repository and brought up to date by each run) records the test that killed each
mutant last time and each test's seconds. A mutant's run takes its own killer first, then
the other killers, then every other test, quickest first, so that a killed mutant costs
about one test; a mutant that survives still runs every test. A kill counts only where
its test passes unmutated: the known killers are run unmutated first, and any new one at
the end. The verdicts are those of running the whole suite: only the order differs.

``EQUIVALENT`` names mutants that change no behaviour the tests can see, each with why:
they are left out of the score, and run only with ``--equivalents`` (each costs the whole
suite).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue
from typing import NamedTuple

if __package__ in (None, ""):  # run as a script: its folder is on sys.path, the repository root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests._support import mutant_order

ROOT = Path(__file__).resolve().parents[2]
TARGET = 0.90
#: What earlier runs found: the test that killed each mutant, and each test's seconds.
DATA = ROOT / "tests" / "_support" / "region_mutants.json"
TESTS = (
    "tests/compile/test_regions.py",
    "tests/compile/test_region_outputs.py",
    "tests/compile/test_region_attention.py",
    "tests/compile/test_region_caches.py",
    "tests/compile/test_region_carried.py",
    "tests/compile/test_region_objects.py",
    "tests/compile/test_eager_nodes.py",
    "tests/compile/test_inner.py",
    "tests/compile/test_region_state.py",
    "tests/compile/test_region_faults.py",
    "tests/compile/test_region_backends.py",
    "tests/wrappers/test_layouts.py",
    "tests/wrappers/test_carriers.py",
)
REGION = "fp32scope/_wrappers/region"  # a package: a mutant names the module its text is in
REGIONS = f"{REGION}/regions.py"
BOUNDARY = f"{REGION}/boundary.py"
EAGER = f"{REGION}/eager.py"
INSIDE = f"{REGION}/inside.py"
ENTRY = f"{REGION}/entry.py"
CARRIERS = "fp32scope/_wrappers/carriers.py"
INNER = "fp32scope/_wrappers/inner"  # a package too
INNER_GRAPHS = f"{INNER}/graphs.py"
INNER_ENTRIES = f"{INNER}/entries.py"
INNER_TRACING = f"{INNER}/tracing.py"
INNER_OPS = f"{INNER}/ops.py"
PROXY = "fp32scope/_wrappers/proxy.py"
LAYOUTS = "fp32scope/_wrappers/layouts.py"
_C = "tests/compile/"
#: Per mutated module, the test files whose subject it is: tried first where no killer is known yet.
SUBJECTS: dict[str, tuple[str, ...]] = {
    REGIONS: (f"{_C}test_regions.py", f"{_C}test_region_backends.py"),
    BOUNDARY: (f"{_C}test_region_outputs.py",),
    EAGER: (f"{_C}test_regions.py", f"{_C}test_region_outputs.py", f"{_C}test_region_faults.py"),
    INSIDE: (f"{_C}test_inner.py", f"{_C}test_region_state.py"),
    ENTRY: (f"{_C}test_regions.py", f"{_C}test_region_faults.py"),
    CARRIERS: (
        "tests/wrappers/test_carriers.py",
        f"{_C}test_region_carried.py",
        f"{_C}test_region_objects.py",
        f"{_C}test_region_caches.py",
    ),
    INNER_GRAPHS: (f"{_C}test_inner.py",),
    INNER_ENTRIES: (f"{_C}test_inner.py", f"{_C}test_region_state.py"),
    INNER_TRACING: (f"{_C}test_inner.py",),
    INNER_OPS: (f"{_C}test_inner.py",),
    PROXY: (f"{_C}test_regions.py",),
    LAYOUTS: ("tests/wrappers/test_layouts.py", f"{_C}test_region_outputs.py"),
}


class Mutant(NamedTuple):
    """One edit: in ``path``, ``old`` (found exactly once) becomes ``new``."""

    name: str
    path: str
    old: str
    new: str


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "outputs aliasing an input leave uncopied",
        BOUNDARY,
        "        if storage._cdata in seen or o.storage_offset() != 0 or",
        "        if False and storage._cdata in seen or o.storage_offset() != 0 or",
    ),
    Mutant(
        "outputs at an offset leave uncopied",
        BOUNDARY,
        "        if storage._cdata in seen or o.storage_offset() != 0 or",
        "        if storage._cdata in seen or False or",
    ),
    Mutant(
        "training outputs leave uncopied",
        EAGER,
        "    return [o.detach().clone() for o in outputs], updates, saved",
        "    return [o.detach() for o in outputs], updates, saved",
    ),
    Mutant(
        "tensor arguments kept by the saved graph are not copied",
        EAGER,
        "    op.tensors = [t.detach().clone().requires_grad_(",
        "    op.tensors = [t.detach().requires_grad_(",
    ),
    Mutant(
        "updated buffers run on the caller's buffers",
        EAGER,
        "            op.buffers[i] = op.buffers[i].clone()",
        "            op.buffers[i] = op.buffers[i]",
    ),
    Mutant(
        "updated buffers are not written back",
        ENTRY,
        "        buffers[i].copy_(update)",
        "        buffers[i].detach()",
    ),
    Mutant(
        "a static cache's in-place updates are not written back",
        ENTRY,
        "        tensors[i].copy_(update)",
        "        tensors[i].detach()",
    ),
    Mutant(
        "the no-grad forward runs outside the node's scope",
        EAGER,
        "        with region.scope:  # no graph to record",
        "        with contextlib.nullcontext():  # no graph to record",
    ),
    Mutant(
        "the training forward runs outside the node's scope",
        EAGER,
        "            with _AboveAutograd(), torch.enable_grad(), region.scope:",
        "            with _AboveAutograd(), torch.enable_grad():",
    ),
    Mutant(
        "the backward runs outside the node's scope",
        EAGER,
        "        with region.backward_scope:\n            found = torch.autograd.grad(",
        "        with contextlib.nullcontext():\n            found = torch.autograd.grad(",
    ),
    Mutant(
        "the backward is reported as the node's forward",
        EAGER,
        "        with region.backward_scope:\n            found = torch.autograd.grad(",
        "        with region.scope:\n            found = torch.autograd.grad(",
    ),
    Mutant(
        "the kept graph is freed by the first backward",
        EAGER,
        "                allow_unused=True,\n                retain_graph=True,",
        "                allow_unused=True,\n                retain_graph=False,",
    ),
    Mutant(
        "a kept graph outlives its token",
        EAGER,
        "    weakref.finalize(token, _forget, number)",
        "    weakref.finalize(token, int, number)",
    ),
    Mutant(
        "two calls of one region share a number (merged by CSE)",
        ENTRY,
        "        numbers = [\n            site,\n",
        "        numbers = [\n            0,\n",
    ),
    Mutant(
        "a graph's op reads the last plan traced, not its own call's",
        EAGER,
        "    plan = region.plans[op.site]\n    rebound = [",
        "    plan = region.plans[max(region.plans)]\n    rebound = [",
    ),
    Mutant(
        "a carried object's in-place tensors are found by the last plan traced",
        EAGER,
        "else where.tensors if fake else op.region.plans[op.site].inplace",
        "else where.tensors if fake else op.region.plans[max(op.region.plans)].inplace",
    ),
    Mutant(
        "quantized cache layers are carried by their __dict__",
        CARRIERS,
        '        and "Quantized" not in name\n',
        "        and True\n",
    ),
    Mutant(
        "one call traced twice may change its objects differently",
        EAGER,
        "        if known is not None and known.key != plan.key:",
        "        if False:",
    ),
    Mutant(
        "inputs the outputs never reach get zeros, not None",
        EAGER,
        "            if need and reached is not None and not next(reached):",
        "            if need and reached is not None and not next(reached) and False:",
    ),
    Mutant(
        "autograd stays off in the training forward",
        EAGER,
        "        if _BELOW_AUTOGRAD and exclude.has(_BELOW_AUTOGRAD[0]):",
        "        if False:",
    ),
    Mutant(
        "the caller's autocast is not carried",
        BOUNDARY,
        "    if not torch._C._is_any_autocast_enabled():\n        return out",
        "    if True:\n        return out",
    ),
    Mutant(
        "an autocast=False node runs under the caller's autocast",
        BOUNDARY,
        "        if region.policy.mode is False:",
        "        if False:",
    ),
    Mutant(
        "a tensor reached by closure is not refused",
        EAGER,
        "            if id(variable) not in mine:",
        "            if False:",
    ),
    Mutant(
        "export of a model with a region is not refused",
        ENTRY,
        "    if is_exporting():\n        _refuse_export(region.name)",
        "    if False:\n        _refuse_export(region.name)",
    ),
    Mutant(
        "writes declared by ops are not recorded (batch norm statistics)",
        EAGER,
        "        if argument.alias_info is None or not argument.alias_info.is_write:\n            return",
        "        if True:\n            return",
    ),
    Mutant(
        "constants in a node's output are lost",
        BOUNDARY,
        "        elif isinstance(value, _CONSTANTS):\n            leaves.append(value)",
        "        elif isinstance(value, _CONSTANTS):\n            leaves.append(None)",
    ),
    Mutant(
        "an output's constants are rebuilt as None",
        BOUNDARY,
        '    if kind == "c":\n        return tree[1]',
        '    if kind == "c":\n        return None',
    ),
    Mutant(
        "a cache the node returns is handed back as the op's rebuilt copy, not the caller's",
        BOUNDARY,
        "            leaves.append(_Given(next(i for i, obj in enumerate(given) if value is obj)))",
        "            leaves.append(value)",
    ),
    Mutant(
        "a node returning one constant returns nothing",
        BOUNDARY,
        "    if spec is None or (leaves == (_TENSOR,) and spec.is_leaf()):",
        "    if spec is None or spec.is_leaf():",
    ),
    Mutant(
        "an output's pytree containers are rebuilt as lists",
        BOUNDARY,
        "    return unflatten(kids, context)",
        "    return kids",
    ),
    Mutant(
        "region numbers are alike in every process (disk caches serve another's graph)",
        REGIONS,
        "_PROCESS: Final = secrets.randbits(24) << 32",
        "_PROCESS: Final = 0",
    ),
    Mutant(
        "an argument a region cannot carry is not a graph break",
        ENTRY,
        "    if not all(i in carried or _carriable(v) for i, v in enumerate(values)):",
        "    if False:",
    ),
    Mutant(
        "the object-argument warning fires on every call",
        ENTRY,
        "        region.warned_break = True\n",
        "        region.warned_break = False\n",
    ),
    Mutant(
        "a cache layer's rebound tensors are not seen",
        CARRIERS,
        "        if new is not old:",
        "        if False:",
    ),
    Mutant(
        "a cache layer's changed constants are not seen",
        CARRIERS,
        "    elif type(new) is not type(old) or new != old:",
        "    elif False:",
    ),
    Mutant(
        "a DynamicCache() does not grow the caller's cache",
        CARRIERS,
        '            while grow and kind == "index" and len(obj) <= index:  # a DynamicCache() grows by a layer',
        "            while False:",
    ),
    Mutant(
        "a layer's unset attributes are set to None",
        CARRIERS,
        "            if _tag(item) != _UNSET[0]:",
        "            if True:",
    ),
    Mutant(
        "an is_updated flag the node sets on an EncoderDecoderCache is not seen",
        CARRIERS,
        '        _diff(entries.get(key, _UNSET), value, path, ("item", key), found, tensors, first)',
        "        pass",
    ),
    Mutant(
        "a plain object's float crosses as Dynamo made it (symbolic once it changed)",
        CARRIERS,
        "        return numerator / denominator",
        "        return value",
    ),
    Mutant(
        "an attribute the node adds to a plain object is not seen",
        CARRIERS,
        "        for field in (*old[2], *(f for f in state if f not in before)):",
        "        for field in old[2]:",
    ),
    Mutant(
        "a plain object is rebuilt through its class's __setattr__",
        CARRIERS,
        """            built.__dict__.update(
                (field, _build(module, item)) for field, item in zip(description[2], description[3], strict=True)
            )""",
        """            for field, item in zip(description[2], description[3], strict=True):
                setattr(built, field, _build(module, item))""",
    ),
    Mutant(
        "a second plan for a layout replaces the first, which its graph still reads",
        EAGER,
        "        if known is not None and (known.inplace, known.changes) != (plan.inplace, plan.changes):",
        "        if False:",
    ),
    Mutant(
        "a plain object's nested object is described as a constant",
        CARRIERS,
        "        return (_OBJECT, _class_key(cls), fields, tuple(_describe(value.__dict__[f]) for f in fields))",
        "        return (_OBJECT, _class_key(cls), fields, tuple(value.__dict__[f] for f in fields))",
    ),
    Mutant(
        "a change is written on the carried object itself, not where its path leads",
        CARRIERS,
        "        owner = _walk(obj, path, grow=True)",
        "        owner = obj",
    ),
    Mutant(
        "a count the node moves (a sliding layer's cumulative_length) comes back as a constant",
        CARRIERS,
        "        delta = _delta(old, new)",
        "        delta = None",
    ),
    Mutant(
        "a compiled-inside node's forward runs outside its scope",
        INNER_OPS,
        "    with entry.scope:\n        return entry.forward.run(values)",
        "    if entry.scope:\n        return entry.forward.run(values)",
    ),
    Mutant(
        "a compiled-inside node's backward runs outside its scope",
        INNER_OPS,
        "    with entry.backward_scope:\n        out = backward.run(values)",
        "    if entry.backward_scope:\n        out = backward.run(values)",
    ),
    Mutant(
        "a compiled-inside node's backward is reported as its forward",
        INNER_OPS,
        "    with entry.backward_scope:\n        out = backward.run(values)",
        "    with entry.scope:\n        out = backward.run(values)",
    ),
    Mutant(
        "a changed attribute of a compiled-inside node is ignored",
        INNER_ENTRIES,
        "    chosen = entry if state_holds(entry) else variant(entry)\n    entry.last = chosen",
        "    chosen = entry\n    entry.last = chosen",
    ),
    Mutant(
        "a changed attribute of a compiled-inside node's submodule is ignored",
        INNER_ENTRIES,
        "        for sub in module.modules()\n",
        "        for sub in (module,)\n",
    ),
    Mutant(
        "graphs traced again for a changed attribute run whatever they return",
        INNER_ENTRIES,
        "        if found is None or found.signature() != entry.signature():",
        "        if found is None:",
    ),
    Mutant(
        "graphs are traced again past Dynamo's recompile limit",
        INNER_ENTRIES,
        "        if entry.retrace is not None and len(entry.variants) + 1 >= limit:",
        "        if False:",
    ),
    Mutant(
        "graphs traced for a changed attribute are not kept (traced again at every call)",
        INNER_ENTRIES,
        "        entry.variants[key] = found\n",
        "        pass\n",
    ),
    Mutant(
        "a backward runs the graphs of attributes changed after its forward",
        INNER_ENTRIES,
        "    if chosen is not entry.last:",
        "    if False:",
    ),
    Mutant(
        "a region's node runs eagerly in its op under its parent's backend",
        ENTRY,
        "        backend = _backend(region)\n",
        "        backend = 0\n",
    ),
    Mutant(
        "a backend running the parent's graph as Python compiles nothing in the op",
        ENTRY,
        "        return region.traced_backend\n",
        "        return 0\n",
    ),
    Mutant(
        "a parameter the node hands back leaves the op uncopied",
        EAGER,
        "itertools.chain(given, op.params, op.buffers)",
        "itertools.chain(given, op.buffers)",
    ),
    Mutant(
        "the caller's autocast is re-entered without its dtype",
        BOUNDARY,
        "            stack.enter_context(torch.autocast(device, dtype=_AUTOCAST_DTYPES[dtype]))",
        "            stack.enter_context(torch.autocast(device))",
    ),
    Mutant(
        "a second cache is rebuilt from the first one's tensors",
        REGIONS,
        '                marker = cast("tuple[Any, ...]", values[position])',
        '                marker = cast("tuple[Any, ...]", values[where.positions[0]])',
    ),
    Mutant(
        "a node with hooks is compiled inside (its hooks run only when traced)",
        INSIDE,
        "    if not _has_hooks(region.module):",
        "    if True:",
    ),
    Mutant(
        "a node changing its own attributes is compiled inside",
        INSIDE,
        "    if entry is None or [v for *_, v in traced] != [v for *_, v in state]:",
        "    if entry is None:",
    ),
    Mutant(
        "compiled graphs get inputs laid out other than they were compiled for",
        INNER_GRAPHS,
        "    if layout is None or value.stride() == layout[1]:",
        "    if True:",
    ),
    Mutant(
        "a compiled-inside op's outputs may alias its inputs",
        INNER_GRAPHS,
        "        if storage in seen:\n            found.append(i)",
        "        if False:\n            found.append(i)",
    ),
    Mutant(
        "a compiled-inside op's later calls take inputs laid out otherwise as they come",
        INNER_GRAPHS,
        "        if [v.stride() for v in values] == self.strides:",
        "        if True:",
    ),
    Mutant(
        "a compiled-inside op's outputs keep the compiled code's layout",
        INNER_GRAPHS,
        "            if o is not None and layout is not None and o.stride() != layout[1]",
        "            if False",
    ),
    Mutant(
        "a compiled-inside op's later calls copy no aliasing output",
        INNER_GRAPHS,
        "        for i in self.copies:\n            out[i] = _copy(out[i])",
        "        for i in ():\n            out[i] = _copy(out[i])",
    ),
    Mutant(
        "compiled-inside entry numbers alike in every process",
        INNER_ENTRIES,
        "self.number = _PROCESS | next(_numbers)",
        "self.number = next(_numbers)",
    ),
    Mutant(
        "a compiled-inside cache region's updated tensors written back from the wrong outputs",
        ENTRY,
        "            out = [*out[len(written) :], *out[: len(written)]]",
        "            out = list(out)",
    ),
    Mutant(
        "a compiled-inside cache region drops the tensors its node binds anew",
        INSIDE,
        "            return out if plan is None else out + _rebound_as_planned(region, plan, objects)",
        "            return out",
    ),
    Mutant(
        "a region's tuple arguments rebuilt as lists",
        LAYOUTS,
        'return f"({\', \'.join(children)},)" if children else "()"',
        "return f\"[{', '.join(children)}]\"",
    ),
    Mutant(
        "a region's dict arguments rebuilt with their keys shifted",
        LAYOUTS,
        "zip(keys, children, strict=True)",
        "zip(keys[1:] + keys[:1], children, strict=True)",
    ),
    Mutant(
        "a region's varying ints rebuilt from the wrong place",
        LAYOUTS,
        'return f"n[{self.ints - 1}]"',
        'return f"n[{self.ints}]"',
    ),
    Mutant(
        "a compiled-inside static cache's keys and values are copied into the op and back",
        INSIDE,
        "    return tuple(i for i in plan.inplace if i in storage)",
        "    return ()",
    ),
    Mutant(
        "a compiled-inside graph does not write the inputs it updates in place",
        INNER_TRACING,
        "                graph.graph.call_function(torch.ops.aten.copy_.default, (placeholders[i], new))",
        "                pass",
    ),
    Mutant(
        "an input updated in place but laid out otherwise is not written back",
        INNER_OPS,
        "        tensor.copy_(laid)",
        "        pass",
    ),
    Mutant(
        "every tensor of a cache is taken for its keys and values",
        CARRIERS,
        "        found.append(field in _STORAGE)",
        "        found.append(True)",
    ),
    Mutant(
        "eager nodes are compiled inside",
        PROXY,
        "Region(module, self._self_autocast, label, compiled=not eager) if in_graph else None",
        "Region(module, self._self_autocast, label, compiled=True) if in_graph else None",
    ),
)

#: Mutants that change nothing the tests can see, by name, with why.
EQUIVALENT: dict[str, str] = {
    "a tensor reached by closure is not refused": (
        "the run on fake tensors refuses such a tensor first, with the same message: Dynamo's fake "
        "mode takes no real tensor, so no compile reaches this second check"
    ),
    "a compiled-inside op's later calls take inputs laid out otherwise as they come": (
        "Inductor hands a custom op's inputs in the strides its fake run saw (its layout constraint "
        "for custom ops; an expanded gradient arrives materialized), at every call the strides of "
        "its first: the check guards another configured constraint"
    ),
    "a compiled-inside op's outputs keep the compiled code's layout": (
        "Inductor keeps a graph's output strides as the graph's own metadata gives them (its "
        "keep_output_stride, on by default), which the op's fake kernel declares too; the copy "
        "guards that setting turned off"
    ),
}


def _copy_tree(target: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".nox", "mutants", ".mutation", "_build", "__pycache__", ".hypothesis")
    shutil.copytree(ROOT, target, ignore=ignore, dirs_exist_ok=True)


class Known(NamedTuple):
    """What earlier runs found (``DATA``): each killed mutant's killing test, and each test's seconds."""

    killers: dict[str, str]
    seconds: dict[str, float]

    @classmethod
    def load(cls) -> Known:
        """The file's contents, or nothing known where there is no file."""
        if not DATA.exists():
            return cls({}, {})
        raw = json.loads(DATA.read_text())
        return cls(dict(raw["killers"]), {k: float(v) for k, v in raw["seconds"].items()})

    def save(self) -> None:
        """Write the file (sorted, so that a run that learnt nothing new leaves it as it was)."""
        seconds = {k: round(v, 2) for k, v in sorted(self.seconds.items())}
        DATA.write_text(
            json.dumps({"killers": dict(sorted(self.killers.items())), "seconds": seconds}, indent=1) + "\n"
        )

    def order(self, first: str | None, subjects: tuple[str, ...] = ()) -> list[str]:
        """Tests to run for a mutant, quickest first within each part.

        Its own killer, the tests of the files whose subject its module is, the other
        killers, then the rest (in a first run, where no killer is known, the subject's tests
        are where one is likeliest).
        """
        quickest = sorted(self.seconds, key=lambda t: self.seconds[t])
        own = [first] if first else []
        near = [t for t in quickest if t.startswith(subjects) and t not in own] if subjects else []
        killers = sorted(set(self.killers.values()) - {first} - set(near), key=lambda t: self.seconds.get(t, 0.0))
        rest = [t for t in quickest if t not in {*own, *near, *killers}]
        return [*own, *near, *subjects, *killers, *rest]  # a file's name ranks its tests not timed yet


class Outcome(NamedTuple):
    """One pytest run: whether it passed, its seconds, the first test that failed, each test's seconds."""

    passed: bool
    seconds: float
    failed: str | None
    times: dict[str, float]


def _run_tests(where: Path, order: list[str], tests: list[str], limit: float | None) -> Outcome:
    """Run ``tests`` in ``where``, ``order``'s tests first, stopping at the first failure (past ``limit``: failed)."""
    with tempfile.TemporaryDirectory(prefix="fp32scope-mutant-run-") as scratch:
        order_file, record_file = Path(scratch) / "order.json", Path(scratch) / "record.json"
        order_file.write_text(json.dumps(order))
        env = dict(
            os.environ,
            PYTHONDONTWRITEBYTECODE="1",
            OMP_NUM_THREADS="1",  # one core per run: the runs share the machine's cores
            **{mutant_order.ORDER: str(order_file), mutant_order.RECORD: str(record_file)},
        )
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:logging"]
        command += ["-p", "no:xdist", "-p", "tests._support.mutant_order", *tests]
        started = time.perf_counter()
        try:
            done = subprocess.run(  # noqa: S603  # this interpreter, fixed arguments
                command, cwd=where, env=env, capture_output=True, text=True, check=False, timeout=limit
            )
        except subprocess.TimeoutExpired:
            return Outcome(False, time.perf_counter() - started, "(past the time limit)", {})
        seconds = time.perf_counter() - started
        if not record_file.exists():  # pytest stopped before its session ended (an import error in conftest)
            return Outcome(False, seconds, "(pytest did not finish: " + done.stdout[-300:] + ")", {})
        record = json.loads(record_file.read_text())
        failed = record["failed"] or (None if done.returncode == 0 else f"(pytest exit code {done.returncode})")
        return Outcome(done.returncode == 0, seconds, failed, record["seconds"])


def _verify_unmutated(trees: list[Path], tests: list[str]) -> list[str]:
    """The given tests that fail on the unmutated code (split among the trees, run side by side)."""
    if not tests:
        return []
    chunks = [chunk for i in range(len(trees)) if (chunk := tests[i :: len(trees)])]  # none empty: that runs all
    with ThreadPoolExecutor(len(trees)) as pool:
        runs = pool.map(lambda tree, chunk: _run_tests(tree, chunk, chunk, None), trees[: len(chunks)], chunks)
        outcomes = list(runs)
    return [outcome.failed or chunk[0] for chunk, outcome in zip(chunks, outcomes, strict=True) if not outcome.passed]


def _run_mutants(trees: list[Path], chosen: list[Mutant], known: Known) -> dict[str, Outcome]:
    """Each mutant's run, side by side, one per tree; each fate printed as it comes."""
    # A mutant that hangs a test is caught by a limit well past the whole suite's time.
    limit = max(1800.0, 3 * sum(known.seconds.values()))
    free: Queue[Path] = Queue()
    for tree in trees:
        free.put(tree)
    lock = threading.Lock()
    fates: dict[str, Outcome] = {}

    def run(mutant: Mutant) -> None:
        where = free.get()
        try:
            path = where / mutant.path
            original = path.read_text()
            path.write_text(original.replace(mutant.old, mutant.new))
            try:
                order = known.order(known.killers.get(mutant.name), SUBJECTS.get(mutant.path, ()))
                outcome = _run_tests(where, order, list(TESTS), limit)
            finally:
                path.write_text(original)
        finally:
            free.put(where)
        with lock:
            fates[mutant.name] = outcome
            fate = "SURVIVED" if outcome.passed else "killed"
            note = f"  (equivalent: {EQUIVALENT[mutant.name]})" if mutant.name in EQUIVALENT else ""
            by = f"  by {outcome.failed}" if outcome.failed else ""
            print(f"{fate:8}  {outcome.seconds:5.0f} s  {mutant.name}{by}{note}", flush=True)

    with ThreadPoolExecutor(len(trees)) as pool:
        list(pool.map(run, chosen))
    return fates


def _killer(outcome: Outcome) -> str | None:
    """The test that killed the mutant, where a test did (not a time limit or a crash)."""
    return outcome.failed if outcome.failed and outcome.failed.startswith("tests/") else None


def main(argv: list[str] | None = None) -> int:
    """Run every mutant (or those named with ``--only``); print fates and the score."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], help="run the mutants whose name contains this")
    parser.add_argument("-n", "--workers", type=int, default=2, help="mutants run side by side (default 2)")
    parser.add_argument("--equivalents", action="store_true", help="also run the mutants listed as equivalent")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or any(word in m.name for word in args.only)]
    stale = [m for m in chosen if (ROOT / m.path).read_text().count(m.old) != 1]
    for mutant in stale:
        print(f"STALE: {mutant.name!r}: its text is not exactly once in {mutant.path}")
    if stale:
        return 2
    skipped = [m for m in chosen if m.name in EQUIVALENT and not args.equivalents]
    chosen = [m for m in chosen if m not in skipped]
    known = Known.load()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fp32scope-mutants-") as folder:
        trees = [Path(folder) / str(i) for i in range(max(1, args.workers))]
        for tree in trees:
            _copy_tree(tree)
        # A kill counts only where its test passes unmutated: the known killers first
        # (minutes), the ones this run finds at its end.
        used = sorted({known.killers[m.name] for m in chosen if m.name in known.killers})
        failing = _verify_unmutated(trees, used)
        if failing:
            print(f"the tests fail unmutated: {', '.join(failing)}: fix them first")
            return 2
        print(f"unmutated: the {len(used)} known killers pass ({time.perf_counter() - started:.0f} s)", flush=True)
        fates = _run_mutants(trees, chosen, known)
        failing = _verify_unmutated(trees, sorted({_killer(o) or "" for o in fates.values()} - {"", *used}))
    for name, outcome in fates.items():
        known.seconds.update(outcome.times)
        killer = _killer(outcome)
        if killer and killer not in failing:
            known.killers[name] = killer
        else:
            known.killers.pop(name, None)
    known.save()
    for mutant in skipped:
        print(f"{'not run':8}         {mutant.name}  (equivalent: {EQUIVALENT[mutant.name]}; --equivalents runs it)")
    if failing:
        print(f"the tests fail unmutated: {', '.join(failing)}: fix them first")
        return 2
    counted = [n for n in fates if n not in EQUIVALENT]
    killed = sum(not fates[n].passed for n in counted)
    score = killed / len(counted) if counted else 1.0
    minutes = (time.perf_counter() - started) / 60
    print(
        f"score: {killed} of {len(counted)} killed ({score:.0%}), target {TARGET:.0%}; "
        f"{minutes:.0f} min, {len(trees)} side by side"
    )
    return 0 if score >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
