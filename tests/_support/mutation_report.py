"""The mutation score and the survivors of the last ``mutmut run`` (``nox -s mutation`` runs it).

Run from the repository root after ``mutmut run``. With ``--rerun-survivors`` it first runs
every surviving mutant that the equivalents file does not explain again by name
(``mutmut run NAME ...``): mutmut 3.8.1's full run
reports as survivors some mutants that their tests kill when the mutant runs by name (seen
with tests/flags/test_state_machine.py's legacy test, which swaps the implementation in with
monkeypatch; checked by hand against the mutated source). Then it reads mutmut's results,
takes out the mutants that ``tests/_support/mutation_equivalents.txt`` explains (an equivalent
mutant, or code the mutation run cannot reach, each with its reason), prints the score over
the rest and every unexplained survivor with its diff, and exits non-zero when the score is
under ``TARGET``.
An entry of the equivalents file that no longer matches a surviving mutant is printed as
stale, so that the file does not outlive the code it explains.

Entries tagged ``[on RELEASE]`` name code that runs on one line of torch releases only (the
legacy implementation, on torch < 2.9; cuda matmul "bfx9", from 2.15): ``--selection``
prints their patterns for that release, which ``nox -s mutation-RELEASE`` mutates there, and
``--only PATTERN`` (given once per pattern) limits the score to the mutants they match. On the
release an entry is tagged with, it explains nothing (its mutants count); on every other
release it explains its survivors as "mutated on torch RELEASE". ``--release`` is the torch
release the run is on (default: the installed torch's).
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import subprocess
import sys
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

TARGET = 0.90
EQUIVALENTS = Path(__file__).with_name("mutation_equivalents.txt")
# A mutant that makes the tests run past mutmut's time limit (an endless loop) is detected,
# as one that fails them is: "timeout" counts as killed.
KILLED = ("killed", "caught by type check", "timeout")
NOT_KILLED = ("survived", "no tests", "suspicious", "segfault")
PENDING = ("not checked", "check was interrupted by user", "skipped")


def _mutmut(*args: str) -> str:
    done = subprocess.run(["mutmut", *args], capture_output=True, text=True, check=True)  # noqa: S603, S607
    return done.stdout


def results() -> dict[str, str]:
    """Every mutant's status, by name, from ``mutmut results --all true``."""
    found: dict[str, str] = {}
    for line in _mutmut("results", "--all", "true").splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name.startswith("fp32scope."):
            found[name] = status
    return found


class Entry(NamedTuple):
    """One line of the equivalents file."""

    pattern: str
    reason: str
    #: The torch release whose run mutates these mutants (``[on RELEASE]``), or None: equivalent everywhere.
    on: str | None


_TAG = re.compile(r"\[on (?P<release>[0-9][0-9.]*)\]\s+")


def equivalents() -> list[Entry]:
    """Each line of the equivalents file: ``[on RELEASE] `` or nothing, a mutant name or fnmatch glob, ``  # ``, why."""
    entries = []
    for raw in EQUIVALENTS.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tag = _TAG.match(line)
        on = tag["release"] if tag else None
        pattern, _, reason = line[tag.end() if tag else 0 :].partition("  # ")
        entries.append(Entry(pattern.strip(), reason.strip(), on))
    return entries


def selection(entries: list[Entry], release: str) -> list[str]:
    """The patterns of the entries tagged ``[on release]``: what that release's run mutates."""
    return [entry.pattern for entry in entries if entry.on == release]


def explain(statuses: dict[str, str], entries: list[Entry], release: str) -> tuple[dict[str, str], set[str]]:
    """The reason for each mutant not killed that an entry explains on ``release``, and the patterns used.

    Untagged entries (equivalent on every release) are tried first; a tagged entry explains
    only off its own release.
    """
    explained: dict[str, str] = {}
    used: set[str] = set()
    ordered = [e for e in entries if e.on is None] + [e for e in entries if e.on is not None and e.on != release]
    for name, status in statuses.items():
        if status not in NOT_KILLED:
            continue
        for entry in ordered:
            if fnmatch.fnmatchcase(name, entry.pattern):
                explained[name] = (
                    entry.reason if entry.on is None else f"mutated on torch {entry.on} (nox -s mutation-{entry.on})"
                )
                used.add(entry.pattern)
                break
    return explained, used


def stale(statuses: dict[str, str], entries: list[Entry], used: set[str]) -> list[Entry]:
    """The entries that no longer explain anything: untagged ones matching no survivor, tagged ones no mutant."""
    found = []
    for entry in entries:
        if entry.on is None:
            if entry.pattern not in used:
                found.append(entry)
        elif not any(fnmatch.fnmatchcase(name, entry.pattern) for name in statuses):
            found.append(entry)
    return found


def only(statuses: dict[str, str], patterns: list[str]) -> dict[str, str]:
    """The statuses of the mutants matching one of ``patterns`` (all of them for no patterns)."""
    if not patterns:
        return statuses
    return {n: s for n, s in statuses.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}


def installed_release() -> str:
    """The installed torch's release, without its local part ("2.4.1" for "2.4.1+cpu")."""
    return metadata.version("torch").partition("+")[0]


def rerun_survivors(release: str, patterns: list[str]) -> None:
    """Run every surviving mutant that counts again, by name, so that its verdict is the by-name one.

    The mutants the equivalents file explains are left out of the score either way.
    """
    statuses = only(results(), patterns)
    explained, _ = explain(statuses, equivalents(), release)
    # "no tests" too: a test added since the full run may reach the mutated function now.
    survivors = [
        name for name, status in statuses.items() if status in {"survived", "no tests"} and name not in explained
    ]
    if survivors:
        print(f"mutation_report: running the {len(survivors)} survivors again by name", flush=True)
        # One at a time: a verdict that depends on what ran beside it is no verdict.
        subprocess.run(["mutmut", "run", "--max-children", "1", *survivors], check=True)  # noqa: S603, S607


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rerun-survivors", action="store_true", help="run each counted survivor again by name first")
    parser.add_argument("--release", default=None, help="the torch release of the run (default: the installed one)")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN", help="score these mutants only")
    parser.add_argument("--selection", action="store_true", help="print the patterns tagged [on RELEASE] and exit")
    args = parser.parse_args(argv)
    release: str = args.release or installed_release()
    entries = equivalents()
    if args.selection:
        patterns = selection(entries, release)
        if not patterns:
            print(f"mutation_report: no entry is tagged [on {release}]", file=sys.stderr)
            return 2
        print("\n".join(patterns))
        return 0
    if args.rerun_survivors:
        rerun_survivors(release, args.only)
    statuses = only(results(), args.only)
    if not statuses:
        print("mutation_report: no results: run `mutmut run` first", file=sys.stderr)
        return 2
    explained, used = explain(statuses, entries, release)
    counted = {n: s for n, s in statuses.items() if n not in explained and s not in PENDING}
    tally = Counter(counted.values())
    killed = sum(tally[status] for status in KILLED)
    score = killed / len(counted) if counted else 0.0
    scope = f", the mutants of {len(args.only)} patterns" if args.only else ""
    print(f"torch {release}{scope}")
    print(f"mutants: {len(statuses)}; explained (equivalent, or mutated on another release): {len(explained)}")
    print("counted: " + ", ".join(f"{status} {n}" for status, n in sorted(tally.items())))
    by_reason = Counter(explained.values())
    for reason, n in sorted(by_reason.items(), key=lambda item: -item[1]):
        print(f"  explained, {n}: {reason}")
    unexplained = sorted(n for n, s in counted.items() if s in NOT_KILLED)
    for name in unexplained:
        print(f"\n--- not killed ({counted[name]}): {name}")
        print(_mutmut("show", name).rstrip())
    # With --only, the file's other entries are about mutants this run did not score.
    for entry in stale(statuses, entries, used) if not args.only else []:
        tag = f"[on {entry.on}] " if entry.on else ""
        print(f"stale entry in {EQUIVALENTS.name} (explains nothing here): {tag}{entry.pattern}  # {entry.reason}")
    pending = sum(1 for s in statuses.values() if s in PENDING)
    if pending:
        print(f"\nnot checked yet: {pending} (the run was interrupted; `mutmut run` resumes)")
    print(
        f"\nof all {len(statuses)} mutants: {killed} killed, {len(explained)} explained, "
        f"{len(counted) - killed} not killed, {pending} not checked"
    )
    print(
        f"mutation score on torch {release}: {score:.1%} killed ({killed} of the {len(counted)} not explained); "
        f"target {TARGET:.0%}"
    )
    return 0 if score >= TARGET and not pending else 1


if __name__ == "__main__":
    sys.exit(main())
