"""Hooks: wait for FSDP2 and transformers, decide once, install once, never break an import.

wrapt post-import hooks fire in either import order, for modules imported before they were
registered, and from any thread. Each hook calls ``try_install``, which under one lock checks
whether everything needed is now loaded, asks the version matrix, and installs the patch.
Nothing here lets an exception reach the user's ``import``: a failure is logged once, recorded
in ``status().reason``, and the program goes on unpatched.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from typing import Any, Optional

from fsdp_autopatch import _config, _matrix, _patch

logger = logging.getLogger("fsdp_autopatch")
# Silent unless FSDP_AUTOPATCH_LOG asks or the application configures logging itself: without a
# handler of our own, logging's last-resort handler would print warnings to stderr.
logger.addHandler(logging.NullHandler())

FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
TRANSFORMERS = "transformers"


@dataclasses.dataclass
class Status:
    """What the patch did in this process, and why."""

    applied: bool
    reason: str
    mode: str
    torch: Optional[str] = None
    transformers: Optional[str] = None
    sites: tuple[str, ...] = ()
    in_matrix: Optional[bool] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_lock = threading.RLock()
_status: Optional[Status] = None  # None until watch() runs
_decided = False  # the matrix has answered for the versions loaded; only force reopens it


def watch(mode: _config.Mode) -> None:
    """Register the post-import hooks for ``mode``; later calls only ever raise the mode to force."""
    global _status, _decided
    with _lock:
        first = _status is None
        if not first and (mode.name != _config.FORCE or _status.mode == _config.FORCE):  # type: ignore[union-attr]
            return
        if first:
            _configure_logging()
            if mode.problem:
                sys.stderr.write(mode.problem + "\n")
        if mode.name == _config.OFF:
            _status = Status(False, f"disabled by {_config.MODE_VARIABLE}={mode.raw}", mode.name)
            return
        _status = Status(False, f"waiting for {_waiting_for(mode.name)} to be imported", mode.name)
        _decided = False
    try:
        import wrapt
    except Exception as error:
        _give_up(f"wrapt could not be imported ({type(error).__name__}: {error}); "
                 "reinstall it with: pip install wrapt")
        return
    names = FSDP_MODULES if mode.name == _config.FORCE else (*FSDP_MODULES, TRANSFORMERS)
    for name in names:
        try:
            wrapt.register_post_import_hook(on_import, name)
        except Exception as error:
            _give_up(f"could not register an import hook for {name}: {error}")
            return


def on_import(module: object) -> None:
    """The post-import hook: must not raise into the import that triggered it."""
    try:
        try_install()
    except Exception as error:
        _give_up(f"the patch failed ({type(error).__name__}: {error}); running unpatched")


def notify_loaded(module: object) -> None:
    """Run post-import hooks for a module wrapt's finder did not see being imported."""
    wrapt = sys.modules.get("wrapt")
    if wrapt is not None:
        wrapt.notify_module_loaded(module)


def try_install() -> None:
    global _decided
    with _lock:
        if _status is None or _status.applied or _decided:
            return
        mode = _status.mode
        if not _patch.fsdp2_loaded():
            return
        torch_version, torch_note = _version_of("torch")
        transformers_version, transformers_note = None, ""
        if mode != _config.FORCE:
            # Only its version is needed, and that is set first thing in its __init__.
            if TRANSFORMERS not in sys.modules:
                _status.reason = f"waiting for {TRANSFORMERS} to be imported"
                return
            transformers_version, transformers_note = _version_of(TRANSFORMERS)
        decision = _matrix.decide(mode, torch_version, transformers_version, _patch.probe_still_broken)
        _status.torch, _status.transformers = torch_version, transformers_version
        _status.in_matrix = decision.in_matrix
        _status.reason = "".join((torch_note, transformers_note, decision.reason))
        _decided = True
        if not decision.apply:
            logger.info("not patching: %s", _status.reason)
            return
        _status.applied, _status.sites = True, (_patch.install_fully_shard(),)
        try:
            if _patch.patch_site(_patch.REPLICATE_SITE):
                _status.sites += (_patch.REPLICATE_SITE.name,)
            else:
                _register(_patch.REPLICATE_MODULE, _on_replicate_import)
        except Exception as error:  # fully_shard stays patched; only replicate() goes without
            _replicate_failed(error)
        logger.info("patched fully_shard for ABC-based modules: %s", _status.reason)


def _on_replicate_import(module: object) -> None:
    try:
        with _lock:
            if _status is not None and _patch.patch_site(_patch.REPLICATE_SITE):
                _status.sites += (_patch.REPLICATE_SITE.name,)
    except Exception as error:  # fully_shard stays patched; only replicate() goes without
        _replicate_failed(error)


def _replicate_failed(error: Exception) -> None:
    message = f"replicate() runs unpatched ({type(error).__name__}: {error})"
    with _lock:
        if _status is not None:
            _status.reason += f"; {message}"
    logger.warning("%s", message)


def _register(name: str, hook: Any) -> None:
    wrapt = sys.modules.get("wrapt")
    if wrapt is not None:
        wrapt.register_post_import_hook(hook, name)


def _version_of(package: str) -> tuple[Optional[str], str]:
    """``package.__version__``, else its installed metadata, with a note when it had to fall back.

    The version is None when neither is usable.
    """
    version = getattr(sys.modules.get(package), "__version__", None)
    if isinstance(version, str):
        try:
            _matrix.release(version)
            return str(version), ""
        except ValueError:
            pass
    note = f"{package}.__version__ is unusable ({version!r}); "
    try:
        from importlib import metadata

        installed = metadata.version(package)
        _matrix.release(installed)
    except Exception:
        return None, note + "no installed version found either; "
    return installed, note + f"read {installed} from its installed metadata; "


def _waiting_for(mode: str) -> str:
    fsdp2 = "FSDP2 (torch.distributed.fsdp)"
    return fsdp2 if mode == _config.FORCE else f"{fsdp2} and {TRANSFORMERS}"


def _give_up(reason: str) -> None:
    global _status, _decided
    with _lock:
        if _status is None:
            _status = Status(False, reason, _config.mode_from_environment().name)
        _status.applied = False
        _status.reason = reason
        _decided = True
    logger.warning("%s", reason)


def _configure_logging() -> None:
    level = _config.log_level_from_environment()
    if level is None:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fsdp-autopatch %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def current_status() -> Optional[Status]:
    """A copy of the status, or None when ``watch`` never ran in this process."""
    with _lock:
        return None if _status is None else dataclasses.replace(_status)
