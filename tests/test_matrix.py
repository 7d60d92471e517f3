"""The version matrix: parsing, rows, and the decision for each case the rows describe."""

from __future__ import annotations

import pytest

from fsdp_autopatch import _config, _matrix


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.8.0+cu128", (2, 8)), ("2.9.0.dev20250801", (2, 9)), ("4.55.0rc1", (4, 55)),
     ("2.13.0", (2, 13)), ("4.55.2", (4, 55, 2)), ("v2.4.1", (2, 4, 1)), ("1!2.6.0", (2, 6)),
     ("4.55.2.post1", (4, 55, 2))],
)
def test_release(version: str, release: tuple[int, ...]) -> None:
    assert _matrix.release(version) == release


@pytest.mark.parametrize("version", ["", "abc", "None"])
def test_release_rejects_non_versions(version: str) -> None:
    with pytest.raises(ValueError, match="not a version"):
        _matrix.release(version)


@pytest.mark.parametrize(
    ("rows", "name"), [(_matrix.TORCH_ROWS, "torch"), (_matrix.TRANSFORMERS_ROWS, "transformers")]
)
def test_rows_tile_every_release_without_gaps_and_carry_evidence(
    rows: tuple[_matrix.Row, ...], name: str
) -> None:
    assert rows[0].first == (0,)
    for before, after in zip(rows, rows[1:]):
        assert before.end == after.first
    assert all(row.package == name and row.evidence for row in rows)


@pytest.mark.parametrize(
    ("version", "affected"),
    [("4.53.3", False), ("4.54.0", True), ("4.54.1", True), ("4.55.0rc1", True), ("4.55.2", True),
     ("4.55.3", False), ("4.57.6", False), ("5.24.0", False)],
)
def test_transformers_rows(version: str, affected: bool) -> None:
    row = _matrix.row_for(_matrix.TRANSFORMERS_ROWS, version)
    assert row is not None and row.affected is affected


@pytest.mark.parametrize(
    ("version", "affected"),
    [("2.3.1", False), ("2.4.1", True), ("2.5.1", True), ("2.8.0+cu128", True), ("2.9.0.dev20250801", True),
     ("2.13.0+cpu", True), ("2.15.0", True), ("2.16.0", None), ("3.0.0", None)],
)
def test_torch_rows(version: str, affected: bool | None) -> None:
    """torch 2.9+ is in the rows: the upstream fix promised for it never shipped."""
    row = _matrix.row_for(_matrix.TORCH_ROWS, version)
    assert (row.affected if row else None) is affected


def decide(mode: str = _config.AUTO, torch: str | None = "2.13.0", transformers: str | None = "4.55.2",
           probe: bool | None = None) -> _matrix.Decision:
    return _matrix.decide(mode, torch, transformers, lambda: probe)


def test_affected_pair_is_patched() -> None:
    decision = decide()
    assert decision.apply and decision.in_matrix is True
    assert "torch 2.13.0 with transformers 4.55.2" in decision.reason


def test_design_card_cell_is_patched() -> None:
    assert decide(torch="2.8.0+cu128", transformers="4.55.2").apply


@pytest.mark.parametrize("transformers", ["4.53.3", "4.55.3", "4.57.6", "5.24.0"])
def test_unaffected_transformers_is_left_alone_unless_forced(transformers: str) -> None:
    assert not decide(transformers=transformers).apply
    assert decide(transformers=transformers).in_matrix is False
    assert decide(_config.FORCE, transformers=transformers).apply


def test_force_needs_no_transformers_but_an_fsdp2_torch() -> None:
    assert decide(_config.FORCE, transformers=None).apply
    assert not decide(_config.FORCE, torch="2.3.1").apply
    assert not decide(transformers=None).apply


def test_off_wins() -> None:
    assert not decide(_config.OFF).apply
    assert "disabled" in decide(_config.OFF).reason


def test_no_torch() -> None:
    assert not decide(torch=None).apply


@pytest.mark.parametrize(("probe", "apply"), [(True, True), (False, False), (None, False)])
def test_torch_newer_than_the_rows_is_judged_by_the_probe(probe: bool | None, apply: bool) -> None:
    decision = decide(torch="2.16.0", probe=probe)
    assert decision.apply is apply
    assert decision.in_matrix is (False if probe is False else None)
    expected = {True: "still builds", False: "fixed upstream", None: "FSDP_AUTOPATCH=force"}[probe]
    assert expected in decision.reason


def test_probe_is_not_run_inside_the_rows() -> None:
    def probe() -> bool:
        raise AssertionError("the rows answer for torch 2.13")

    assert _matrix.decide(_config.AUTO, "2.13.0", "4.55.2", probe).apply
