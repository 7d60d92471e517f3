"""Configuration: the ``FSDP_AUTOPATCH`` and ``FSDP_AUTOPATCH_LOG`` switches.

Loaded with the hooks, never at start-up: the start-up module tells the off and force values
apart itself, and they are defined there. Standard library only; nothing here raises or prints.
"""

import os

from fsdp_autopatch import FORCE_VALUES, MODE_VARIABLE, OFF_VALUES

LOG_VARIABLE = "FSDP_AUTOPATCH_LOG"

AUTO = "auto"
OFF = "off"
FORCE = "force"

AUTO_VALUES = ("", "auto", "1", "on", "true")
LOG_LEVELS = ("debug", "info", "warning")

_SHOWN_VALUE_LIMIT = 40


class Mode:
    """The parsed ``FSDP_AUTOPATCH`` value; ``problem`` is a one-line complaint or ``""``."""

    __slots__ = ("name", "problem", "raw")

    def __init__(self, name: str, raw: "str | None", problem: str = "") -> None:
        self.name = name
        self.raw = raw
        self.problem = problem

    def __repr__(self) -> str:
        return f"Mode({self.name!r}, raw={self.raw!r})"


def parse_mode(raw: "str | None") -> Mode:
    """Map a raw ``FSDP_AUTOPATCH`` value to auto, off or force; anything else is auto."""
    text = raw or ""
    value = text.strip().lower()
    if value in AUTO_VALUES:
        return Mode(AUTO, raw)
    if value in OFF_VALUES:
        return Mode(OFF, raw)
    if value in FORCE_VALUES:
        return Mode(FORCE, raw)
    shown = text if len(text) <= _SHOWN_VALUE_LIMIT else text[:_SHOWN_VALUE_LIMIT] + "..."
    # ascii(): stderr may not be able to encode what the user typed.
    problem = (
        f"fsdp-autopatch: ignoring {MODE_VARIABLE}={shown!a}; use one of "
        f"auto|1|on|true, 0|off|false|no|disable, force (running in auto mode)"
    )
    return Mode(AUTO, raw, problem)


def mode_from_environment() -> Mode:
    return parse_mode(os.environ.get(MODE_VARIABLE))


def log_level_from_environment() -> "str | None":
    """The requested log level name, or None for silence (unset or unrecognised)."""
    value = os.environ.get(LOG_VARIABLE, "").strip().lower()
    return value if value in LOG_LEVELS else None
