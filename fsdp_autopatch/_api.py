"""The public API: ``apply()`` and ``status()``, for interpreters that do not read ``.pth`` files
(``python -S``, embedded interpreters, ``PYTHONPATH`` or ``pip install --target`` installs)."""

from __future__ import annotations

import os
import sys

import fsdp_autopatch
from fsdp_autopatch import _config, _hooks
from fsdp_autopatch._hooks import Status

__all__ = ["Status", "apply", "status"]

# torch's plugin route: the module of its entry point, at the root of site-packages.
PLUGIN_MODULE = "_fsdp_autopatch_plugin"


def apply(force: bool = False) -> Status:
    """Arm the patch in this process, as the ``.pth`` file does, and return ``status()``.

    The patch is installed as soon as torch's FSDP2 and transformers are both imported (now, if
    they already are) and a probe shows that CPython refuses the classes this torch builds for
    ABC modules (the version matrix answers where no probe can run); ``force=True`` patches as
    soon as FSDP2 is imported, whatever the versions, and CPython is still asked per class.
    ``FSDP_AUTOPATCH=0`` still wins: it is the operator's switch.
    """
    mode = _config.mode_from_environment()
    if mode.name != _config.OFF:
        if force:
            mode = _config.Mode(_config.FORCE, mode.raw)
        fsdp_autopatch.disarm()
        if not fsdp_autopatch.armed:
            fsdp_autopatch.armed, fsdp_autopatch.armed_by = True, fsdp_autopatch.APPLY_ROUTE
        _hooks.watch(mode)
    return status()


def status() -> Status:
    """What the patch did in this process: ``applied``, ``reason``, ``mode``, versions,
    ``decided_by`` (``"probe"``: torch and CPython were asked; ``"matrix"``: the version rows
    answered), ``armed_by`` (the route that armed it), ``to_dict()``."""
    current = _hooks.current_status()
    if current is not None:
        return current
    mode = _config.mode_from_environment()
    if mode.name == _config.OFF:
        reason = f"disabled by {_config.MODE_VARIABLE}={mode.raw}"
    elif fsdp_autopatch.armed:
        reason = f"armed: waiting for the first import of {_hooks.waited_for()} or transformers"
    else:
        reason = f"not armed: {not_armed_because()}; call fsdp_autopatch.apply()"
    return Status(False, reason, mode.name, armed_by=fsdp_autopatch.armed_by)


def not_armed_because() -> str:
    """Why neither the start-up file nor torch's plugin entry point armed this interpreter, as
    far as it can tell itself."""
    plugin = sys.modules.get(PLUGIN_MODULE)
    failed = fsdp_autopatch.startup_error or (plugin and getattr(plugin, "error", None))
    if failed:
        return f"arming failed ({failed})"
    start = ("python -S reads no start-up file" if sys.flags.no_site else
             f"{fsdp_autopatch.START_FILE} was not read (it is read only in a site directory)")
    torch = sys.modules.get("torch")
    if torch is None:
        return f"{start}, and torch, whose plugin entry point arms it, is not imported yet"
    switch = _config.PLUGIN_SWITCH
    if os.environ.get(switch, "1") != "1":
        return f"{start}, and {switch}={os.environ[switch]} turns off torch's plugins"
    try:
        from fsdp_autopatch import _matrix

        older = _matrix.release(str(torch.__version__)) < _matrix.PLUGIN_FIRST_TORCH
    except (AttributeError, ValueError):
        older = False
    if older:
        return f"{start}, and torch {torch.__version__} calls no plugin entry points (torch 2.5+ does)"
    return f"{start}, and torch's plugin entry point of fsdp-autopatch did not run (is it installed?)"
