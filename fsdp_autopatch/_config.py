"""Configuration: the ``FSDP_AUTOPATCH`` and ``FSDP_AUTOPATCH_LOG`` switches (and torch's plugin
switch), and how a remedy names this interpreter's pip.

Loaded with the hooks, never at start-up: the start-up module tells the off and force values
apart itself, and they are defined there. Standard library only; nothing here raises or prints.
"""

import os
import sys

from fsdp_autopatch import FORCE_VALUES, MODE_VARIABLE, OFF_VALUES

LOG_VARIABLE = "FSDP_AUTOPATCH_LOG"
# torch's own switch for every plugin entry point, the package's among them: "1", its default,
# loads them at the end of import torch (torch/__init__.py, _import_device_backends).
PLUGIN_SWITCH = "TORCH_DEVICE_BACKEND_AUTOLOAD"

AUTO = "auto"
OFF = "off"
FORCE = "force"

# Each off value has its opposite here (fsdp_autopatch.OFF_VALUES), so that no word of a pair
# is refused while the other is taken: "yes" as "no", "enable" as "disable".
AUTO_VALUES = ("", "auto", "1", "on", "true", "yes", "enable")
# The values, as the one line on a mistyped switch and doctor name them.
MODE_VALUES_TEXT = ", ".join("|".join(filter(None, values))
                             for values in (AUTO_VALUES, OFF_VALUES, FORCE_VALUES))
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
    problem = ignoring(MODE_VARIABLE, text, f"{MODE_VALUES_TEXT} (running in auto mode)")
    return Mode(AUTO, raw, problem)


def ignoring(variable: str, text: str, accepted: str) -> str:
    """The one line that says a switch's value is not one it knows, and which values are."""
    shown = text if len(text) <= _SHOWN_VALUE_LIMIT else text[:_SHOWN_VALUE_LIMIT] + "..."
    # ascii(): stderr may not be able to encode what the user typed.
    return f"fsdp-autopatch: ignoring {variable}={shown!a}; use one of {accepted}"


def mode_from_environment() -> Mode:
    return parse_mode(os.environ.get(MODE_VARIABLE))


def log_level_from_environment() -> "tuple[str | None, str]":
    """The requested log level name (None: silence), and a one-line complaint about a value it
    does not know (``""`` when unset or known)."""
    text = os.environ.get(LOG_VARIABLE, "")
    value = text.strip().lower()
    if value in LOG_LEVELS:
        return value, ""
    return None, ignoring(LOG_VARIABLE, text, ", ".join(LOG_LEVELS)) if value else ""


def pip_command(arguments: str) -> str:
    """``<this interpreter> -m pip <arguments>``, for a remedy: a bare ``pip`` on ``PATH`` may
    belong to another Python than the one the user ran."""
    return f"{quoted_for_paste(sys.executable) if sys.executable else 'python3'} -m pip {arguments}"


def quoted_for_paste(text: str) -> str:
    """``text`` as one word of a shell command, for a remedy the user pastes (paths with spaces)."""
    import shlex

    return shlex.quote(text)
