"""The patch: a stand-in for ``type`` in the torch module that builds wrapper classes.

Each site of ``_sites`` builds ``type(f"{prefix}{name}", (Wrapper, cls), {"__deepcopy__": ...})``
in a function that calls ``type`` by its global name. ``install`` puts a ``TypeStandIn`` there as
the module's global ``type``: for that one call shape it builds torch's own class, by the very
call torch makes, and returns it where CPython accepts it for ``cls``, or a layout-compatible
class (``_layout``) where CPython refuses it; every other call is the builtin's. torch's public
functions and its class caches stay torch's own objects (``get_cls_to_fsdp_cls()`` is a plain
dict), so every alias of ``fully_shard`` and every reader of a cache sees what torch made.

After installing, ``check`` sends a throwaway ``class (ABC, nn.Module)`` instance through torch's
construction at the site; only a site that passes counts as patched. ``probe_layout_bug`` does
the same unpatched, to ask torch and CPython whether the bug is here at all.
"""

from __future__ import annotations

import abc
import builtins
import inspect
import logging
import sys
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

from fsdp_autopatch import _layout, _sites
from fsdp_autopatch._sites import Site

logger = logging.getLogger("fsdp_autopatch")

_mirrors = _layout.WrapperMirrors()
# One decision per original class and wrapper, also when threads wrap modules of one class at
# once. Reentrant: building a class runs users' __init_subclass__ and metaclasses, which may wrap
# a module themselves in this thread, as they can without the patch (torch holds no lock there).
_lock = threading.RLock()


class Construction:
    """How torch builds a site's wrapper classes: ``type(prefix + name, (wrapper, cls),
    {"__deepcopy__": deepcopy})``, called from ``builder`` in ``module`` (which names the class's
    ``__module__``). ``helper``: the builder function, where it is not the entry (torch 2.11+)."""

    def __init__(self, site: Site, wrapper: type, deepcopy: Callable[..., Any], module: ModuleType,
                 helper: Optional[Callable[..., Any]]) -> None:
        self.site = site
        self.wrapper = wrapper
        self.deepcopy = deepcopy
        self.module = module
        self.helper = helper
        # What became of each original class: per class, not per call (weak: torch's cache, where
        # there is one, is what keeps classes alive, as without the patch).
        self.chosen: weakref.WeakKeyDictionary[type, _layout.WrapperClass] = weakref.WeakKeyDictionary()

    def name(self, cls: type) -> str:
        return f"{self.site.prefix}{cls.__name__}"

    def namespace(self) -> dict[str, Any]:
        return {"__deepcopy__": self.deepcopy}


@dataclass(frozen=True)
class ClassRecord:
    """What became of one original class at one site, for ``status().classes``."""

    name: str  # the original class's __qualname__
    module: str
    site: str
    wrapper: str  # the name of the class the site used
    outcome: str  # _layout.TORCH, COMPATIBLE or REFUSED
    parent: Optional[str] = None  # COMPATIBLE: the layout parent, e.g. "abc.ABC"
    reason: Optional[str] = None  # REFUSED: why, in one line


class ClassRecords:
    """The classes that went through a patched site in this process: the first ``limit`` kept,
    every one counted, so that a process wrapping thousands of classes stays small."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: list[ClassRecord] = []
        self._seen = 0
        self._lock = threading.Lock()

    def add(self, record: ClassRecord) -> None:
        with self._lock:
            self._seen += 1
            if len(self._kept) < self.limit:
                self._kept.append(record)

    def snapshot(self) -> tuple[tuple[ClassRecord, ...], int]:
        with self._lock:
            return tuple(self._kept), self._seen


CLASS_RECORD_LIMIT = 100
classes = ClassRecords(CLASS_RECORD_LIMIT)

# Set on the throwaway classes this package sends through torch's construction to check it:
# they are neither logged nor listed as the user's classes; what became of them is kept on them.
_THROWAWAY = "__fsdp_autopatch_throwaway__"
_CHOSEN = "__fsdp_autopatch_chosen__"


def after_fork_in_child() -> None:
    """A thread that held a lock at fork() does not exist in the child: nothing would release it."""
    global _lock
    _lock = threading.RLock()
    classes._lock = threading.Lock()


def _record(cls: type, site: str, chosen: _layout.WrapperClass) -> None:
    """List the class in the status and say once in the log what became of it."""
    if cls.__dict__.get(_THROWAWAY):
        type.__setattr__(cls, _CHOSEN, chosen)
        return
    parent = _layout.parent_name(chosen.parent) if chosen.parent is not None else None
    record = ClassRecord(cls.__qualname__, cls.__module__, site, chosen.cls.__name__, chosen.outcome,
                         parent, chosen.reason or None)
    classes.add(record)
    original = f"{record.module}.{record.name}"
    if chosen.outcome == _layout.COMPATIBLE:
        logger.info("built %s on %s for %s at %s: CPython refuses torch's own class for it",
                    record.wrapper, parent, original, site)
    elif chosen.outcome == _layout.REFUSED:
        logger.warning("cannot build a layout-compatible %s for %s at %s (%s): torch will raise its "
                       "own error for it", record.wrapper, original, site, record.reason)
    else:
        logger.debug("left %s to torch at %s: CPython accepts torch's own %s", original, site,
                     record.wrapper)


class TypeStandIn:
    """The global ``type`` of a torch module that builds wrapper classes (see the module's doc).

    It answers ``isinstance``, ``issubclass`` and attribute look-ups as the builtin does, so the
    rest of the module's code cannot tell it from ``type``.
    """

    def __init__(self, module_name: str) -> None:
        self.module_name = module_name
        # type() names a new class's __module__ after the calling frame's globals: torch's module.
        self.build = _layout.type_called_from(module_name)
        self.constructions: dict[type, Construction] = {}  # by wrapper class

    __wrapped__ = builtins.type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 3 and not kwargs:
            name, bases, _namespace = args
            if builtins.type(bases) is tuple and len(bases) == 2 and isinstance(bases[0], builtins.type) \
                    and isinstance(bases[1], builtins.type):
                construction = self.constructions.get(bases[0])
                if construction is not None and name == construction.name(bases[1]):
                    return self.wrapper_class(construction, bases[1], args)
        return self.build(*args, **kwargs)

    def wrapper_class(self, construction: Construction, cls: type, args: tuple[Any, ...]) -> type:
        """torch's class for ``cls``, built by torch's own call each time torch asks (once per
        class where torch caches it, once per call where it does not), unless CPython refuses it:
        then the layout-compatible class, built once per class."""
        chosen = construction.chosen.get(cls)
        if chosen is None:
            with _lock:
                chosen = construction.chosen.get(cls)
                if chosen is None:
                    upstream = self.build(*args)  # torch's call; what it raises is torch's
                    try:
                        chosen = _layout.wrapper_class(
                            _mirrors, construction.wrapper, cls, args[0], construction.namespace(),
                            self.module_name, upstream)
                    except Exception as error:  # this package's failure: torch's class, as without it
                        chosen = _layout.WrapperClass(
                            upstream, _layout.REFUSED,
                            reason=f"fsdp-autopatch failed: {type(error).__name__}: {error}")
                    construction.chosen[cls] = chosen
                    _record(cls, construction.site.name, chosen)
                    return chosen.cls
        return chosen.cls if chosen.outcome == _layout.COMPATIBLE else self.build(*args)

    def __instancecheck__(self, instance: Any) -> bool:
        return isinstance(instance, builtins.type)

    def __subclasscheck__(self, subclass: type) -> bool:
        return issubclass(subclass, builtins.type)

    def __getattr__(self, name: str) -> Any:
        return getattr(builtins.type, name)

    def __repr__(self) -> str:
        return f"<fsdp_autopatch stand-in for type in {self.module_name}>"


def initializing(module: object) -> bool:
    """Is the import system still running ``module``'s import? (Also True inside its
    post-import hooks, which run from ``exec_module`` after the body has run.)"""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def loaded(name: str, just_ran: Optional[object] = None) -> Optional[ModuleType]:
    """The module if it is imported and its import has finished (or ``just_ran`` is it: a module
    whose body has run, in its own post-import hook)."""
    module = sys.modules.get(name)
    if module is None or (module is not just_ran and initializing(module)):
        return None
    return module


def _code_of(module_name: str, name: str) -> list[Any]:
    function = getattr(sys.modules.get(module_name), name, None)
    code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
    return [] if code is None else [code]


def _has(module_name: str, name: str) -> bool:
    return hasattr(sys.modules.get(module_name), name)


def resolve(site: Site, just_ran: Optional[object] = None) -> Optional[Construction]:
    """The site's construction in the loaded torch, or None: a module not loaded (or still being
    imported), a name missing, or bytecode that does not build classes as the site says."""
    module, builder_module = loaded(site.module, just_ran), loaded(site.builder_module, just_ran)
    if module is None or builder_module is None:
        return None
    if _sites.shape_problem(site, _has, _code_of) is not None:
        return None
    current = builder_module.__dict__.get("type", builtins.type)
    if current is not builtins.type and not isinstance(current, TypeStandIn):
        return None  # the module binds a type of its own: not the builtin this package stands in for
    wrapper = next(getattr(module, name) for name in site.wrappers if hasattr(module, name))
    # A builder in another module is torch 2.11+'s shared helper, called with the construction's
    # arguments; it is taken as the entry calls it (its own module's binding), so that the
    # self-check goes where fully_shard goes. A builder in the entry's module builds inline.
    helper = getattr(module, site.builder) if site.builder_module != site.module else None
    if not isinstance(wrapper, type):
        return None
    return Construction(site, wrapper, getattr(module, site.deepcopy), builder_module, helper)


def resolve_api(api: str, just_ran: Optional[object] = None) -> Optional[Construction]:
    """The first site of ``api`` that the loaded torch has."""
    for site in _sites.SITES:
        if site.api == api:
            construction = resolve(site, just_ran)
            if construction is not None:
                return construction
    return None


def install(construction: Construction) -> None:
    """Put the stand-in in place for this construction's wrapper, and drop what torch cached
    before the patch for classes CPython refuses (its failed attempts), so that the next call
    for them builds anew."""
    module = construction.module
    with _lock:
        stand_in = module.__dict__.get("type")
        if not isinstance(stand_in, TypeStandIn):
            stand_in = TypeStandIn(module.__name__)
            module.type = stand_in  # type: ignore[attr-defined]
        stand_in.constructions[construction.wrapper] = construction
    cache = getattr(sys.modules.get(construction.site.module), construction.site.cache or "", None)
    if isinstance(cache, dict):
        for cls, built in list(cache.items()):
            if isinstance(cls, type) and isinstance(built, type) and not _layout.acceptance(cls)(built):
                cache.pop(cls, None)
                logger.info("dropped %s, which torch cached at %s before the patch and CPython "
                            "refuses for %s", built.__name__, construction.site.name, cls.__qualname__)


def uninstall(construction: Construction) -> None:
    """Take this construction's wrapper out of the stand-in; the builtin ``type`` is back once
    the stand-in serves no other wrapper."""
    module = construction.module
    with _lock:
        stand_in = module.__dict__.get("type")
        if isinstance(stand_in, TypeStandIn):
            stand_in.constructions.pop(construction.wrapper, None)
            if not stand_in.constructions:
                del module.type  # type: ignore[attr-defined]


def install_checked(construction: Construction) -> Optional[str]:
    """``install``, then ``check``: where either fails, the fix is uninstalled and the one-line
    problem returned; None where the fix stays. Never raises."""
    try:
        install(construction)
    except Exception as error:
        problem: Optional[str] = f"installing it failed: {type(error).__name__}: {error}"
    else:
        problem = check(construction)
        problem = problem and f"the fix failed its self-check: {problem}"
    if problem is not None:
        uninstall(construction)
    return problem


def check(construction: Construction) -> Optional[str]:
    """What keeps the installed fix from working, in one line; None when it works: a throwaway
    ``class (ABC, nn.Module)`` instance goes through torch's construction at the site, patched,
    and CPython accepts the class it gets. Never raises."""
    site = construction.site.name
    try:
        cls = _throwaway_abc_module("SelfCheck")
        instance = object.__new__(cls)
        try:
            patched = construction.module.__dict__.get("type", builtins.type)
            _apply_construction(construction, instance, patched)
        except TypeError as error:
            chosen = cls.__dict__.get(_CHOSEN)
            why = f" (no compatible class: {chosen.reason})" if chosen is not None and chosen.reason else ""
            return f"a throwaway ABC module still fails in torch's construction at {site}: {error}{why}"
    except Exception as error:
        return f"the self-check at {site} failed: {type(error).__name__}: {error}"
    if not isinstance(instance, construction.wrapper):
        return f"a throwaway ABC module did not become a {construction.wrapper.__name__} at {site}"
    return None


def probe_layout_bug(construction: Optional[Construction] = None) -> Optional[bool]:
    """Does CPython refuse the class this torch builds for an ABC module at a site (the first
    loaded one by default)?

    torch's own construction, unpatched, is applied to an uninitialised instance of a throwaway
    ``class (ABC, nn.Module)``. True: refused (the bug); False: accepted; None: cannot tell (no
    known site, a helper of unknown signature, or another error). Never raises.
    """
    try:
        if construction is None:
            construction = next(filter(None, map(resolve_api, _sites.APIS)), None)
            if construction is None:
                return None
        instance = object.__new__(_throwaway_abc_module("LayoutProbe"))
        try:
            unpatched = _layout.type_called_from(construction.module.__name__)
            _apply_construction(construction, instance, unpatched)
        except TypeError as error:
            if "__class__" in str(error) and not isinstance(instance, construction.wrapper):
                return True
            logger.debug("the layout probe failed otherwise (%s)", error)
            return None
        # Accepted: the instance now is of a subclass of the wrapper, as torch's modules become.
        return False if isinstance(instance, construction.wrapper) else None
    except Exception as error:
        logger.debug("the layout probe could not run (%s: %s)", type(error).__name__, error)
        return None


def _throwaway_abc_module(name: str) -> type:
    """A new ``class name(ABC, nn.Module)``, marked so that it is never listed as the user's."""
    import torch.nn

    return type(name, (abc.ABC, torch.nn.Module), {_THROWAWAY: True, "__module__": __name__})


def _apply_construction(construction: Construction, instance: object, type_: Callable[..., Any]) -> None:
    """What torch does to a module at a site, with a throwaway class cache and ``type_`` as the
    ``type`` of inline construction: the helper where the site has one (torch 2.11+, whose global
    ``type`` is whatever the module has now), else the code the other sites run inline in their
    entry function. Raises TypeError when CPython refuses the swap, as torch does."""
    if construction.helper is not None:
        call = _bind_helper(construction, instance)
        if call is None:
            raise TypeError(f"torch's {construction.site.builder} takes arguments unknown to fsdp-autopatch")
        call()
        return
    cls = type(instance)
    new_cls = type_(construction.name(cls), (construction.wrapper, cls), construction.namespace())
    instance.__class__ = new_cls


def _bind_helper(construction: Construction, instance: object) -> Optional[Callable[[], Any]]:
    """The helper called for ``instance`` with a throwaway cache, its arguments matched to its
    signature by name; None when it takes a required parameter this package does not know."""
    helper = construction.helper
    assert helper is not None
    values: dict[str, Any] = {
        "modules": (instance,),
        "cls_to_wrapper_cls": {},
        "wrapper_module_cls": construction.wrapper,
        "wrapper_cls_prefix": construction.site.prefix,
        "unimplemented_deepcopy": construction.deepcopy,
    }
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for parameter in inspect.signature(helper).parameters.values():
        if parameter.name in values:
            if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
                args.append(values[parameter.name])
            else:
                kwargs[parameter.name] = values[parameter.name]
        elif parameter.default is inspect.Parameter.empty and parameter.kind not in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD
        ):
            logger.debug("torch's %s takes %s, unknown to this package",
                         getattr(helper, "__qualname__", helper), parameter.name)
            return None
    return lambda: helper(*args, **kwargs)
