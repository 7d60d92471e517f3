"""Make FSDP2's ``fully_shard`` work on modules with an empty-``__slots__`` base such as ``abc.ABC``.

Installing the package is enough: ``fsdp_autopatch.pth`` (``fsdp_autopatch.start`` on Python
3.15+) calls ``arm()`` in every interpreter of the environment, and the patch is installed once
torch's FSDP2 and an affected transformers are both imported. ``apply()`` and ``status()`` are
for interpreters that do not read ``.pth`` files.

This module is the start-up path, and it runs in every interpreter, pip and linters included.
So it imports only the standard library, raises nothing, prints nothing, and costs one list
insert. wrapt takes 60-80 ms to import; it, the switch parsing and everything else load only
once torch or transformers is actually being imported, which is also when ``FSDP_AUTOPATCH``
is read for good.
"""


import _thread
import os
import sys

WATCHED_PACKAGES = ("torch", "transformers")
# _config.MODE_VARIABLE, named here so that the common case (unset) imports nothing more.
MODE_VARIABLE = "FSDP_AUTOPATCH"

# Set by arm(); read by status().
armed = False


class FirstImportWatcher:
    """A ``sys.meta_path`` finder for the first import of torch or transformers.

    It lends that import a loader that arms the wrapt post-import hooks before the package
    runs, then leaves ``sys.meta_path``. The arming happens in the loader, not here: finders
    run under the interpreter's global import lock, and importing wrapt under it could deadlock
    against a thread that holds one of wrapt's own module locks.
    """

    def __init__(self) -> None:
        self._lock = _thread.RLock()
        self._handed_over = False

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname not in WATCHED_PACKAGES:
            return None
        spec = find_spec_after(self, fullname, path, target)
        if spec is None:  # not installed: nothing to arm for, and the import fails as usual
            return None
        try:
            loader = getattr(spec, "loader", None)
            if loader is not None and hasattr(loader, "exec_module"):
                spec.loader = HandOverLoader(loader, self)  # type: ignore[attr-defined]
                return spec
        except Exception:  # an unusual spec or loader: arm right here instead
            pass
        self.hand_over()
        return spec

    def hand_over(self) -> None:
        # Threads importing the other package at the same moment wait here, in their loaders,
        # until the hooks are in place; they then tell the hooks themselves (exec_module).
        with self._lock:
            if not self._handed_over:
                hand_over()
                self._handed_over = True
                remove_watcher(self)

    def __repr__(self) -> str:
        return f"<fsdp_autopatch watcher for {'/'.join(WATCHED_PACKAGES)}>"


class HandOverLoader:
    """Wraps torch's or transformers' own loader for the one import that arms the hooks."""

    def __init__(self, loader: object, watcher: FirstImportWatcher) -> None:
        self.loader = loader
        self.watcher = watcher

    def create_module(self, spec: object) -> object:
        self.watcher.hand_over()
        create_module = getattr(self.loader, "create_module", None)
        return create_module(spec) if create_module is not None else None

    def exec_module(self, module: object) -> None:
        # The package sees its real loader, as if this one had never been there.
        try:
            module.__loader__ = self.loader  # type: ignore[attr-defined]
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self.loader
        except Exception:
            pass
        self.loader.exec_module(module)  # type: ignore[attr-defined]
        # wrapt's finder was not on sys.meta_path when this import was found, so the
        # post-import hooks for this very package are run from here.
        notify_loaded(module)

    def __getattr__(self, name: str) -> object:
        return getattr(self.loader, name)


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


def hand_over() -> None:
    """Arm the wrapt post-import hooks; never raises (the hooks module records failures)."""
    try:
        from fsdp_autopatch import _config, _hooks

        _hooks.watch(_config.mode_from_environment())
    except Exception:  # a half-removed package must not break the user's import
        pass


def notify_loaded(module: object) -> None:
    try:
        from fsdp_autopatch import _hooks

        _hooks.notify_loaded(module)
    except Exception:
        pass


def remove_watcher(watcher: object) -> None:
    try:
        sys.meta_path.remove(watcher)
    except ValueError:
        pass


def arm() -> None:
    """Entry point of the .pth line and the PEP 829 .start file; runs at most once."""
    global armed
    try:
        if armed:
            return
        # The .pth line has already skipped a disabled interpreter; a .start file cannot.
        if os.environ.get(MODE_VARIABLE) is not None:
            from fsdp_autopatch import _config

            if _config.mode_from_environment().name == _config.OFF:
                return
        armed = True
        if any(name in sys.modules for name in WATCHED_PACKAGES):
            hand_over()
        else:
            sys.meta_path.insert(0, FirstImportWatcher())
    except Exception:  # start-up must never fail because of this package
        pass


def disarm() -> None:
    """Remove a watcher that has not fired (``fsdp_autopatch.apply()`` takes over)."""
    for finder in list(sys.meta_path):
        if isinstance(finder, FirstImportWatcher):
            remove_watcher(finder)


__version__ = "0.1.0"
__all__ = ["Status", "__version__", "apply", "status"]


def __getattr__(name: str) -> object:
    # The API loads on first use: typing, logging and dataclasses stay out of start-up.
    if name in ("Status", "apply", "status"):
        from fsdp_autopatch import _api

        return getattr(_api, name)
    raise AttributeError(f"module 'fsdp_autopatch' has no attribute {name!r}")
