"""The version matrix: parsing, rows, the table in docs/versions.md, and the decision, probe first.

Expectations come from the rows in ``fsdp_autopatch._matrix`` (the one place version facts are
stated), not restated here.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Optional

import made_up_releases
import pytest
import version_table

from fsdp_autopatch import _config, _matrix, _sites

VERSIONS = [
    ("2.8.0+cu128", (2, 8)), ("2.13.0a0+git1234abc", (2, 13)), ("2.9.0.dev20250801", (2, 9)),
    ("4.55.0rc1", (4, 55)), ("2.13.0", (2, 13)), ("4.55.2", (4, 55, 2)), ("v2.4.1", (2, 4, 1)),
    ("1!2.6.0", (2, 6)), ("4.55.2.post1", (4, 55, 2)), ("3.15.0a1", (3, 15)), (" 2.5.1 ", (2, 5, 1)),
    ("2.6.0.dev0+cpu.cxx11.abi", (2, 6)), ("4.56.0-rc.1", (4, 56)),
]
NOT_VERSIONS = ["", "abc", "None", "2.8.0garbage", "2.8.0 rc1 x", "2..8", "2.8.0+", "+cu128", "2.8.0+cu 128"]


@pytest.fixture(params=["packaging", "fallback"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``_matrix.release`` with packaging (where installed) and with its fallback grammar."""
    if request.param == "packaging":
        pytest.importorskip("packaging.version")
    else:
        monkeypatch.setitem(sys.modules, "packaging.version", None)  # import now raises ImportError
    return str(request.param)


@pytest.mark.parametrize(("version", "release"), VERSIONS)
def test_release(reader: str, version: str, release: tuple[int, ...]) -> None:
    assert _matrix.release(version) == release


@pytest.mark.parametrize("version", NOT_VERSIONS)
def test_release_rejects_non_versions(reader: str, version: str) -> None:
    with pytest.raises(ValueError, match="not a version"):
        _matrix.release(version)


ALL_ROWS = {"torch": _matrix.TORCH_ROWS, "transformers": _matrix.TRANSFORMERS_ROWS,
            "python": _matrix.PYTHON_ROWS}


def text(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def before(end: Optional[tuple[int, ...]]) -> str:
    """The release just before an exclusive end: (2, 4) -> "2.3"."""
    assert end is not None
    return text((*end[:-1], end[-1] - 1))


@pytest.mark.parametrize("name", list(ALL_ROWS))
def test_rows_tile_every_release_without_gaps_and_carry_evidence(name: str) -> None:
    rows = ALL_ROWS[name]
    assert rows[0].first == (0,)
    for before, after in zip(rows, rows[1:]):
        assert before.end == after.first
    assert all(row.package == name and row.evidence for row in rows)


@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_a_torch_release_is_one_row_and_every_fsdp2_release_has_one(
    release: Optional[made_up_releases.MadeUpRelease], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adding a torch release is one row: 2.<minor> covers 2.<minor>.x (the made-up releases'
    rows, 99.<minor>, as well)."""
    made_up_releases.add_rows(release, monkeypatch.setattr)
    fsdp2 = _matrix.TORCH_ROWS[1:]
    real = [row for row in fsdp2 if row.first[0] == 2]
    assert [row.first for row in real] == [(2, minor) for minor in range(4, 4 + len(real))]
    assert all(row.end == (row.first[0], row.first[1] + 1) for row in fsdp2)
    assert all(_matrix.row_for(_matrix.TORCH_ROWS, "{}.{}.1+cu128".format(*row.first)) is row
               for row in fsdp2)


@pytest.mark.parametrize("name", list(ALL_ROWS))
def test_each_row_covers_its_own_bounds(name: str) -> None:
    rows = ALL_ROWS[name]
    for index, row in enumerate(rows):
        assert _matrix.row_for(rows, text(row.first)) is row
        # Pre-releases and local builds count as the release they lead to.
        assert _matrix.row_for(rows, f"{text(row.first)}rc1+local") is row
        if row.end is not None:
            following = rows[index + 1] if index + 1 < len(rows) else None
            assert _matrix.row_for(rows, text(row.end)) is following


def test_torch_newer_than_the_rows_is_in_no_row() -> None:
    newer = version_table.first_release_after(_matrix.TORCH_ROWS)
    assert _matrix.row_for(_matrix.TORCH_ROWS, text(newer)) is None
    assert _matrix.row_for(_matrix.TORCH_ROWS, text((newer[0] + 1, 0))) is None
    assert _matrix.row_for(_matrix.TORCH_ROWS, text(_matrix.TORCH_ROWS[-1].first)) is not None


@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_every_fsdp2_torch_in_the_rows_is_affected_and_only_a_release_with_torchs_fix_is_fixed(
    release: Optional[made_up_releases.MadeUpRelease], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the rows before FSDP2 are unaffected; a release whose every site builds accepted
    classes itself is fixed, and none up to 2.15 is (the fix promised for 2.9 never shipped)."""
    made_up_releases.add_rows(release, monkeypatch.setattr)
    fsdp2 = [row for row in _matrix.TORCH_ROWS if row.first >= (2, 4)]
    assert fsdp2 and all(row.has_fsdp2 for row in fsdp2)
    assert not any(row.has_fsdp2 or row.fixed for row in _matrix.TORCH_ROWS if row not in fsdp2)
    assert not any(row.fixed for row in fsdp2 if row.first <= (2, 15))
    # Once fixed, fixed: a later release that brings the bug back is a finding of its own.
    fixed = [row.fixed for row in fsdp2]
    assert fixed == sorted(fixed)


@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_every_api_has_its_evidence_in_the_record(
    release: Optional[made_up_releases.MadeUpRelease], monkeypatch: pytest.MonkeyPatch
) -> None:
    made_up_releases.add_rows(release, monkeypatch.setattr, version_table)
    assert [site.api for site in version_table.SITE_EVIDENCE] == list(_sites.APIS)
    assert _matrix.ABC_HEADS_TRANSFORMERS == "4.54.0-4.55.2"


AFFECTED_TRANSFORMERS = next(row for row in _matrix.TRANSFORMERS_ROWS if row.abc_heads)
UNAFFECTED_TRANSFORMERS = [row for row in _matrix.TRANSFORMERS_ROWS if not row.abc_heads]
# The newest torch with the bug: a newer one may have torch's fix.
LAST_TORCH = next(row for row in reversed(_matrix.TORCH_ROWS) if row.has_fsdp2 and not row.fixed)
BUGGY_PYTHON = next(row for row in _matrix.PYTHON_ROWS if row.refuses_abc_swap)
FIXED_PYTHON = next(row for row in _matrix.PYTHON_ROWS if not row.refuses_abc_swap)
TORCH = text(LAST_TORCH.first) + ".0"
TRANSFORMERS = text(AFFECTED_TRANSFORMERS.first)
NEWER_TORCH = text(version_table.first_release_after(_matrix.TORCH_ROWS)) + ".0"
# The last Python of the refusing row, e.g. 3.14.1.
BUGGY_PYTHON_VERSION = before(BUGGY_PYTHON.end) + ".1"


def decide(mode: str = _config.AUTO, torch: Optional[str] = TORCH,
           transformers: Optional[str] = TRANSFORMERS, probe: Optional[bool] = None,
           python: str = BUGGY_PYTHON_VERSION) -> _matrix.Decision:
    return _matrix.decide(mode, torch, transformers, probe, python)


def test_affected_pair_is_patched_by_the_matrix_when_no_probe_can_tell() -> None:
    decision = decide()
    assert decision.apply and decision.in_matrix is True and decision.decided_by == _matrix.DECIDED_BY_MATRIX
    assert f"torch {TORCH} with transformers {TRANSFORMERS}" in decision.reason
    assert "version matrix" in decision.reason


@pytest.mark.parametrize("refused", [True, False])
@pytest.mark.parametrize("torch", [TORCH, NEWER_TORCH])
def test_the_probe_decides_when_it_can_tell(refused: bool, torch: str) -> None:
    decision = decide(torch=torch, probe=refused)
    assert decision.apply is refused and decision.decided_by == _matrix.DECIDED_BY_PROBE
    assert "(probed)" in decision.reason and "CPython" in decision.reason
    # The rows keep their own answer, so doctor and the matrix run can compare.
    assert decision.in_matrix is (True if torch == TORCH else None)


def test_python_that_accepts_the_swap_stands_aside() -> None:
    """The transformers heads on a CPython that accepts torch's class: nothing to patch."""
    python = text(FIXED_PYTHON.first) + ".2"
    probed = decide(probe=False, python=python)
    assert not probed.apply and probed.decided_by == _matrix.DECIDED_BY_PROBE and probed.in_matrix is False
    assert probed.reason == (f"CPython {python} accepts torch {TORCH}'s wrapper classes for ABC modules "
                             "(probed): nothing to patch")
    by_rows = decide(python=python)
    assert (by_rows.apply, by_rows.decided_by, by_rows.in_matrix) == (False, _matrix.DECIDED_BY_MATRIX, False)
    assert f"CPython {python} accepts" in by_rows.reason
    # Named once, even where the row's evidence was measured on that very CPython.
    assert by_rows.reason.count(python) == 1, by_rows.reason
    # force still patches there: per class, CPython is asked (Generic[T]-first is still refused).
    assert _matrix.decide(_config.FORCE, TORCH, TRANSFORMERS, lambda: False, python).apply


@pytest.mark.parametrize("row", UNAFFECTED_TRANSFORMERS, ids=version_table.versions)
def test_unaffected_transformers_is_left_alone_unless_forced(row: _matrix.Row) -> None:
    transformers = text(row.first if row.first != (0,) else (4, 53, 3))
    assert not decide(transformers=transformers, probe=True).apply
    assert decide(transformers=transformers).in_matrix is False
    assert decide(transformers=transformers).decided_by == _matrix.DECIDED_BY_MATRIX
    assert decide(_config.FORCE, transformers=transformers).apply


def test_force_needs_no_transformers_but_an_fsdp2_torch() -> None:
    assert decide(_config.FORCE, transformers=None).apply
    assert decide(_config.FORCE, transformers=None).decided_by is None
    assert not decide(_config.FORCE, torch=before(_matrix.TORCH_ROWS[0].end) + ".1").apply
    assert not decide(transformers=None).apply


def test_off_wins() -> None:
    assert not decide(_config.OFF, probe=True).apply
    assert "disabled" in decide(_config.OFF).reason


def test_no_torch() -> None:
    assert not decide(torch=None, probe=True).apply


def test_torch_newer_than_the_rows_without_a_probe_is_left_alone() -> None:
    decision = decide(torch=NEWER_TORCH)
    assert not decision.apply and decision.in_matrix is None
    assert "FSDP_AUTOPATCH=force" in decision.reason


def test_the_probes_answer_decides_inside_the_rows_too() -> None:
    """Behaviour decides: a torch in the rows whose classes CPython accepts is left alone."""
    decision = _matrix.decide(_config.AUTO, TORCH, TRANSFORMERS, probed=False, python=BUGGY_PYTHON_VERSION)
    assert not decision.apply and decision.in_matrix is True
    assert decision.decided_by == _matrix.DECIDED_BY_PROBE


def test_default_python_is_the_running_interpreter() -> None:
    assert _matrix.decide(_config.AUTO, TORCH, TRANSFORMERS).reason.count(_matrix.interpreter()) == 1


def test_the_documented_version_table_is_the_rendered_rows() -> None:
    """docs/versions.md's hand-readable version table is written from the rows, never by hand."""
    assert version_table.documented() == version_table.render(), (
        "docs/versions.md's version table differs from the rows; rewrite it: python tests/version_table.py "
        "--update")


def test_the_generator_works_as_printed_and_reads_the_checkout(tmp_path: Path) -> None:
    """``python tests/version_table.py`` as docs/versions.md prints it, from another directory and
    with no site-packages (``-S``): the checkout's package, never an installed copy."""
    generator = Path(version_table.__file__)
    if not (generator.parent.parent / "fsdp_autopatch").is_dir():
        pytest.skip("no checkout here (an installed wheel's tests)")
    result = subprocess.run([sys.executable, "-S", str(generator)], capture_output=True, text=True,
                            cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == version_table.render()


def test_a_row_without_a_sweep_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch release added to the rows before its wheel is swept: the page says the sweep's
    claim does not cover it."""
    newest = _matrix.TORCH_ROWS[-1]
    later = (newest.first[0], newest.first[1] + 1)
    monkeypatch.setattr(_matrix, "TORCH_ROWS", (*_matrix.TORCH_ROWS[:-1], dataclasses.replace(
        newest, end=later), dataclasses.replace(newest, first=later, end=(later[0], later[1] + 1))))
    (said,) = [line for line in version_table.render().splitlines() if line.startswith("No sweep of every")]
    assert f"{later[0]}.{later[1]}" in said.split("yet for torch ")[1].split(":")[0].split(", ")


@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_rendered_table_has_every_row(
    release: Optional[made_up_releases.MadeUpRelease], monkeypatch: pytest.MonkeyPatch
) -> None:
    made_up_releases.add_rows(release, monkeypatch.setattr, version_table)
    table = version_table.render()
    for rows in (_matrix.TRANSFORMERS_ROWS, _matrix.TORCH_ROWS, _matrix.PYTHON_ROWS):
        for row in rows:
            assert f"| {version_table.versions(row)} | {version_table.bug(row)} | {row.evidence} |" in table
    for site in _sites.SITES:
        assert f"| {site.key} | `{site.name}` |" in table
    for site in version_table.SITE_EVIDENCE:
        assert f"| {site.api} | {site.releases} | {site.evidence} |" in table
    for swap in version_table.OTHER_CLASS_SWAPS:
        assert f"| `{swap.file}` | `{swap.function}` | {swap.reason} |" in table
    assert f"≥ {text(version_table.first_release_after(_matrix.TORCH_ROWS))}" in table


def test_a_release_torch_fixed_is_no_bug_by_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch row ``fixed`` (made-up 99.3: torch's fix at every site): where no probe can run
    (doctor, the matrix), the rows say no bug and nothing to patch, and the table says why; the
    probe still decides where it can, and force still patches."""
    release = made_up_releases.FIXES_THE_BUG
    made_up_releases.add_rows(release, monkeypatch.setattr, version_table)
    fixed, before = _matrix.TORCH_ROWS[-1], _matrix.TORCH_ROWS[-2]
    assert fixed is release.row and fixed.fixed and not before.fixed
    torch = text(fixed.first) + ".0"
    by_rows = decide(torch=torch)
    assert (by_rows.apply, by_rows.in_matrix, by_rows.decided_by) == (False, False, _matrix.DECIDED_BY_MATRIX)
    cpython = _matrix.interpreter(BUGGY_PYTHON_VERSION)
    assert by_rows.reason == (f"torch {torch} builds wrapper classes {cpython} accepts for ABC modules "
                              f"itself (version matrix: {fixed.evidence}): nothing to patch")
    assert decide(torch=text(before.first) + ".0").in_matrix is True
    assert decide(torch=torch, probe=True).apply and decide(_config.FORCE, torch=torch).apply
    table = version_table.render()
    assert f"| torch | {text(fixed.first)} | no: torch's fix | {fixed.evidence} |" in table
    assert f"| torch | {text(before.first)} | yes | {before.evidence} |" in table
    assert f"(../upstream/README.md), first released in torch {text(fixed.first)}): " in table
