"""The region mutants' runner: the order it gives each mutant's tests, and the plugin that runs them so.

A wrong order costs only time, but a wrong record (the first failure, or a kill counted for
a test that did not fail) is a wrong score: the plugin runs here in a real pytest, on a
small test file of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests._support import mutant_order
from tests._support.region_mutants import MUTANTS, SUBJECTS, Known

ROOT = Path(__file__).resolve().parents[2]

A, B, C = "tests/compile/test_a.py::one", "tests/compile/test_b.py::two", "tests/wrappers/test_c.py::three"


def test_a_mutants_own_killer_runs_first_then_its_subjects_tests_then_the_other_killers_quickest_first() -> None:
    d = "tests/compile/test_a.py::quick"
    known = Known(killers={"m": C, "other": B}, seconds={A: 5.0, B: 1.0, C: 9.0, d: 0.5})
    order = known.order(C, ("tests/compile/test_a.py",))
    assert order == [C, d, A, "tests/compile/test_a.py", B]


def test_with_nothing_known_every_timed_test_runs_quickest_first() -> None:
    known = Known(killers={}, seconds={A: 3.0, B: 1.0, C: 2.0})
    assert known.order(None) == [B, C, A]


def test_every_mutated_module_has_its_subject_files_and_they_exist() -> None:
    assert {m.path for m in MUTANTS} <= set(SUBJECTS)
    for files in SUBJECTS.values():
        assert all((ROOT / f).is_file() for f in files), files


def _run(tmp_path: Path, order: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The plugin in a real pytest on three tests (the second fails); what ran, in order, and the record."""
    ran = tmp_path / "ran.txt"
    (tmp_path / "test_three.py").write_text(
        "from pathlib import Path\n"
        f"RAN = Path({str(ran)!r})\n"
        "def _note(name):\n"
        "    with RAN.open('a') as f:\n"
        "        f.write(name + '\\n')\n"
        "def test_first():\n    _note('test_first')\n"
        "def test_second():\n    _note('test_second')\n    assert False\n"
        "def test_third():\n    _note('test_third')\n"
    )
    order_file, record_file = tmp_path / "order.json", tmp_path / "record.json"
    order_file.write_text(json.dumps(order))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.update({mutant_order.ORDER: str(order_file), mutant_order.RECORD: str(record_file)})
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    command += ["-p", "tests._support.mutant_order", "test_three.py"]
    subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, check=False, timeout=120)  # noqa: S603
    return ran.read_text().split(), json.loads(record_file.read_text())


def test_the_plugin_runs_the_named_tests_first_and_records_the_first_failure(tmp_path: Path) -> None:
    ran, record = _run(tmp_path, ["test_three.py::test_third", "test_three.py::test_second"])
    assert ran == ["test_third", "test_second"]  # -x: stopped at the first failure, test_first never ran
    assert record["failed"] == "test_three.py::test_second"
    assert set(record["seconds"]) == {"test_three.py::test_third", "test_three.py::test_second"}


def test_the_plugin_ranks_a_test_not_named_where_its_file_is_named(tmp_path: Path) -> None:
    ran, record = _run(tmp_path, ["test_three.py::test_third", "test_three.py"])
    assert ran == ["test_third", "test_first", "test_second"]
    assert record["failed"] == "test_three.py::test_second"


def test_an_empty_order_leaves_the_collected_order(tmp_path: Path) -> None:
    ran, _ = _run(tmp_path, [])
    assert ran == ["test_first", "test_second"]
