"""Where torch builds its FSDP2 wrapper classes, and how the layout fix is put there.

Which torch releases build their classes at which site is recorded, with the evidence, in
``_matrix``; this module only names the sites. Where torch builds ``FSDP<Name>`` (and
``Replicate<Name>``) once per original class and keeps it in a module-level cache dict that the
building code reads at call time, via ``cache.get(cls)``, that dict is replaced with
``LayoutFixingCache``: on a miss it builds torch's own class, by the very call torch makes, and
keeps it where CPython accepts it, or a layout-compatible class where CPython refuses it. torch
then finds the class in its cache and builds nothing itself. Where there is no cache (torch
2.4), the module's global name ``type`` is shadowed by a function that does the same for the
one call that builds the class. Nothing of ``fully_shard`` itself is replaced, so every alias
of it is covered. After installing, ``check_site`` runs a throwaway ABC module through torch's
construction at the site; only a fix that passed it counts as applied.
"""

from __future__ import annotations

import abc
import builtins
import dis
import inspect
import logging
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

import fsdp_autopatch
from fsdp_autopatch import _config, _layout

logger = logging.getLogger("fsdp_autopatch")


class UnknownLayout(RuntimeError):
    """torch's FSDP2 module is loaded but holds none of the names this package patches."""


@dataclass(frozen=True)
class Site:
    """One place where a torch module builds wrapper classes, described by its global names."""

    module: str
    wrappers: tuple[str, ...]  # the wrapper class's global name, first one present wins
    prefix: str
    deepcopy: str
    cache: Optional[str]  # None: no cache, the class is built inline with the global ``type``
    # The public function whose call builds the classes: it reads ``cache`` (or ``type``) as a
    # global of ``module`` at call time, which is what makes replacing that global reach it.
    entry: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.cache or 'type'}"


_FULLY_SHARD_2_6 = "torch.distributed.fsdp._fully_shard._fully_shard"
_FULLY_SHARD_2_4 = "torch.distributed._composable.fsdp.fully_shard"
REPLICATE_MODULE = "torch.distributed._composable.replicate_with_fsdp"

# First match wins: later torch releases keep a re-exporting shim at the older path.
FULLY_SHARD_SITES = (
    Site(_FULLY_SHARD_2_6, ("FSDPModule",), "FSDP", "_unimplemented_deepcopy", "cls_to_fsdp_cls",
         "fully_shard"),
    Site(_FULLY_SHARD_2_4, ("FSDPModule",), "FSDP", "unimplemented_deepcopy", "cls_to_fsdp_cls",
         "fully_shard"),
    Site(_FULLY_SHARD_2_4, ("FSDPModule",), "FSDP", "unimplemented_deepcopy", None, "fully_shard"),
)
# Depending on the release (see _matrix), replicate() wraps modules in ReplicateModule(FSDPModule)
# or in FSDPModule itself.
REPLICATE_SITE = Site(
    REPLICATE_MODULE, ("ReplicateModule", "FSDPModule"), "Replicate", "_unimplemented_deepcopy",
    "cls_to_replicate_cls", "replicate",
)

# The packages whose import makes fully_shard available; each re-exports it from a site module.
FSDP2_PACKAGES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")

_mirrors = _layout.WrapperMirrors()


@dataclass(frozen=True)
class Construction:
    """How torch builds a wrapper class: ``type(prefix + name, (wrapper, cls), {"__deepcopy__":
    deepcopy})``, called from code in ``module`` (which names the class's ``__module__``); in
    ``helper`` (``_fsdp_init._apply_to_module``) where the site's module calls one."""

    wrapper: type
    prefix: str
    deepcopy: Callable[..., Any]
    module: str
    helper: Optional[Callable[..., Any]] = None

    def name(self, cls: type) -> str:
        return f"{self.prefix}{cls.__name__}"

    def namespace(self) -> dict[str, Any]:
        return {"__deepcopy__": self.deepcopy}

    def upstream(self, cls: type) -> type:
        """torch's own class for ``cls``, built by the call torch makes; raises what it raises."""
        build = _layout.type_called_from(self.module)
        return build(self.name(cls), (self.wrapper, cls), self.namespace())  # type: ignore[no-any-return]

    def choose(self, cls: type, upstream: type) -> _layout.WrapperClass:
        """torch's ``upstream`` class where CPython accepts it, else a layout-compatible one."""
        return _layout.wrapper_class(
            _mirrors, self.wrapper, cls, self.name(cls), self.namespace(), self.module, upstream
        )


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
    every one counted, so that a process sharding thousands of classes stays small."""

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

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


CLASS_RECORD_LIMIT = 100
classes = ClassRecords(CLASS_RECORD_LIMIT)

# Set on the throwaway classes this package sends through torch's construction to check it:
# they are neither logged nor listed as the user's classes; what became of them is kept on them.
_THROWAWAY = "__fsdp_autopatch_throwaway__"
_CHOSEN = "__fsdp_autopatch_chosen__"


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
        logger.warning("cannot build a layout-compatible %s for %s at %s (%s): fully_shard will "
                       "raise torch's own error for it", record.wrapper, original, site, record.reason)
    else:
        logger.debug("left %s to torch at %s: CPython accepts torch's own %s", original, site,
                     record.wrapper)


class LayoutFixingCache(dict):  # type: ignore[type-arg]
    """torch's ``cls -> wrapper class`` cache, answering a miss with the class to use.

    ``get`` is the only method torch's construction calls. On a miss it builds torch's own
    class (once, by torch's call) and keeps it where CPython accepts it, or else a
    layout-compatible class; torch then uses what it finds and builds nothing. Entries torch
    cached before the patch for classes CPython refuses (its failed attempts) are not kept: the
    next ``get`` for such a class builds the compatible class from them.
    ``keeps_torch_classes=False`` is for torch 2.4, which has no cache and builds its class on
    every call: there only compatible classes are kept, and torch's are built per call, as
    without the patch.
    """

    def __init__(self, entries: dict[type, type], construction: Construction, site: str, *,
                 keeps_torch_classes: bool = True) -> None:
        super().__init__()
        self.original = entries  # torch's own dict, put back if the fix fails its self-check
        self.construction = construction
        self.site = site
        self.keeps_torch_classes = keeps_torch_classes
        # Reentrant: building a class runs users' __init_subclass__ and metaclasses, which may
        # shard a module themselves in this thread, as they can without the patch.
        self._lock = threading.RLock()
        # Classes whose outcome is settled without an entry (keeps_torch_classes=False).
        self.settled: set[type] = set()
        self._stale: dict[type, type] = {}
        for cls, built in entries.items():
            if isinstance(cls, type) and isinstance(built, type) and not _layout.accepts(cls, built):
                self._stale[cls] = built
                logger.info("dropped %s, which torch cached at %s before the patch and CPython "
                            "refuses for %s", built.__name__, site, cls.__qualname__)
            else:
                dict.__setitem__(self, cls, built)
        _caches.append(weakref.ref(self))

    def get(self, cls: Any, default: Any = None) -> Any:
        found = dict.get(self, cls)
        if found is None and isinstance(cls, type) and cls not in self.settled:
            found = self.choose(cls)
        return default if found is None else found

    def choose(self, cls: type, upstream: Optional[type] = None) -> type:
        """The class to use for ``cls``, decided once; ``upstream``: torch's class for it, built
        by the caller (torch 2.4's per-call construction)."""
        # One decision per original class, also when threads shard modules of one class at once.
        with self._lock:
            found = dict.get(self, cls)
            if found is not None:
                return found  # type: ignore[no-any-return]
            if upstream is None:
                upstream = self._stale.pop(cls, None) or self.construction.upstream(cls)
            if cls in self.settled:
                return upstream
            try:
                chosen = self.construction.choose(cls, upstream)
            except Exception as error:  # this package's failure: torch's class, as without it
                chosen = _layout.WrapperClass(
                    upstream, _layout.REFUSED,
                    reason=f"fsdp-autopatch failed: {type(error).__name__}: {error}")
            if self.keeps_torch_classes or chosen.outcome == _layout.COMPATIBLE:
                self[cls] = chosen.cls
            else:
                self.settled.add(cls)
            _record(cls, self.site, chosen)
            return chosen.cls


# Every cache (a dict, so not in a WeakSet), so that a forked child does not inherit a lock
# held by a thread that the child does not have.
_caches: list[weakref.ref[LayoutFixingCache]] = []


def _reset_locks_after_fork() -> None:
    for ref in _caches:
        cache = ref()
        if cache is not None:
            cache._lock = threading.RLock()
    classes.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_locks_after_fork)


def _type_for_inline_site(cache: LayoutFixingCache) -> Callable[..., Any]:
    """A stand-in for the builtin ``type`` in a module that builds wrapper classes inline."""
    builtin_type = builtins.type
    construction = cache.construction
    # Every call keeps torch's module name on what it builds, as a direct call would.
    call_type = _layout.type_called_from(construction.module)

    def type_(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 3 and not kwargs:
            name, bases, _namespace = args
            if (isinstance(bases, tuple) and len(bases) == 2 and bases[0] is construction.wrapper
                    and isinstance(bases[1], builtin_type)
                    and name == construction.prefix + bases[1].__name__):
                found = dict.get(cache, bases[1])
                if found is not None:
                    return found
                # torch's own construction, once per call as torch makes it; the first one for
                # a class also decides what the class gets.
                upstream = call_type(*args)
                return upstream if bases[1] in cache.settled else cache.choose(bases[1], upstream)
        return call_type(*args, **kwargs)

    type_.__wrapped__ = builtin_type  # type: ignore[attr-defined]
    return type_


def initializing(module: object) -> bool:
    """Is the import system still running ``module``'s import? (Also True inside its
    post-import hooks, which run from ``exec_module`` after the body has run.)"""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def loaded(name: str) -> Optional[ModuleType]:
    """The module if it is imported and its import has finished."""
    module = sys.modules.get(name)
    if module is None or initializing(module):
        return None
    return module


def _resolve(site: Site, module: Optional[ModuleType] = None) -> Optional[tuple[ModuleType, Construction]]:
    module = loaded(site.module) if module is None else module
    if module is None:
        return None
    wrapper = next((getattr(module, n) for n in site.wrappers if hasattr(module, n)), None)
    deepcopy = getattr(module, site.deepcopy, None)
    has_cache = site.cache is None or isinstance(getattr(module, site.cache, None), dict)
    if not isinstance(wrapper, type) or deepcopy is None or not has_cache:
        return None
    # Releases that build the class in the shared helper _fsdp_init._apply_to_module (see
    # _matrix) call type() from there, which names the class's __module__.
    helper = getattr(module, "_apply_to_module", None)
    builder = getattr(helper, "__module__", None) or module.__name__
    return module, Construction(wrapper, site.prefix, deepcopy, builder, helper)


def patch_site(site: Site, module: Optional[ModuleType] = None) -> bool:
    """Install the fix at ``site``; False if its module is not loaded or does not have the site's
    names. ``module``: the site's module, whose body has run (as in its post-import hook)."""
    resolved = _resolve(site, module)
    if resolved is None:
        return False
    module, construction = resolved
    if site.cache is None:
        current = getattr(module, "type", builtins.type)
        if getattr(current, "__wrapped__", None) is not builtins.type:
            cache = LayoutFixingCache({}, construction, site.name, keeps_torch_classes=False)
            module.type = _type_for_inline_site(cache)  # type: ignore[attr-defined]
        return True
    current = getattr(module, site.cache)
    if not isinstance(current, LayoutFixingCache):
        setattr(module, site.cache, LayoutFixingCache(current, construction, site.name))
    return True


# What ``fsdp2_presence`` finds.
FSDP2_ABSENT = "absent"  # no FSDP2 package has been imported (or finished importing) yet
FSDP2_LOADED = "loaded"  # fully_shard is there: a site module finished importing, or a package holds it
FSDP2_ELSEWHERE = "elsewhere"  # an FSDP2 package finished importing without fully_shard in it


def fsdp2_presence(just_ran: Optional[object] = None) -> str:
    """Is FSDP2 imported? ``just_ran``: a module whose body has just run (in its post-import
    hook, where the import system still marks it as initializing)."""
    if any(loaded(site.module) is not None for site in FULLY_SHARD_SITES):
        return FSDP2_LOADED
    packages = [sys.modules.get(name) for name in FSDP2_PACKAGES]
    # Read while a package may still be running its __init__ (a post-import hook of another).
    if any(callable(getattr(package, "fully_shard", None)) for package in packages):
        return FSDP2_LOADED
    if any(package is not None and (package is just_ran or not initializing(package))
           for package in packages):
        return FSDP2_ELSEWHERE
    return FSDP2_ABSENT


def fully_shard_site() -> Optional[Site]:
    """The first known site that the loaded torch has, or None."""
    return next((site for site in FULLY_SHARD_SITES if _resolve(site) is not None), None)


def unknown_layout_reason(torch_version: Optional[str]) -> str:
    """What to say when FSDP2 is imported but none of ``FULLY_SHARD_SITES`` is there."""
    torch = f"torch {torch_version}" if torch_version else "this torch"
    return (
        f"{torch}'s FSDP2 layout is unknown to fsdp-autopatch {fsdp_autopatch.__version__} (none "
        "of the class-construction sites it patches is there): fully_shard runs unpatched; "
        f"upgrade fsdp-autopatch, or set {_config.MODE_VARIABLE}=0 if you do not need it"
    )


def install_fully_shard() -> Site:
    """Patch fully_shard's class construction at the first known site; raises UnknownLayout."""
    for site in FULLY_SHARD_SITES:
        if patch_site(site):
            return site
    raise UnknownLayout(unknown_layout_reason(None))


def unpatch_site(site: Site, module: ModuleType) -> None:
    """Put back what ``patch_site`` replaced: torch's own dict (with what was cached since), or
    the builtin ``type``."""
    if site.cache is None:
        if getattr(getattr(module, "type", None), "__wrapped__", None) is builtins.type:
            del module.type  # type: ignore[attr-defined]
        return
    current = getattr(module, site.cache, None)
    if isinstance(current, LayoutFixingCache):
        current.original.update(current)
        setattr(module, site.cache, current.original)


def probe_layout_bug() -> Optional[bool]:
    """Does CPython refuse the FSDP class this torch builds for an ABC module?

    torch's own construction at the first known site is applied, unpatched and with a throwaway
    cache so that torch's own stays clean, to an uninitialised instance of a throwaway
    ``class (ABC, nn.Module)``. True: refused (the bug); False: accepted; None: cannot tell (no
    known site, a helper of unknown signature, or another error). Never raises.
    """
    try:
        return _probe()
    except Exception as error:
        logger.debug("the layout probe could not run (%s: %s)", type(error).__name__, error)
        return None


def _probe() -> Optional[bool]:
    site = fully_shard_site()
    if site is None:
        return None
    _, construction = _resolve(site)  # type: ignore[misc]
    instance = object.__new__(_throwaway_abc_module("LayoutProbe"))
    try:
        _apply_construction(construction, instance, {}, _layout.type_called_from(construction.module))
    except TypeError as error:
        if "__class__" in str(error) and not isinstance(instance, construction.wrapper):
            return True
        logger.debug("the layout probe failed otherwise (%s)", error)
        return None
    # Accepted: the instance now is of a subclass of the wrapper, as torch's modules become.
    return False if isinstance(instance, construction.wrapper) else None


def check_site(site: Site, module: ModuleType) -> Optional[str]:
    """What keeps the installed fix at ``site`` from working, in one line; None when it works.

    It works when torch's entry function (``fully_shard``, ``replicate``) reads the global this
    package replaced, by name, at call time (read from its bytecode), and a throwaway ``class
    (ABC, nn.Module)`` instance goes through torch's construction at the site, patched, and
    CPython accepts the class it gets. Never raises.
    """
    try:
        return _check(site, module)
    except Exception as error:
        return f"the self-check at {site.name} failed: {type(error).__name__}: {error}"


def _check(site: Site, module: ModuleType) -> Optional[str]:
    resolved = _resolve(site, module)
    if resolved is None:
        return f"{site.module} lost the names the patch uses"
    _, construction = resolved
    read = site.cache or "type"
    entry = getattr(module, site.entry, None)
    if entry is None or not reads_global(inspect.unwrap(entry), read):
        return (f"torch's {site.module}.{site.entry} does not read the global {read} that the patch "
                "replaced, so it would not use the fix")
    cache: dict[type, type] = getattr(module, site.cache) if site.cache else {}
    cls = _throwaway_abc_module("SelfCheck")
    instance = object.__new__(cls)
    try:
        _apply_construction(construction, instance, cache, getattr(module, "type", builtins.type))
    except TypeError as error:
        chosen = cls.__dict__.get(_CHOSEN)
        why = f" (no compatible class: {chosen.reason})" if chosen is not None and chosen.reason else ""
        return f"a throwaway ABC module still fails in torch's construction at {site.name}: {error}{why}"
    finally:
        cache.pop(cls, None)
    if not isinstance(instance, construction.wrapper):
        return f"a throwaway ABC module did not become a {construction.wrapper.__name__} at {site.name}"
    return None


def keep_if_working(site: Site, module: ModuleType) -> Optional[str]:
    """``check_site`` on a site just patched: where the fix fails it, torch's own cache (or
    ``type``) is put back and the one-line problem returned; None where the fix stays."""
    problem = check_site(site, module)
    if problem is not None:
        unpatch_site(site, module)
    return problem


def reads_global(function: Callable[..., Any], name: str) -> bool:
    """Does ``function``'s own code load the global ``name`` (so that rebinding it reaches it)?"""
    code = getattr(function, "__code__", None)
    return code is not None and any(
        instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and instruction.argval == name
        for instruction in dis.get_instructions(code)
    )


def _throwaway_abc_module(name: str) -> type:
    """A new ``class name(ABC, nn.Module)``, marked so that it is never listed as the user's."""
    import torch.nn

    return type(name, (abc.ABC, torch.nn.Module), {_THROWAWAY: True, "__module__": __name__})


def _apply_construction(
    construction: Construction, instance: object, cache: dict[type, type], type_: Callable[..., Any]
) -> None:
    """What torch does to a module at a site, with ``cache`` as its class cache and ``type_`` as
    its ``type``: ``_apply_to_module`` where the site calls it (torch 2.11+), else the code
    torch 2.4 - 2.10 run inline in ``fully_shard`` (2.4's has no cache: an empty one acts alike).
    Raises TypeError when CPython refuses the swap, as torch does."""
    if construction.helper is not None:
        call = _bind_helper(construction.helper, instance, construction, cache)
        if call is None:
            raise UnknownLayout("torch's _apply_to_module takes arguments unknown to fsdp-autopatch")
        call()
        return
    cls = type(instance)
    new_cls = cache.get(cls, None)
    if not new_cls:
        new_cls = type_(construction.name(cls), (construction.wrapper, cls), construction.namespace())
        cache[cls] = new_cls
    instance.__class__ = new_cls


def _bind_helper(
    helper: Callable[..., Any], instance: object, construction: Construction, cache: dict[type, type]
) -> Optional[Callable[[], Any]]:
    """``helper`` called for ``instance`` with its arguments matched to its signature by name;
    None when it takes a required parameter this package does not know."""
    values: dict[str, Any] = {
        "modules": (instance,),
        "cls_to_wrapper_cls": cache,
        "wrapper_module_cls": construction.wrapper,
        "wrapper_cls_prefix": construction.prefix,
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
