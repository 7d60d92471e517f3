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
import time
from typing import Any, Callable, Optional

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
    # The original classes that went through a patched site (the first _patch.CLASS_RECORD_LIMIT),
    # and how many did in all.
    classes: tuple[_patch.ClassRecord, ...] = ()
    classes_seen: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The status as plain JSON types."""
        data = dataclasses.asdict(self)
        data["sites"] = list(self.sites)
        data["classes"] = [dataclasses.asdict(record) for record in self.classes]
        return data


_lock = threading.RLock()
_status: Optional[Status] = None  # None until watch() runs
_decided = False  # the matrix has answered for the versions loaded; only force reopens it
_replicate_reported = False  # replicate()'s failure has been said, once
# Set while watch() registers the hooks, which wrapt calls at once for a module already in
# sys.modules: possibly half-run, by an import that started before the hooks existed.
_registering = threading.local()
# How long a hook waits for such an import to finish before it gives up on that module.
IMPORT_WAIT_SECONDS = 600.0


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
        _status = Status(False, _waiting_reason(mode.name), mode.name)
        _decided = False
    try:
        import wrapt
    except Exception as error:
        _give_up(f"wrapt could not be imported ({type(error).__name__}: {error}); "
                 "reinstall it with: pip install wrapt")
        return
    names = FSDP_MODULES if mode.name == _config.FORCE else (*FSDP_MODULES, TRANSFORMERS)
    # Registered now, whatever is imported yet, so that wrapt sees every later import of them (in
    # any thread, in any order) and calls the hook once the module's body has run.
    hooks: list[tuple[str, Callable[[Any], None]]] = [(name, on_import) for name in names]
    hooks.append((_patch.REPLICATE_MODULE, _on_replicate_import))
    _registering.active = True
    try:
        for name, hook in hooks:
            try:
                wrapt.register_post_import_hook(hook, name)
            except Exception as error:
                if hook is _on_replicate_import:
                    _replicate_failed(f"could not register an import hook for {name}: {error}")
                else:
                    _give_up(f"could not register an import hook for {name}: {error}")
                    return
    finally:
        _registering.active = False


def _deferred(module: Any, hook: Callable[[Any], None]) -> bool:
    """Run ``hook`` later if wrapt called it, while the hooks were being registered, for a module
    whose import is still under way (in another thread, or further up this one): wrapt will not
    call it again, so it runs once that import has finished, from a thread that waits for it."""
    if not (getattr(_registering, "active", False) and _patch.initializing(module)):
        return False
    name = getattr(module, "__name__", "?")

    def wait_then_hook() -> None:
        deadline = time.monotonic() + IMPORT_WAIT_SECONDS
        while (_patch.initializing(module) and sys.modules.get(name) is module
               and time.monotonic() < deadline):
            time.sleep(0.005)
        if sys.modules.get(name) is module and not _patch.initializing(module):
            hook(module)  # an import that failed left nothing to patch

    with _lock:
        if _status is not None and not _status.applied and not _decided:
            _status.reason = f"waiting for the import of {name} under way to finish"
    threading.Thread(target=wait_then_hook, name=f"fsdp-autopatch: waiting for {name}",
                     daemon=True).start()
    return True


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
        if not _deferred(module, on_import):
            try_install(module)
    except Exception as error:
        _give_up(f"the patch failed ({type(error).__name__}: {error}); running unpatched")


def notify_loaded(module: object) -> None:
    """Run post-import hooks for a module wrapt's finder did not see being imported."""
    wrapt = sys.modules.get("wrapt")
    if wrapt is not None:
        wrapt.notify_module_loaded(module)


def try_install(just_ran: Optional[object] = None) -> None:
    """Decide and install, once everything needed is imported. ``just_ran``: the module whose
    post-import hook this is (its body has run, though the import system still marks it)."""
    global _decided
    with _lock:
        if _status is None or _status.applied or _decided:
            return
        mode = _status.mode
        presence = _patch.fsdp2_presence(just_ran)
        if presence == _patch.FSDP2_ABSENT:
            _status.reason = _waiting_reason(mode)
            return
        torch_version, torch_note = _version_of("torch")
        transformers_version, transformers_note = (
            _version_of(TRANSFORMERS) if TRANSFORMERS in sys.modules else (None, ""))
        _status.torch, _status.transformers = torch_version, transformers_version
        site = _patch.fully_shard_site() if presence == _patch.FSDP2_LOADED else None
        if site is None:
            # Nothing could be patched on this torch, whatever transformers is; waiting for it
            # would leave the status saying "waiting" for good.
            elsewhere = _fsdp2_elsewhere(torch_version)
            if elsewhere is None:
                _status.reason = _waiting_reason(mode)
                return
            _status.reason, warn = torch_note + elsewhere[0], elsewhere[1]
            _decided = True
            (logger.warning if warn else logger.info)("%s", _status.reason)
            return
        if mode != _config.FORCE and TRANSFORMERS not in sys.modules:
            # Only its version is needed, and that is set first thing in its __init__.
            _status.reason = _waiting_reason(mode)
            return
        decision = _matrix.decide(mode, torch_version, transformers_version, _patch.probe_layout_bug)
        _status.in_matrix, _status.decided_by = decision.in_matrix, decision.decided_by
        _status.reason = "".join((torch_note, transformers_note, decision.reason))
        _decided = True
        if not decision.apply:
            log = logger.warning if decision.cannot_tell else logger.info
            log("not patching%s: %s", _decided_by(decision), _status.reason)
            return
        site = _patch.install_fully_shard()
        problem = _patch.keep_if_working(site, sys.modules[site.module])
        if problem is not None:
            _status.reason += (f"; but the fix failed its self-check, so fully_shard runs unpatched: "
                               f"{problem}; upgrade fsdp-autopatch, or report it")
            logger.warning("%s", _status.reason)
            return
        _status.applied, _status.sites = True, (site.name,)
        logger.info("patched fully_shard for ABC-based modules%s: %s", _decided_by(decision),
                    _status.reason)
        # Not yet imported, or still being imported: its own hook patches it.
        _patch_replicate(_patch.loaded(_patch.REPLICATE_MODULE))


def _fsdp2_elsewhere(torch_version: Optional[str]) -> Optional[tuple[str, bool]]:
    """What to say when FSDP2 is imported but not where this package looks: None to wait for
    torch 2.4/2.5's FSDP2 package; else the reason and whether it is worth a warning."""
    try:
        row = _matrix.row_for(_matrix.TORCH_ROWS, torch_version) if torch_version else None
        older = torch_version is not None and _matrix.release(torch_version) < _matrix.FSDP2_IN_FSDP_PACKAGE
    except ValueError:
        row, older = None, False
    if row is not None and not row.affected:
        return f"torch {torch_version} has no FSDP2 ({row.evidence}): nothing to patch", False
    if older and _patch.loaded(_matrix.COMPOSABLE_FSDP) is None:
        return None  # FSDP1 so far: this torch's FSDP2 is imported from the composable package
    return _patch.unknown_layout_reason(torch_version), True


def _on_replicate_import(module: Any) -> None:
    """replicate_with_fsdp's post-import hook: it runs once its body has run, or at once when
    the hook is registered after it was imported."""
    try:
        if not _deferred(module, _on_replicate_import):
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
            problem = _patch.keep_if_working(site, module)
            if problem is None:
                _status.sites += (site.name,)
                return
        elif _replicate_predates_its_site(_status.torch):
            logger.debug("%s has no class cache of its own on torch %s: nothing to patch there",
                         site.module, _status.torch)
            return
        else:
            names = "/".join(site.wrappers) + f", {site.deepcopy}, {site.cache}"
            problem = (f"{site.module} has none of the names this version of fsdp-autopatch patches "
                       f"({names}); upgrade fsdp-autopatch")
    _replicate_failed(problem)


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


def _waiting_reason(mode: str) -> str:
    """What the patch still waits for, naming only what is not imported yet."""
    missing = []
    if _patch.fsdp2_presence() == _patch.FSDP2_ABSENT:
        missing.append("FSDP2 (torch.distributed.fsdp)")
    elif _patch.fully_shard_site() is None:  # torch 2.4/2.5 with FSDP1 imported
        missing.append(f"FSDP2 ({_matrix.COMPOSABLE_FSDP})")
    if mode != _config.FORCE and TRANSFORMERS not in sys.modules:
        missing.append(TRANSFORMERS)
    if not missing:  # all there: the hooks are about to decide
        return "waiting for the post-import hooks to run"
    return f"waiting for {' and '.join(missing)} to be imported"


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
    """A copy of the status, with the classes seen so far, or None when ``watch`` never ran."""
    with _lock:
        if _status is None:
            return None
        classes, seen = _patch.classes.snapshot()
        current = dataclasses.replace(_status, classes=classes, classes_seen=seen)
    if current.transformers is None and TRANSFORMERS in sys.modules:
        # Imported after the decision, which did not need it (force mode, an unknown layout).
        try:
            current.transformers = _version_of(TRANSFORMERS)[0]
        except Exception:  # a lazy module's __getattr__ may raise; the decision already said so
            pass
    return current
