"""The mutation session's report: which entries explain which mutants on which torch release."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support import mutation_report as report

FILE = """\
# a comment
[on 2.4.1] pkg.x_legacy__mutmut_*  # legacy only
pkg.x_legacy__mutmut_7  # equivalent: an unused slot
[on 2.15.0] pkg.x_apply__mutmut_3  # bfx9 only
pkg.x_gone__mutmut_1  # explains a mutant that no longer survives
"""


@pytest.fixture
def entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[report.Entry]:
    path = tmp_path / "equivalents.txt"
    path.write_text(FILE)
    monkeypatch.setattr(report, "EQUIVALENTS", path)
    return report.equivalents()


STATUSES = {
    "pkg.x_legacy__mutmut_1": "survived",
    "pkg.x_legacy__mutmut_2": "killed",
    "pkg.x_legacy__mutmut_7": "survived",
    "pkg.x_apply__mutmut_3": "survived",
    "pkg.x_apply__mutmut_4": "survived",
}


def test_tags_comments_and_reasons_are_read(entries: list[report.Entry]) -> None:
    assert entries == [
        report.Entry("pkg.x_legacy__mutmut_*", "legacy only", "2.4.1"),
        report.Entry("pkg.x_legacy__mutmut_7", "equivalent: an unused slot", None),
        report.Entry("pkg.x_apply__mutmut_3", "bfx9 only", "2.15.0"),
        report.Entry("pkg.x_gone__mutmut_1", "explains a mutant that no longer survives", None),
    ]


def test_a_release_selects_the_patterns_tagged_with_it(entries: list[report.Entry]) -> None:
    assert report.selection(entries, "2.4.1") == ["pkg.x_legacy__mutmut_*"]
    assert report.selection(entries, "2.15.0") == ["pkg.x_apply__mutmut_3"]
    assert report.selection(entries, "2.13.0") == []


def test_off_its_release_a_tagged_entry_explains_its_survivors_as_mutated_there(entries: list[report.Entry]) -> None:
    explained, used = report.explain(STATUSES, entries, "2.13.0")
    assert explained == {
        "pkg.x_legacy__mutmut_1": "mutated on torch 2.4.1 (nox -s mutation-2.4.1)",
        # An equivalent is one everywhere, and wins over the tag that also matches.
        "pkg.x_legacy__mutmut_7": "equivalent: an unused slot",
        "pkg.x_apply__mutmut_3": "mutated on torch 2.15.0 (nox -s mutation-2.15.0)",
    }
    assert "pkg.x_apply__mutmut_4" not in explained  # untagged: it counts
    assert used == {"pkg.x_legacy__mutmut_*", "pkg.x_legacy__mutmut_7", "pkg.x_apply__mutmut_3"}


def test_on_its_release_a_tagged_entry_explains_nothing(entries: list[report.Entry]) -> None:
    explained, _ = report.explain(STATUSES, entries, "2.4.1")
    assert "pkg.x_legacy__mutmut_1" not in explained  # counts in the 2.4.1 score
    assert explained["pkg.x_legacy__mutmut_7"] == "equivalent: an unused slot"
    assert explained["pkg.x_apply__mutmut_3"] == "mutated on torch 2.15.0 (nox -s mutation-2.15.0)"


def test_stale_entries(entries: list[report.Entry]) -> None:
    _, used = report.explain(STATUSES, entries, "2.13.0")
    assert report.stale(STATUSES, entries, used) == [entries[3]]
    # A tagged entry is stale only when it matches no mutant at all, killed ones included.
    killed_only = {"pkg.x_legacy__mutmut_2": "killed"}
    _, used = report.explain(killed_only, entries, "2.13.0")
    assert [e.pattern for e in report.stale(killed_only, entries, used)] == [
        "pkg.x_legacy__mutmut_7",
        "pkg.x_apply__mutmut_3",
        "pkg.x_gone__mutmut_1",
    ]


def test_only_keeps_the_mutants_of_the_patterns() -> None:
    assert set(report.only(STATUSES, ["pkg.x_apply__*"])) == {"pkg.x_apply__mutmut_3", "pkg.x_apply__mutmut_4"}
    assert report.only(STATUSES, []) == STATUSES


def test_the_shipped_file_tags_the_releases_the_noxfile_mutates() -> None:
    # Every [on RELEASE] names a release with a mutation session, and each such session has mutants.
    tagged = {entry.on for entry in report.equivalents() if entry.on is not None}
    noxfile = (Path(report.__file__).parents[2] / "noxfile.py").read_text()
    assert tagged == {"2.4.1", "2.15.0"}
    assert 'MUTATION_RELEASES = ["2.4.1", "2.15.0"]' in noxfile
