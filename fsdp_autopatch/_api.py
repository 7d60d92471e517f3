"""The public API: ``apply()`` and ``status()``, for interpreters that do not read ``.pth`` files
(``python -S``, embedded interpreters, ``PYTHONPATH`` or ``pip install --target`` installs)."""

from __future__ import annotations

import fsdp_autopatch
from fsdp_autopatch import _config, _hooks
from fsdp_autopatch._hooks import Status

__all__ = ["Status", "apply", "status"]


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
        _hooks.watch(mode)
    return status()


def status() -> Status:
    """What the patch did in this process: ``applied``, ``reason``, ``mode``, versions,
    ``decided_by`` (``"probe"``: torch and CPython were asked; ``"matrix"``: the version rows
    answered), ``to_dict()``."""
    current = _hooks.current_status()
    if current is not None:
        return current
    mode = _config.mode_from_environment()
    if mode.name == _config.OFF:
        reason = f"disabled by {_config.MODE_VARIABLE}={mode.raw}"
    elif fsdp_autopatch.armed:
        reason = ("armed: waiting for the first import of FSDP2 (torch.distributed.fsdp), composable DDP "
                  f"({fsdp_autopatch.DDP_MODULE}) or transformers")
    else:
        reason = ("not armed: fsdp_autopatch.pth did not run in this interpreter (python -S, "
                  "PYTHONPATH or --target install?), and torch's plugin entry point has not armed it "
                  "(torch not imported yet, torch before 2.5, or TORCH_DEVICE_BACKEND_AUTOLOAD=0); "
                  "call fsdp_autopatch.apply()")
    return Status(False, reason, mode.name)
