"""Hand-made mutants of the in-graph region code, and whether the region tests kill each.

mutmut cannot mutate ``_wrappers/region/``, ``_wrappers/carriers.py``,
``_wrappers/layouts.py`` and ``_wrappers/inner.py`` usefully: their tests compile, and
Dynamo cannot trace mutmut's trampolines. So each mutant here is one edit a plausible wrong implementation would make (a
copy left out, a scope not entered, a write-back skipped), named with what it breaks.
``nox -s mutation-regions`` (or ``python tests/_support/region_mutants.py`` from the
repository root) copies the repository to a
temporary folder, applies one mutant at a time there, runs ``TESTS`` against it (stopping
at the first failure), prints each mutant's fate and the score, and exits non-zero when the
score is under ``TARGET`` or a mutant's text is no longer in its file (the list must follow
the code). The working tree is never changed.

``EQUIVALENT`` names mutants that change no behaviour the tests can see, each with why;
they are run and reported, and left out of the score.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
TARGET = 0.90
TESTS = (
    "tests/compile/test_regions.py",
    "tests/compile/test_region_outputs.py",
    "tests/compile/test_region_attention.py",
    "tests/compile/test_region_caches.py",
    "tests/compile/test_region_carried.py",
    "tests/compile/test_eager_nodes.py",
    "tests/compile/test_inner.py",
    "tests/compile/test_region_state.py",
    "tests/compile/test_region_faults.py",
    "tests/compile/test_region_backends.py",
    "tests/wrappers/test_layouts.py",
)
REGION = "fp32scope/_wrappers/region"  # a package: a mutant names the module its text is in
REGIONS = f"{REGION}/regions.py"
BOUNDARY = f"{REGION}/boundary.py"
EAGER = f"{REGION}/eager.py"
INSIDE = f"{REGION}/inside.py"
ENTRY = f"{REGION}/entry.py"
CARRIERS = "fp32scope/_wrappers/carriers.py"
INNER = "fp32scope/_wrappers/inner.py"
PROXY = "fp32scope/_wrappers/proxy.py"
LAYOUTS = "fp32scope/_wrappers/layouts.py"


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
        "        numbers = [\n            next(_sites),\n",
        "        numbers = [\n            0,\n",
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
        "            while grow and len(obj) <= index:",
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
        '        _diff_constant(entries.get(key, _UNSET), value, path, ("item", key), found)',
        "        pass",
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
        INNER,
        "    with entry.scope:\n        return entry.forward.run(values)",
        "    if entry.scope:\n        return entry.forward.run(values)",
    ),
    Mutant(
        "a compiled-inside node's backward runs outside its scope",
        INNER,
        "    with entry.backward_scope:\n        out = backward.run(values)",
        "    if entry.backward_scope:\n        out = backward.run(values)",
    ),
    Mutant(
        "a compiled-inside node's backward is reported as its forward",
        INNER,
        "    with entry.backward_scope:\n        out = backward.run(values)",
        "    with entry.scope:\n        out = backward.run(values)",
    ),
    Mutant(
        "a changed attribute of a compiled-inside node is ignored",
        INNER,
        "    chosen = entry if state_holds(entry) else variant(entry)\n    entry.last = chosen",
        "    chosen = entry\n    entry.last = chosen",
    ),
    Mutant(
        "a changed attribute of a compiled-inside node's submodule is ignored",
        INNER,
        "        for sub in module.modules()\n",
        "        for sub in (module,)\n",
    ),
    Mutant(
        "graphs traced again for a changed attribute run whatever they return",
        INNER,
        "        if found is None or found.signature() != entry.signature():",
        "        if found is None:",
    ),
    Mutant(
        "graphs are traced again past Dynamo's recompile limit",
        INNER,
        "        if entry.retrace is not None and len(entry.variants) + 1 >= limit:",
        "        if False:",
    ),
    Mutant(
        "graphs traced for a changed attribute are not kept (traced again at every call)",
        INNER,
        "        entry.variants[key] = found\n",
        "        pass\n",
    ),
    Mutant(
        "a backward runs the graphs of attributes changed after its forward",
        INNER,
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
        INNER,
        "    if layout is None or value.stride() == layout[1]:",
        "    if True:",
    ),
    Mutant(
        "a compiled-inside op's outputs may alias its inputs",
        INNER,
        "        if storage in seen:\n            found.append(i)",
        "        if False:\n            found.append(i)",
    ),
    Mutant(
        "a compiled-inside op's later calls take inputs laid out otherwise as they come",
        INNER,
        "        if [v.stride() for v in values] == self.strides:",
        "        if True:",
    ),
    Mutant(
        "a compiled-inside op's outputs keep the compiled code's layout",
        INNER,
        "            if o is not None and layout is not None and o.stride() != layout[1]",
        "            if False",
    ),
    Mutant(
        "a compiled-inside op's later calls copy no aliasing output",
        INNER,
        "        for i in self.copies:\n            out[i] = _copy(out[i])",
        "        for i in ():\n            out[i] = _copy(out[i])",
    ),
    Mutant(
        "compiled-inside entry numbers alike in every process",
        INNER,
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
        INNER,
        "                graph.graph.call_function(torch.ops.aten.copy_.default, (placeholders[i], new))",
        "                pass",
    ),
    Mutant(
        "an input updated in place but laid out otherwise is not written back",
        INNER,
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


def _run_tests(where: Path, workers: str, limit: float | None = None) -> tuple[bool, float]:
    """Whether the tests pass in ``where``, and in how many seconds (past ``limit``: they fail, as mutmut counts)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:logging"]
    try:
        done = subprocess.run(  # noqa: S603  # this interpreter, fixed arguments
            [*command, "-n", workers, *TESTS],
            cwd=where,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - started
    return done.returncode == 0, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    """Run every mutant (or those named with ``--only``); print fates and the score."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], help="run the mutants whose name contains this")
    parser.add_argument("-n", "--workers", default="2", help="pytest-xdist workers (default 2)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or any(word in m.name for word in args.only)]
    stale = [m for m in chosen if (ROOT / m.path).read_text().count(m.old) != 1]
    for mutant in stale:
        print(f"STALE: {mutant.name!r}: its text is not exactly once in {mutant.path}")
    if stale:
        return 2
    with tempfile.TemporaryDirectory(prefix="fp32scope-mutants-") as folder:
        where = Path(folder)
        _copy_tree(where)
        passed, seconds = _run_tests(where, args.workers)
        if not passed:
            print(f"the tests fail unmutated ({seconds:.0f} s): fix them first")
            return 2
        print(f"unmutated: pass ({seconds:.0f} s)")
        limit = 10 * seconds  # a mutant that makes a test hang is caught by this
        killed: list[str] = []
        survived: list[str] = []
        for mutant in chosen:
            path = where / mutant.path
            original = path.read_text()
            path.write_text(original.replace(mutant.old, mutant.new))
            try:
                passed, seconds = _run_tests(where, args.workers, limit)
            finally:
                path.write_text(original)
            (survived if passed else killed).append(mutant.name)
            fate = "SURVIVED" if passed else "killed"
            note = f"  (equivalent: {EQUIVALENT[mutant.name]})" if mutant.name in EQUIVALENT else ""
            print(f"{fate:8}  {seconds:5.0f} s  {mutant.name}{note}", flush=True)
    counted = [n for n in killed + survived if n not in EQUIVALENT]
    score = sum(n in killed for n in counted) / len(counted) if counted else 1.0
    print(f"score: {sum(n in killed for n in counted)} of {len(counted)} killed ({score:.0%}), target {TARGET:.0%}")
    return 0 if score >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
