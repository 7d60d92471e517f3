"""The FSDP_AUTOPATCH and FSDP_AUTOPATCH_LOG switches."""

from __future__ import annotations

import sys

import pytest

from fsdp_autopatch import _config

AUTO_SPELLINGS = [None, "", "auto", "1", "on", "true", "yes", "enable", " AUTO ", "True", "\tOn\n", "YES"]


@pytest.mark.parametrize("raw", AUTO_SPELLINGS)
def test_auto_values(raw: str | None) -> None:
    mode = _config.parse_mode(raw)
    assert (mode.name, mode.problem) == (_config.AUTO, "")


@pytest.mark.parametrize("raw", ["0", "off", "false", "no", "disable", " OFF ", "No", "DISABLE\n"])
def test_off_values(raw: str) -> None:
    mode = _config.parse_mode(raw)
    assert (mode.name, mode.problem) == (_config.OFF, "")


@pytest.mark.parametrize("raw", ["force", " FORCE", "Force\n"])
def test_force(raw: str) -> None:
    assert _config.parse_mode(raw).name == _config.FORCE


@pytest.mark.parametrize("raw", ["2", "yes please", "ünïcødé", "$(rm -rf /); `x` | & ;", "x" * 10_000, "-1"])
def test_other_values_fall_back_to_auto_with_one_ascii_line(raw: str) -> None:
    mode = _config.parse_mode(raw)
    assert mode.name == _config.AUTO
    assert "\n" not in mode.problem and mode.problem.isascii()
    assert "auto" in mode.problem and "force" in mode.problem and "0|off" in mode.problem
    assert len(mode.problem) < 300


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_config.MODE_VARIABLE, "off")
    assert _config.mode_from_environment().name == _config.OFF
    monkeypatch.delenv(_config.MODE_VARIABLE)
    assert _config.mode_from_environment().name == _config.AUTO


@pytest.mark.parametrize(("raw", "level"), [("debug", "debug"), (" INFO ", "info"), ("warning", "warning"),
                                            ("", None), ("loud", None), ("error", None)])
def test_log_level(monkeypatch: pytest.MonkeyPatch, raw: str, level: str | None) -> None:
    monkeypatch.setenv(_config.LOG_VARIABLE, raw)
    found, problem = _config.log_level_from_environment()
    assert found == level
    # A value it does not know gets one line naming the ones it does, as FSDP_AUTOPATCH's does.
    if level is None and raw:
        assert problem == (f"fsdp-autopatch: ignoring FSDP_AUTOPATCH_LOG={raw!r}; use one of debug, info, "
                           "warning")
    else:
        assert problem == ""


# Each off value and its opposite, which turns the patch back on: neither word of a pair is refused.
OPPOSITES = {"0": "1", "off": "on", "false": "true", "no": "yes", "disable": "enable"}


def test_every_off_value_has_its_opposite_among_the_auto_values() -> None:
    assert tuple(OPPOSITES) == _config.OFF_VALUES
    for off, on in OPPOSITES.items():
        assert _config.parse_mode(off).name == _config.OFF
        assert (_config.parse_mode(on).name, _config.parse_mode(on).problem) == (_config.AUTO, "")


@pytest.mark.parametrize("executable", ["/usr/bin/python3", "/tmp/déjà vu/.venv/bin/python", ""])
def test_a_remedy_names_the_interpreter_that_runs(monkeypatch: pytest.MonkeyPatch, executable: str) -> None:
    """A bare ``pip`` on PATH may belong to another Python; a path with a space is quoted, and an
    interpreter that does not know its own path (embedded) is named as ``python3``."""
    monkeypatch.setattr(sys, "executable", executable)
    expected = {"/usr/bin/python3": "/usr/bin/python3", "": "python3",
                "/tmp/déjà vu/.venv/bin/python": "'/tmp/déjà vu/.venv/bin/python'"}[executable]
    assert _config.pip_command("install wrapt") == f"{expected} -m pip install wrapt"
