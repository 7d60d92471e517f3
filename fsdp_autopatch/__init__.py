"""Make FSDP2 and composable DDP work on modules with an empty-``__slots__`` base such as ``abc.ABC``.

Installing the package is enough: ``fsdp_autopatch.pth`` (``fsdp_autopatch.start`` on Python
3.15+) calls ``arm()`` in every interpreter of the environment, and the patch is installed once
torch's FSDP2 (or composable DDP) and an affected transformers are both
imported. ``apply()`` and ``status()`` are
for interpreters that do not read ``.pth`` files.

This module is the start-up path, and it runs in every interpreter, pip and linters included.
So it imports only the standard library, raises nothing, prints nothing, and costs one list
insert. wrapt takes 60-80 ms to import; it, the switch parsing and everything else load only
once FSDP2 or composable DDP (or, in auto mode, transformers) is actually being imported, which
is also when ``FSDP_AUTOPATCH`` is read for good. A process that imports torch and never those
pays nothing more than the insert.

Where no start-up file is read, torch 2.5+ calls ``_fsdp_autopatch_plugin.autoload`` (the
``torch.backends`` entry point) at the end of ``import torch``, which arms the same way.
"""


import _thread
import os
import sys

# Set on this module by torch's plugin route if torch runs it before this code has run (an
# import hook that imports torch first): the end of this module then arms by that route.
arm_when_imported = globals().get("arm_when_imported", False)

MODE_VARIABLE = "FSDP_AUTOPATCH"
# The values start-up must tell apart without importing _config, which takes them from here.
# fsdp_autopatch.pth spells OFF_VALUES out again, so that a disabled interpreter imports nothing of
# ours; tests/test_startup.py keeps the two in step.
OFF_VALUES = ("0", "off", "false", "no", "disable")
FORCE_VALUES = ("force",)

# The torch modules whose import registers the hooks: the packages that export FSDP2's fully_shard, and
# the modules of the sites in _sites (the one table of where torch builds wrapper classes, which
# names them from here), so that start-up imports nothing more of ours. torch alone arms nothing.
FSDP2_PACKAGES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
FULLY_SHARD_MODULES = ("torch.distributed.fsdp._fully_shard._fully_shard",
                       "torch.distributed._composable.fsdp.fully_shard")
REPLICATE_WITH_FSDP_MODULE = "torch.distributed._composable.replicate_with_fsdp"
DDP_MODULE = "torch.distributed._composable.replicate"
TORCH_MODULES = (*FSDP2_PACKAGES, *FULLY_SHARD_MODULES, REPLICATE_WITH_FSDP_MODULE, DDP_MODULE)
# Megatron-FSDP (megatron-fsdp 0.6+) swaps classes the same way in its experimental fully_shard;
# the package re-exports that function under the module's name, so it is reached by this name.
MEGATRON_FSDP_MODULE = "megatron_fsdp.experimental.fully_shard"
# Every module whose first import registers the hooks: torch's, and Megatron-FSDP's.
WATCHED_MODULES = (*TORCH_MODULES, MEGATRON_FSDP_MODULE)
# Only its version decides, in auto mode; its model imports load torch.distributed.fsdp anyway.
TRANSFORMERS = "transformers"

# The routes that arm an interpreter, as status(), doctor and verify name them. Python 3.15+
# (PEP 829) runs the .start file's entry point instead of the .pth import line.
PTH_NAME, START_NAME = "fsdp_autopatch.pth", "fsdp_autopatch.start"
START_FILE = START_NAME if sys.version_info >= (3, 15) else PTH_NAME
START_FILE_ROUTE = f"{START_FILE} at interpreter start"
PLUGIN_ROUTE = "torch's plugin entry point at import torch"
APPLY_ROUTE = "fsdp_autopatch.apply()"

# Set by arm(); read by status() and doctor: which route armed this interpreter, and what
# arming caught where it failed ("<route>: <type>: <message>"; the first failure is kept).
armed = False
armed_by = None
startup_error = None


def keep_error(route: str, error: BaseException) -> None:
    """Keep what a start-up step caught, for status() and doctor: they name it, nothing prints it."""
    global startup_error
    if startup_error is None:
        startup_error = f"{route}: {type(error).__name__}: {error}"


class FirstImportWatcher:
    """A ``sys.meta_path`` finder for the first import of an FSDP2 module or transformers.

    It lends that import a loader that registers the wrapt post-import hooks before the module
    runs, then leaves ``sys.meta_path``. The registering happens in the loader, never here:
    finders run under the interpreter's global import lock, and importing wrapt under it could
    deadlock against a thread that holds one of wrapt's own module locks.
    """

    def __init__(self, names: "tuple[str, ...]") -> None:
        self.names = names
        self._lock = _thread.RLock()
        self._started = False
        self._done = False
        # A watched module came with a loader that could not be lent: the next import whose
        # loader can be lent hands over instead, outside the import lock.
        self._pending = False
        # Threads inside find_spec: a finder that itself asks every finder on sys.meta_path
        # (import tools, test frameworks) calls back here for the same import, endlessly.
        self._finding: set[int] = set()

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        watched = fullname in self.names
        if not watched and not (self._pending and not self._started):
            return None
        thread = _thread.get_ident()
        if thread in self._finding:
            return None  # asked by a finder this very call asked: let it find the spec itself
        self._finding.add(thread)
        try:
            spec = find_spec_after(self, fullname, path, target)
        finally:
            self._finding.discard(thread)
        if spec is None:  # not installed: nothing to arm for, and the import fails as usual
            return None
        if not lend_loader(spec, self) and watched:
            self._pending = True
        return spec

    def hand_over(self) -> None:
        """Register the hooks once, from a lent loader, then leave ``sys.meta_path``, unless the
        hooks have no wrapt: then this watcher stays, and its loaders tell the hooks of each
        watched import (``notify_loaded``), so that they can still tell the bug is here."""
        # Threads importing another watched module at the same moment wait here, in their
        # loaders, until the hooks are in place; they then tell the hooks themselves.
        with self._lock:
            if self._started:
                return
            self._started = True
            self._pending = False
            keep_watching = register_hooks()
            self._done = True
            if not keep_watching:
                remove_watcher(self)

    def after_fork_in_child(self) -> None:
        # The thread that held the lock, or was handing over, does not exist in the child:
        # a new lock, and a hand-over it never finished starts again on the next import.
        self._lock = _thread.RLock()
        self._finding = set()
        if not self._done:
            self._started = False

    def __repr__(self) -> str:
        return f"<fsdp_autopatch watcher for {', '.join(self.names)}>"


def lend_loader(spec: object, watcher: FirstImportWatcher) -> bool:
    """Put a hand-over loader in front of ``spec``'s loader; False if it cannot be done."""
    try:
        loader = getattr(spec, "loader", None)
        modern, legacy = hand_over_loaders()
        if hasattr(loader, "exec_module"):
            spec.loader = modern(loader, watcher, spec)  # type: ignore[attr-defined]
        elif hasattr(loader, "load_module"):
            spec.loader = legacy(loader, watcher, spec)  # type: ignore[attr-defined]
        else:  # a namespace package, or an unusual spec
            return False
        return True
    except Exception:
        return False


_hand_over_loaders: "tuple[type, type] | None" = None


def lent_loader_base() -> type:
    """The base of the hand-over loaders (``hand_over_loaders``): it stands in for a module's own
    loader, and gives the module that loader back."""

    class LentLoader:
        """Stands in for a module's own loader during the one import that hands over."""

        def __init__(self, loader: object, watcher: FirstImportWatcher, spec: object) -> None:
            self.loader = loader
            self.watcher = watcher
            self.spec = spec

        def restore(self, module: object) -> None:
            # The module sees its real loader, as if this one had never been there.
            try:
                if getattr(self.spec, "loader", None) is self:
                    self.spec.loader = self.loader  # type: ignore[attr-defined]
                if getattr(module, "__loader__", None) is self:
                    module.__loader__ = self.loader  # type: ignore[attr-defined]
            except Exception:
                pass

        def __getattr__(self, name: str) -> object:
            if name == "loader":  # not set yet (a copy in the making): no endless lookup
                raise AttributeError(name)
            return getattr(self.loader, name)

        def __reduce_ex__(self, protocol: object) -> object:
            # A spec found while the hand-over is lent (importlib.util.find_spec before the
            # import) pickles and deep-copies with (a copy of) the module's own loader, as
            # without the package.
            import copy

            return copy.copy, (self.loader,)

    return LentLoader


def hand_over_loaders() -> "tuple[type, type]":
    """The two loader classes a watched import is lent, for loaders with and without
    ``exec_module``. They are built on the first watched import, not at start-up: building a class
    costs tens of microseconds, and start-up runs in every interpreter (docs/cost.md). The import
    system calls find_spec under its global lock, so they are built once."""
    global _hand_over_loaders
    if _hand_over_loaders is not None:
        return _hand_over_loaders
    LentLoader = lent_loader_base()

    class HandOverLoader(LentLoader):
        """For a loader with ``exec_module``: hands over in ``create_module``."""

        def create_module(self, spec: object) -> object:
            self.watcher.hand_over()
            create_module = getattr(self.loader, "create_module", None)
            return create_module(spec) if create_module is not None else None

        def exec_module(self, module: object) -> None:
            self.restore(module)
            self.loader.exec_module(module)  # type: ignore[attr-defined]
            # wrapt's finder was not on sys.meta_path when this import was found, so the
            # post-import hooks for this very module are run from here.
            notify_loaded(module)

    class LegacyHandOverLoader(LentLoader):
        """For a loader with only ``load_module`` (no ``exec_module``, so the import system calls
        ``load_module``, under the module's lock but not the global import lock)."""

        def load_module(self, fullname: str) -> object:
            self.watcher.hand_over()
            module = self.loader.load_module(fullname)  # type: ignore[attr-defined]
            self.restore(module)
            notify_loaded(module)
            return module

    _hand_over_loaders = HandOverLoader, LegacyHandOverLoader
    return _hand_over_loaders


def find_spec_after(watcher: object, fullname: str, path: object, target: object) -> object:
    """Resolve ``fullname`` with the finders on ``sys.meta_path`` other than the watcher."""
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        if finder is watcher or find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def register_hooks() -> bool:
    """Register the wrapt post-import hooks; never raises (the hooks module records failures).
    True where the hooks need the watcher's loaders instead (wrapt cannot be imported)."""
    try:
        from fsdp_autopatch import _config, _hooks

        return _hooks.watch(_config.mode_from_environment())
    except Exception as error:  # a half-removed package must not break the user's import
        keep_error("registering the import hooks", error)
        return False


def notify_loaded(module: object) -> None:
    try:
        from fsdp_autopatch import _hooks

        _hooks.notify_loaded(module)
    except Exception as error:
        keep_error(f"the import hooks for {getattr(module, '__name__', '?')}", error)


def remove_watcher(watcher: object) -> None:
    try:
        sys.meta_path.remove(watcher)
    except ValueError:
        pass


def arm(route: str = START_FILE_ROUTE) -> None:
    """Entry point of the .pth line, the PEP 829 .start file and torch's plugin route (``route``
    says which); runs at most once."""
    global armed, armed_by
    try:
        if armed:
            return
        value = os.environ.get(MODE_VARIABLE, "").strip().lower()
        # The .pth line has already skipped a disabled interpreter; a .start file and torch's
        # plugin route cannot.
        if value in OFF_VALUES:
            return
        names = WATCHED_MODULES if value in FORCE_VALUES else (*WATCHED_MODULES, TRANSFORMERS)
        if any(name in sys.modules for name in names):
            armed, armed_by = True, route
            if register_hooks():  # without wrapt: the watcher's loaders tell the hooks instead
                sys.meta_path.insert(0, FirstImportWatcher(names))
            return
        sys.meta_path.insert(0, FirstImportWatcher(names))
        # Armed only once the watcher is in place: where this failed, a later route tries again.
        armed, armed_by = True, route
        register_fork_handler()
    except Exception as error:  # start-up must never fail because of this package
        keep_error(route, error)


_fork_handler_registered = False


def register_fork_handler() -> None:
    """Register the package's one fork handler, once (from arm(), or from the hooks under apply())."""
    global _fork_handler_registered
    register_at_fork = getattr(os, "register_at_fork", None)  # POSIX only
    if register_at_fork is not None and not _fork_handler_registered:
        _fork_handler_registered = True
        register_at_fork(after_in_child=_after_fork_in_child)


def _after_fork_in_child() -> None:
    # A thread that held a lock at fork() does not exist in the child: nothing would release it.
    for finder in sys.meta_path:
        if isinstance(finder, FirstImportWatcher):
            finder.after_fork_in_child()
    hooks = sys.modules.get("fsdp_autopatch._hooks")
    if hooks is not None:
        hooks.after_fork_in_child()


def disarm() -> None:
    """Remove a watcher that has not fired (``fsdp_autopatch.apply()`` takes over)."""
    for finder in list(sys.meta_path):
        if isinstance(finder, FirstImportWatcher):
            remove_watcher(finder)


__version__ = "0.2.0"
__all__ = ["Status", "__version__", "apply", "status"]


def __getattr__(name: str) -> object:
    # The API loads on first use: typing, logging and dataclasses stay out of start-up.
    if name in ("Status", "apply", "status"):
        from fsdp_autopatch import _api

        return getattr(_api, name)
    raise AttributeError(f"module 'fsdp_autopatch' has no attribute {name!r}")


if arm_when_imported:
    arm(PLUGIN_ROUTE)
