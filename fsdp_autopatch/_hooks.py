"""Hooks: wait for FSDP2 and transformers, decide once, install once, never break an import.

wrapt post-import hooks fire in either import order, for modules imported before they were
registered, and from any thread. Each hook calls ``try_install``, which under one lock checks
whether everything needed is now loaded, asks torch and CPython whether the bug is here (the
version matrix answers where they cannot be asked), and installs the patch.
Nothing here lets an exception reach the user's ``import``: a failure is logged once, recorded
in ``status().reason``, and the program goes on unpatched.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from typing import Any, Optional

from fsdp_autopatch import _config, _matrix, _patch

logger = logging.getLogger("fsdp_autopatch")
# Silent unless FSDP_AUTOPATCH_LOG asks or the application configures logging itself: without a
# handler of our own, logging's last-resort handler would print warnings to stderr.
logger.addHandler(logging.NullHandler())

FSDP_MODULES = _patch.FSDP2_PACKAGES
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
    # Who answered whether the bug is here: "probe" (torch and CPython were asked) or "matrix"
    # (the version rows, where no probe could run); None until then, and in off and force modes.
    decided_by: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_lock = threading.RLock()
_status: Optional[Status] = None  # None until watch() runs
_decided = False  # the matrix has answered for the versions loaded; only force reopens it
_replicate_reported = False  # replicate()'s failure has been said, once
# Set while watch() registers replicate()'s hook, which wrapt then calls at once if the module is
# already in sys.modules: possibly half-run, by an import that started before the hooks existed.
_registering = threading.local()


def _reset_lock_after_fork() -> None:
    # A thread that held the lock at fork() does not exist in the child: nothing would release it.
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


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
                _write_stderr(mode.problem)
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
    # Registered now, whatever is imported yet, so that wrapt sees every later import of it (in
    # any thread, before or after FSDP2) and calls the hook once its body has run.
    _registering.active = True
    try:
        wrapt.register_post_import_hook(_on_replicate_import, _patch.REPLICATE_MODULE)
    except Exception as error:
        _replicate_failed(f"could not register an import hook for {_patch.REPLICATE_MODULE}: {error}")
    finally:
        _registering.active = False


def _write_stderr(line: str) -> None:
    """One line on stderr, if there is one (pythonw and some services have ``sys.stderr = None``)."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(line + "\n")
    except Exception:  # a closed or unencodable stream must not keep the hooks from registering
        pass


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
        if _patch.fully_shard_site() is None:
            # Nothing could be patched on this torch, whatever transformers is; waiting for it
            # would leave the status saying "waiting" for good.
            _status.torch = torch_version
            _status.reason = torch_note + _patch.unknown_layout_reason(torch_version)
            _decided = True
            logger.warning("%s", _status.reason)
            return
        transformers_version, transformers_note = None, ""
        if mode != _config.FORCE:
            # Only its version is needed, and that is set first thing in its __init__.
            if TRANSFORMERS not in sys.modules:
                _status.reason = f"waiting for {TRANSFORMERS} to be imported"
                return
            transformers_version, transformers_note = _version_of(TRANSFORMERS)
        decision = _matrix.decide(mode, torch_version, transformers_version, _patch.probe_layout_bug)
        _status.torch, _status.transformers = torch_version, transformers_version
        _status.in_matrix, _status.decided_by = decision.in_matrix, decision.decided_by
        _status.reason = "".join((torch_note, transformers_note, decision.reason))
        _decided = True
        if not decision.apply:
            logger.info("not patching%s: %s", _decided_by(decision), _status.reason)
            return
        _status.applied, _status.sites = True, (_patch.install_fully_shard(),)
        logger.info("patched fully_shard for ABC-based modules%s: %s", _decided_by(decision),
                    _status.reason)
        # Not yet imported, or still being imported: its own hook patches it.
        _patch_replicate(_patch.loaded(_patch.REPLICATE_MODULE))


def _on_replicate_import(module: Any) -> None:
    """replicate_with_fsdp's post-import hook: it runs once its body has run, or at once when
    the hook is registered after it was imported."""
    try:
        if getattr(_registering, "active", False) and _patch.initializing(module):
            # Its import began before the hooks existed and is still running (in another
            # thread, or further up this one): nothing will call this hook again.
            _replicate_failed(f"{_patch.REPLICATE_MODULE} was being imported while the patch was "
                              "being armed; import it after fsdp_autopatch.apply()")
            return
        _patch_replicate(module)
    except Exception as error:  # fully_shard stays patched; only replicate() goes without
        _replicate_failed(f"{type(error).__name__}: {error}")


def _patch_replicate(module: Any) -> None:
    """Patch replicate()'s site in ``module`` (a module whose body has run, or None: not loaded),
    once fully_shard is patched; the failure is said once."""
    site = _patch.REPLICATE_SITE
    with _lock:
        if (module is None or _status is None or not _status.applied or site.name in _status.sites
                or _replicate_reported):
            return
        if _patch.patch_site(site, module):
            _status.sites += (site.name,)
            return
        if _replicate_predates_its_site(_status.torch):
            logger.debug("%s has no class cache of its own on torch %s: nothing to patch there",
                         site.module, _status.torch)
            return
    names = "/".join(site.wrappers) + f", {site.deepcopy}, {site.cache}"
    _replicate_failed(f"{site.module} has none of the names this version of fsdp-autopatch patches "
                      f"({names}); upgrade fsdp-autopatch")


def _replicate_predates_its_site(torch_version: Optional[str]) -> bool:
    """Is this torch older than the releases whose replicate() builds classes at its own site?"""
    try:
        return torch_version is not None and _matrix.release(torch_version) < _matrix.REPLICATE_ROW.first
    except ValueError:
        return False


def _replicate_failed(problem: str) -> None:
    """Say once, in the status and the log, that replicate() is not patched and why."""
    global _replicate_reported
    message = f"replicate() runs unpatched: {problem}"
    with _lock:
        if _replicate_reported:
            return
        _replicate_reported = True
        if _status is not None:
            _status.reason += f"; {message}"
    logger.warning("%s", message)


def _decided_by(decision: _matrix.Decision) -> str:
    names = {_matrix.PROBE: "the probe", _matrix.MATRIX: "the version matrix"}
    who = names.get(decision.decided_by or "")
    return f" (decided by {who})" if who else ""


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
