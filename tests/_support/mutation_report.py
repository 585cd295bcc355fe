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
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from collections import Counter
from pathlib import Path

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


def equivalents() -> list[tuple[str, str]]:
    """(pattern, reason) per line of the equivalents file: a mutant name or an fnmatch glob, then ``  # `` and why."""
    entries = []
    for raw in EQUIVALENTS.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, _, reason = line.partition("  # ")
        entries.append((pattern.strip(), reason.strip()))
    return entries


def explain(statuses: dict[str, str], entries: list[tuple[str, str]]) -> tuple[dict[str, str], set[str]]:
    """The reason for each mutant not killed that an entry explains, and the entries used."""
    explained: dict[str, str] = {}
    used: set[str] = set()
    for name, status in statuses.items():
        if status not in NOT_KILLED:
            continue
        for pattern, reason in entries:
            if fnmatch.fnmatchcase(name, pattern):
                explained[name] = reason
                used.add(pattern)
                break
    return explained, used


def rerun_survivors() -> None:
    """Run every surviving mutant that counts again, by name, so that its verdict is the by-name one.

    The mutants the equivalents file explains are left out of the score either way.
    """
    statuses = results()
    explained, _ = explain(statuses, equivalents())
    # "no tests" too: a test added since the full run may reach the mutated function now.
    survivors = [
        name for name, status in statuses.items() if status in {"survived", "no tests"} and name not in explained
    ]
    if survivors:
        print(f"mutation_report: running the {len(survivors)} survivors again by name", flush=True)
        # One at a time: a verdict that depends on what ran beside it is no verdict.
        subprocess.run(["mutmut", "run", "--max-children", "1", *survivors], check=True)  # noqa: S603, S607


def main() -> int:
    if "--rerun-survivors" in sys.argv[1:]:
        rerun_survivors()
    statuses = results()
    if not statuses:
        print("mutation_report: no results: run `mutmut run` first", file=sys.stderr)
        return 2
    entries = equivalents()
    explained, used = explain(statuses, entries)
    counted = {n: s for n, s in statuses.items() if n not in explained and s not in PENDING}
    tally = Counter(counted.values())
    killed = sum(tally[status] for status in KILLED)
    score = killed / len(counted) if counted else 0.0
    print(f"mutants: {len(statuses)}; explained (equivalent or unreachable here): {len(explained)}")
    print("counted: " + ", ".join(f"{status} {n}" for status, n in sorted(tally.items())))
    by_reason = Counter(explained.values())
    for reason, n in sorted(by_reason.items(), key=lambda item: -item[1]):
        print(f"  explained, {n}: {reason}")
    unexplained = sorted(n for n, s in counted.items() if s in NOT_KILLED)
    for name in unexplained:
        print(f"\n--- not killed ({counted[name]}): {name}")
        print(_mutmut("show", name).rstrip())
    for pattern, reason in entries:
        if pattern not in used:
            print(f"stale entry in {EQUIVALENTS.name} (matches no surviving mutant): {pattern}  # {reason}")
    pending = sum(1 for s in statuses.values() if s in PENDING)
    if pending:
        print(f"\nnot checked yet: {pending} (the run was interrupted; `mutmut run` resumes)")
    print(
        f"\nof all {len(statuses)} mutants: {killed} killed, {len(explained)} explained, "
        f"{len(counted) - killed} not killed, {pending} not checked"
    )
    print(f"mutation score: {score:.1%} killed ({killed} of the {len(counted)} not explained); target {TARGET:.0%}")
    return 0 if score >= TARGET and not pending else 1


if __name__ == "__main__":
    sys.exit(main())
