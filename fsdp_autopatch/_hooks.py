"""Hooks: wait for torch's wrappers and transformers, decide once, install per site, never break an import.

wrapt post-import hooks fire in either import order, for modules imported before they were
registered, and from any thread. Each hook calls ``try_install``, which under one lock checks
whether everything needed is now loaded, asks torch and CPython whether the bug is here (the
version matrix answers where they cannot be asked), and installs the patch at every site of
``_sites`` that the loaded torch (or megatron-fsdp) has, each as soon as its module is imported.
Without wrapt, the start-up module's watcher tells the hooks of each watched import instead, so
that they decide as they would, and say so where the fix cannot run.
Nothing here lets an exception reach the user's ``import``: a failure is recorded in
``status().reason`` and logged, and the program goes on unpatched. Where the bug is here and
the fix cannot run, the user reads one line on stderr (``_say_cannot_fix``); otherwise nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from typing import Any, Optional

from fsdp_autopatch import _classes, _config, _matrix, _patch, _sites, _speaker
from fsdp_autopatch._sites import TRANSFORMERS

logger = logging.getLogger("fsdp_autopatch")
# Silent unless FSDP_AUTOPATCH_LOG asks or the application configures logging itself: without a
# handler of our own, logging's last-resort handler would print warnings to stderr.
logger.addHandler(logging.NullHandler())


@dataclasses.dataclass
class Status:
    """What the patch did in this process, and why."""

    applied: bool
    reason: str
    mode: str
    torch: Optional[str] = None
    transformers: Optional[str] = None
    # The sites patched (and self-checked), named by the function users call.
    sites: tuple[str, ...] = ()
    in_matrix: Optional[bool] = None
    # Who answered whether the bug is here: "probe" (torch and CPython were asked) or "matrix"
    # (the version rows, where no probe could run); None until then, and in off and force modes.
    decided_by: Optional[str] = None
    # The original classes that went through a patched site (the first _classes.CLASS_RECORD_LIMIT),
    # and how many did in all.
    classes: tuple[_classes.ClassRecord, ...] = ()
    classes_seen: int = 0
    # The route that armed this interpreter (fsdp_autopatch.START_FILE_ROUTE, PLUGIN_ROUTE or
    # APPLY_ROUTE), None where nothing did.
    armed_by: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        """The status as plain JSON types."""
        data = dataclasses.asdict(self)
        data["sites"] = list(self.sites)
        data["classes"] = [dataclasses.asdict(record) for record in self.classes]
        return data


_lock = threading.RLock()
_status: Optional[Status] = None  # None until watch() runs
_decision: Optional[_matrix.Decision] = None  # for the versions loaded; only force reopens it
_settled: set[str] = set()  # the APIs whose site was patched, or whose failure was said
# Where wrapt cannot be imported: what keeps the fix from running, and the remedy.
_without_wrapt: Optional[tuple[str, str]] = None
# Set while watch() registers the hooks, which wrapt calls at once for a module already in
# sys.modules: possibly half-run, by an import that started before the hooks existed.
_registering = threading.local()
# How long a hook waits for such an import to finish before it gives up on that module.
IMPORT_WAIT_SECONDS = 600.0


def after_fork_in_child() -> None:
    """Called by the start-up module's one fork handler: a thread that held a lock at fork()
    does not exist in the child, so nothing would release it; a forked rank asks anew whether
    it speaks for its node."""
    global _lock
    _lock = threading.RLock()
    _speaker.after_fork_in_child()
    _patch.after_fork_in_child()


def watch(mode: _config.Mode) -> bool:
    """Register the post-import hooks for ``mode``; later calls only ever raise the mode to force.
    True where wrapt cannot be imported: the start-up module's watcher then tells the hooks of
    each watched import instead (``notify_loaded``), only so that they can tell whether the bug
    is here, and say it (the patch itself is installed by wrapt's hooks alone)."""
    global _status, _decision, _without_wrapt
    import fsdp_autopatch

    fsdp_autopatch.register_fork_handler()
    with _lock:
        first = _status is None
        if not first and (mode.name != _config.FORCE or _status.mode == _config.FORCE):  # type: ignore[union-attr]
            return _without_wrapt is not None
        if first:
            for problem in (mode.problem, _configure_logging()):
                if problem:
                    _speaker.write_line(problem)
        if mode.name == _config.OFF:
            _status = Status(False, f"disabled by {_config.MODE_VARIABLE}={mode.raw}", mode.name)
            return False
        if _status is not None and _status.applied:
            _status.mode = mode.name  # already patched: force changes nothing
            return False
        _status = Status(False, _waiting_reason(mode.name), mode.name)
        _decision = None
    names = _sites.WATCHED_MODULES if mode.name == _config.FORCE else (*_sites.WATCHED_MODULES, TRANSFORMERS)
    try:
        import wrapt
    except Exception as error:
        missing = isinstance(error, ModuleNotFoundError) and error.name == "wrapt"
        with _lock:
            _without_wrapt = ("wrapt is not installed" if missing else
                              f"wrapt cannot be imported ({type(error).__name__}: {error})",
                              _config.pip_command(f"install {'' if missing else '--force-reinstall '}wrapt"))
            _status.reason = _with_problems(_status.reason)
        _log_unfixed("; ".join(_without_wrapt))
        for name in names:  # what was imported before the hooks: told now, as wrapt would
            module = sys.modules.get(name)
            if module is not None:
                on_import(module)
        return True
    # Registered now, whatever is imported yet, so that wrapt sees every later import of them (in
    # any thread, in any order) and calls the hook once the module's body has run.
    _registering.active = True
    try:
        for name in names:
            try:
                wrapt.register_post_import_hook(on_import, name)
            except Exception as error:
                _give_up(f"wrapt could not register an import hook for {name} ({type(error).__name__}: "
                         f"{error})", _config.pip_command("install --force-reinstall wrapt"))
                return False
    finally:
        _registering.active = False
    return False


def on_import(module: object) -> None:
    """The post-import hook: must not raise into the import that triggered it."""
    try:
        if not _deferred(module):
            try_install(module)
    except Exception as error:
        _give_up(f"the patch failed ({type(error).__name__}: {error})",
                 f"set {_config.LOG_VARIABLE}=debug for details, and report it")


def _deferred(module: Any) -> bool:
    """Run the hook later if wrapt called it, while the hooks were being registered, for a module
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
            on_import(module)  # an import that failed left nothing to patch

    with _lock:
        if _status is not None and not _status.applied and _decision is None:
            _status.reason = f"waiting for the import of {name} under way to finish"
    threading.Thread(target=wait_then_hook, name=f"fsdp-autopatch: waiting for {name}",
                     daemon=True).start()
    return True


def notify_loaded(module: object) -> None:
    """Run post-import hooks for a module wrapt's finder did not see being imported (or, without
    wrapt, for every watched import, from the start-up module's loaders)."""
    wrapt = sys.modules.get("wrapt")
    if wrapt is not None:
        wrapt.notify_module_loaded(module)
    elif _without_wrapt is not None:
        on_import(module)


def try_install(just_ran: Optional[object] = None) -> None:
    """Decide once everything needed is imported, then install at every site not yet settled.
    ``just_ran``: the module whose post-import hook this is (its body has run, though the import
    system still marks it)."""
    global _decision
    with _lock:
        if _status is None or _status.mode == _config.OFF or (_decision is not None and not _decision.apply):
            return
        torch_version, torch_note = _version_of("torch") if "torch" in sys.modules else (None, "")
        no_fsdp2 = _torch_without_fsdp2(torch_version, just_ran)
        if _decision is None and no_fsdp2 is not None:  # nothing to patch, now or later
            _decision = _matrix.Decision(False, no_fsdp2, False, _matrix.DECIDED_BY_MATRIX)
            _status.torch, _status.reason = torch_version, no_fsdp2
            _status.in_matrix, _status.decided_by = False, _matrix.DECIDED_BY_MATRIX
            logger.debug("%s", no_fsdp2)
            return
        loaded = {api: _patch.resolve_api(api, just_ran) for api in _sites.APIS if api not in _settled}
        for api, (problem, remedy) in _unknown_layouts(loaded, torch_version, just_ran).items():
            _site_failed(api, problem, remedy)
            del loaded[api]
        if _decision is None:
            _decide(loaded, torch_version, torch_note, just_ran)
        if _decision is not None and _decision.apply:
            _install(loaded)


def _decide(loaded: dict[str, Optional[_patch.Construction]], torch_version: Optional[str], torch_note: str,
            just_ran: Optional[object]) -> None:
    """Decide whether the bug is here, once a site and (in auto mode) transformers are imported:
    torch's own code is asked at every site loaded (the bug is here if any refuses); where no
    site of this torch can be run, the version rows answer. Says the one line where the bug is
    here and a site's fix cannot run. Called under the lock."""
    global _decision
    assert _status is not None
    mode = _status.mode
    first = next((construction for construction in loaded.values() if construction), None)
    ready = mode == _config.FORCE or TRANSFORMERS in sys.modules
    if not ready or (first is None and not _problems):
        # Only transformers' version is needed, and that is set first thing in its __init__.
        _status.torch = _status.torch or torch_version
        if TRANSFORMERS in sys.modules:
            _status.transformers = _version_of(TRANSFORMERS)[0]
        _status.reason = _with_problems(_waiting_reason(mode, just_ran))
        return
    transformers_version, transformers_note = (
        _version_of(TRANSFORMERS) if TRANSFORMERS in sys.modules else (None, ""))
    _status.torch, _status.transformers = torch_version, transformers_version
    answers = [_probed(api, construction) for api, construction in loaded.items() if construction]
    bug = (True if _patch.TORCH_REFUSED in answers
           else None if None in answers or not answers else False)
    _decision = _matrix.decide(mode, torch_version, transformers_version, bug)
    if bug is False and _patch.TORCH_FIXED in answers and not _decision.apply:
        _decision = dataclasses.replace(_decision, reason=(
            f"torch {torch_version} builds wrapper classes {_matrix.interpreter()} accepts for ABC "
            "modules itself (probed at every site): nothing to patch"))
    _status.in_matrix, _status.decided_by = _decision.in_matrix, _decision.decided_by
    _status.reason = _with_problems("".join((torch_note, transformers_note, _decision.reason)))
    # Whether the bug is here changes nothing in a run by itself: DEBUG, unless nobody can tell.
    decided = f"{'' if _decision.apply else 'not '}patching{_decided_by(_decision)}: {_status.reason}"
    if _decision.cannot_tell:
        _log_unfixed(decided)
    else:
        logger.debug("%s", decided)
    if _bug_here() and _problems:
        api, (problem, remedy) = next(iter(_problems.items()))
        _say_cannot_fix(api, problem, remedy)
    elif _decision.cannot_tell:
        _say_cannot_fix(None, _decision.reason)


def _install(loaded: dict[str, Optional[_patch.Construction]]) -> None:
    """Install the fix at every site loaded, the bug being here; where wrapt is missing, say the
    one line instead. Called under the lock."""
    assert _status is not None
    if _without_wrapt is not None:
        # Here the patch would be installed: the bug is here (torch and CPython asked), and
        # what would install it is missing. The one line, where it matters only.
        _settled.update(loaded)
        _say_cannot_fix(None, *_without_wrapt)
        return
    for api, construction in loaded.items():
        if construction is None:
            continue
        _settled.add(api)
        # Nothing of torch's is rewritten where torch needs no fix: where torch builds an
        # accepted class itself, and, unless forced, where CPython accepts torch's own for an
        # ABC module (3.15+). Forced, such a site is patched still: CPython 3.15 refuses
        # Generic[T]-first classes, and each class gets torch's own where CPython accepts it.
        answer = _probed(api, construction)
        forced = _status.mode == _config.FORCE
        if answer == _patch.TORCH_FIXED or (answer == _patch.TORCH_ACCEPTED and not forced):
            logger.debug("left %s to torch: its own construction gives an ABC module a class CPython "
                         "accepts", api)
            continue
        problem = _patch.install_checked(construction)
        if problem is None:
            _status.applied = True
            _status.sites += (construction.site.name,)
            logger.debug("patched %s at %s", api, construction.site.name)
        else:
            _site_failed(api, problem, "upgrade fsdp-autopatch, or report it")


# What keeps each API unpatched (an unknown layout, a failed self-check): the problem and its
# remedy, said once and kept at the end of the status's reason.
_problems: dict[str, tuple[str, str]] = {}
# What torch's own construction at each API's site did with an ABC module (_patch.probe), asked
# once per site.
_answers: dict[str, Optional[str]] = {}


def _probed(api: str, construction: _patch.Construction) -> Optional[str]:
    if api not in _answers:
        _answers[api] = _patch.probe(construction)
    return _answers[api]


def _site_failed(api: str, problem: str, remedy: str) -> None:
    """Record that ``api`` runs unpatched and why; tell the user where the bug is here."""
    _settled.add(api)
    _problems[api] = (problem, remedy)
    if _status is not None:
        _status.reason += f"; {_unpatched(api, problem, remedy)}"
    _log_unfixed(_unpatched(api, problem, remedy))
    if _bug_here():
        _say_cannot_fix(api, problem, remedy)


def _bug_here() -> bool:
    """Has the decision found the bug here (or could it not rule it out)?"""
    return _decision is not None and (_decision.apply or _decision.cannot_tell)


def _unpatched(api: str, problem: str, remedy: str) -> str:
    return f"{api} runs unpatched: {problem}; {remedy}"


def _with_problems(reason: str) -> str:
    """``reason``, after wrapt's problem where it cannot be imported, and with each API's."""
    return "; ".join((*(_without_wrapt or ()), reason,
                      *(_unpatched(api, *problem) for api, problem in _problems.items())))


def _torch_without_fsdp2(torch_version: Optional[str], just_ran: Optional[object]) -> Optional[str]:
    """What to say once an FSDP2 package is imported from a torch the rows show without FSDP2."""
    packages = {site.package for site in _sites.sites_of(_sites.FULLY_SHARD)}
    if all(_patch.loaded(name, just_ran) is None for name in packages):
        return None
    row = _matrix.torch_row_for(torch_version)
    if row is None or row.has_fsdp2:
        return None
    return f"torch {torch_version} has no FSDP2 ({row.evidence}): nothing to patch"


def _unknown_layouts(
    loaded: dict[str, Optional[_patch.Construction]], torch_version: Optional[str], just_ran: Optional[object]
) -> dict[str, tuple[str, str]]:
    """For each API not settled yet (``loaded``: its site, or None) imported without any of the
    sites this package knows for it (torch moved it), why it runs unpatched, and the remedy. An
    API counts as imported once a module of its sites is, or the package users import it from
    in the loaded release (torch 2.4 and 2.5's torch.distributed.fsdp is FSDP1's)."""
    unknown = {}
    for api, construction in loaded.items():
        if construction is not None:
            continue
        distribution = _sites.distribution_of(api)
        sites = _sites.sites_of(api)
        # Another package's version is read from its top-level module, loaded with the site's.
        version = torch_version if distribution == "torch" else _version_of(_sites.top_package(api))[0]
        release = _matrix.release_or_none(version)
        if not any(_patch.loaded(site.module, just_ran) is not None or _patch.loaded(site.package, just_ran)
                   is not None for site in _sites.sites_of(api, release)):
            continue
        bound = next(filter(None, map(_patch.user_binding, sites)), None)
        if bound is not None:
            unknown[api] = (bound, f"remove that binding, or call {distribution}'s own")
        else:
            unknown[api] = (f"{_sites.unknown_layout(api, version)} (none of the class-construction "
                            "sites it patches is there)", "upgrade fsdp-autopatch")
    return unknown


def _decided_by(decision: Optional[_matrix.Decision]) -> str:
    names = {_matrix.DECIDED_BY_PROBE: "the probe", _matrix.DECIDED_BY_MATRIX: "the version matrix"}
    who = names.get((decision and decision.decided_by) or "")
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


def _waiting_reason(mode: str, just_ran: Optional[object] = None) -> str:
    """What the patch still waits for, naming only what is not imported yet (``just_ran``: the
    wrapper's module whose own post-import hook asks, imported though still marked so)."""
    missing = []
    if not _problems and not any(_patch.resolve_api(api, just_ran) for api in _sites.APIS):
        missing.append(waited_for())
    if mode != _config.FORCE and TRANSFORMERS not in sys.modules:
        missing.append(TRANSFORMERS)
    if not missing:  # all there: the hooks are about to decide
        return "waiting for the post-import hooks to run"
    return f"waiting for {' and '.join(missing)} to be imported"


def waited_for() -> str:
    """The wrappers the hooks wait for, as a status names them."""
    return f"{', '.join(_sites.APIS[:-1])} or {_sites.APIS[-1]}"


def _give_up(problem: str, remedy: str) -> None:
    """Nothing will be patched in this process: record why, and tell the user if the bug is here
    (the decision, or the version rows for the versions installed where none was made yet)."""
    global _status, _decision
    reason = f"{problem}; {remedy}"
    with _lock:
        if _status is None:
            _status = Status(False, reason, _config.mode_from_environment().name)
        decided = _decision
        _status.applied = False
        _status.reason = reason
        _decision = _matrix.Decision(False, reason, None)
    _log_unfixed(reason)
    try:
        bug = decided or _matrix.decide(_status.mode, *map(_installed_version, ("torch", TRANSFORMERS)))
    except Exception:  # an unreadable version: nothing to say
        return
    if bug.apply or bug.cannot_tell:
        _say_cannot_fix(None, problem, remedy)


def _installed_version(package: str) -> Optional[str]:
    """The version of ``package``: the imported module's, else its installed metadata's."""
    if package in sys.modules:
        return _version_of(package)[0]
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# Said once per process: the one line on stderr.
_said = False


def _say_cannot_fix(api: Optional[str], problem: str, remedy: str = "") -> None:
    """The one line a user reads when the bug is here and the fix cannot run, once per process
    (under a launcher, once per node)."""
    global _said
    if _said:
        return
    _said = True
    which = f"{api}'s" if api else "the"
    _speaker.write_line(f"fsdp-autopatch: cannot fix {which} layout bug for ABC modules here: {problem}"
                  + (f" ({remedy})" if remedy else ""))


# Whether FSDP_AUTOPATCH_LOG asked for the package's log (its own handler prints it on stderr).
_own_log = False


def _log_unfixed(text: str) -> None:
    """Log that a fix cannot run, or that nobody can tell whether one is needed: INFO where
    ``FSDP_AUTOPATCH_LOG`` asks for the package's log, DEBUG otherwise. The one line on stderr
    says it once per launch; a training script's ``logging.basicConfig(level=logging.INFO)``
    would print an INFO record in every rank."""
    logger.log(logging.INFO if _own_log else logging.DEBUG, "%s", text)


def _configure_logging() -> str:
    """Print the log on stderr at the level ``FSDP_AUTOPATCH_LOG`` asks for; the line that says
    its value is unknown, or ``""``."""
    global _own_log
    level, problem = _config.log_level_from_environment()
    if level is None:
        return problem
    _own_log = True
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fsdp-autopatch %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return ""


def current_status() -> Optional[Status]:
    """A copy of the status, with the classes seen so far, or None when ``watch`` never ran."""
    with _lock:
        if _status is None:
            return None
        classes, seen = _classes.records.snapshot()
        import fsdp_autopatch

        current = dataclasses.replace(_status, classes=classes, classes_seen=seen,
                                      armed_by=fsdp_autopatch.armed_by)
        # "Patched" only while the fix is in place: a reload or a rebinding since may have undone it.
        for construction in list(_patch.installed):
            problem = _patch.undone(construction)
            if problem is not None and construction.site.name in current.sites:
                current.sites = tuple(site for site in current.sites if site != construction.site.name)
                current.reason += (f"; {construction.site.api} is no longer patched: {problem} (the fix "
                                   f"does not follow a reload or a rebinding of torch's modules: "
                                   f"restart the process without it)")
        current.applied = bool(current.sites) and current.applied
    if current.transformers is None and TRANSFORMERS in sys.modules:
        # Imported after the decision, which did not need it (force mode, an unknown layout).
        try:
            current.transformers = _version_of(TRANSFORMERS)[0]
        except Exception:  # a lazy module's __getattr__ may raise; the decision already said so
            pass
    return current
