"""Where torch builds its FSDP2 wrapper classes, and how the layout fix is put there.

Which torch releases build their classes at which site is recorded, with the evidence, in
``_matrix``; this module only names the sites. Where torch builds ``FSDP<Name>`` (and
``Replicate<Name>``) once per original class and keeps it in a module-level cache dict that the
building code reads at call time, via ``cache.get(cls)``, that dict is replaced with
``LayoutFixingCache``: a miss for a class that needs it is filled with a layout-compatible
class; for every other class the miss stays a miss and torch builds exactly its own class.
Where there is no cache, the module's global name ``type`` is shadowed by a function that does
the same for the one call that builds the class. Nothing of ``fully_shard`` itself is replaced,
so every alias of it is covered.
"""

from __future__ import annotations

import abc
import builtins
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
    deepcopy})``, called from code in ``module`` (which names the class's ``__module__``)."""

    wrapper: type
    prefix: str
    deepcopy: Callable[..., Any]
    module: str

    def build(self, cls: type) -> Optional[type]:
        """A layout-compatible wrapper class for ``cls``, or None where CPython accepts torch's
        own (torch then builds it, exactly as without the patch)."""
        return _layout.build_wrapper_class(
            _mirrors, self.wrapper, cls, f"{self.prefix}{cls.__name__}",
            {"__deepcopy__": self.deepcopy}, self.module,
        )


class LayoutFixingCache(dict):  # type: ignore[type-arg]
    """torch's ``cls -> wrapper class`` cache that builds layout-compatible classes on a miss.

    ``get`` is the only method torch's construction calls. For a class upstream's construction
    can build, it answers like a plain dict (a miss), so torch builds and stores its own class.
    """

    def __init__(self, entries: dict[type, type], construction: Construction, site: str) -> None:
        super().__init__(entries)
        self.construction = construction
        self.site = site
        self._lock = threading.Lock()
        self._refused: set[type] = set()
        # Classes CPython accepts torch's own class for: torch 2.4's inline site has no cache
        # of its own, so without this it would ask again on every call.
        self._upstream: set[type] = set()
        _caches.append(weakref.ref(self))

    def get(self, cls: Any, default: Any = None) -> Any:
        found = dict.get(self, cls)
        if found is None and isinstance(cls, type):
            found = self._build(cls)
        return default if found is None else found

    def _build(self, cls: type) -> Optional[type]:
        # One class per original class, also when threads shard modules of one class at once.
        with self._lock:
            found = dict.get(self, cls)
            if found is not None or cls in self._refused or cls in self._upstream:
                return found
            try:
                built = self.construction.build(cls)
            except Exception as error:  # upstream then fails as it would have without us
                self._refused.add(cls)
                logger.warning("cannot build a layout-compatible %s%s (%s); leaving it to torch",
                               self.construction.prefix, cls.__name__, error)
                return None
            if built is None:
                self._upstream.add(cls)
            else:
                logger.debug("built %s for %s via %s: CPython refuses torch's own class",
                              built.__name__, cls.__qualname__, self.site)
                self[cls] = built
            return built


# Every cache (a dict, so not in a WeakSet), so that a forked child does not inherit a lock
# held by a thread that the child does not have.
_caches: list[weakref.ref[LayoutFixingCache]] = []


def _reset_locks_after_fork() -> None:
    for ref in _caches:
        cache = ref()
        if cache is not None:
            cache._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_locks_after_fork)


def _type_for_inline_site(cache: LayoutFixingCache) -> Callable[..., Any]:
    """A stand-in for the builtin ``type`` in a module that builds wrapper classes inline."""
    builtin_type = builtins.type
    construction = cache.construction
    # Every other call keeps torch's module name on what it builds, as a direct call would.
    call_type = _layout.type_called_from(construction.module)

    def type_(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 3 and not kwargs:
            name, bases, _namespace = args
            if (isinstance(bases, tuple) and len(bases) == 2 and bases[0] is construction.wrapper
                    and isinstance(bases[1], builtin_type)
                    and name == construction.prefix + bases[1].__name__):
                built = cache.get(bases[1])
                if built is not None:
                    return built
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
    return module, Construction(wrapper, site.prefix, deepcopy, builder)


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
            cache = LayoutFixingCache({}, construction, site.name)
            module.type = _type_for_inline_site(cache)  # type: ignore[attr-defined]
        return True
    current = getattr(module, site.cache)
    if not isinstance(current, LayoutFixingCache):
        setattr(module, site.cache, LayoutFixingCache(current, construction, site.name))
    return True


def fsdp2_loaded() -> bool:
    """Is FSDP2 imported: a module that builds its classes has finished importing, or one of
    torch's FSDP2 packages already holds ``fully_shard``, wherever torch now defines it?
    (The package may still be running its ``__init__``: post-import hooks fire from inside it.)"""
    if any(loaded(site.module) is not None for site in FULLY_SHARD_SITES):
        return True
    return any(callable(getattr(sys.modules.get(name), "fully_shard", None)) for name in FSDP2_PACKAGES)


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


def install_fully_shard() -> str:
    """Patch fully_shard's class construction; returns the site's name or raises UnknownLayout."""
    for site in FULLY_SHARD_SITES:
        if patch_site(site):
            return site.name
    raise UnknownLayout(unknown_layout_reason(None))


_FSDP_INIT = "torch.distributed.fsdp._fully_shard._fsdp_init"


def probe_layout_bug() -> Optional[bool]:
    """Does CPython refuse the FSDP class this torch builds for an ABC module?

    torch's own construction is applied to a throwaway ``class (ABC, nn.Module)``: its helper
    ``_fsdp_init._apply_to_module`` where it has one (torch 2.11+), with a throwaway cache so
    torch's own stays clean; otherwise the ``type(...)`` call every torch 2.4 - 2.10 makes. The
    swap is tried on an uninitialised instance. True: refused (the bug); False: accepted;
    None: cannot tell (no FSDP2 wrapper class found, a helper of unknown signature, or another
    error). Never raises.
    """
    try:
        return _probe()
    except Exception as error:
        logger.debug("the layout probe could not run (%s: %s)", type(error).__name__, error)
        return None


def _probe() -> Optional[bool]:
    construction = _fsdp2_construction()
    if construction is None:
        return None
    import torch.nn

    class LayoutProbe(abc.ABC, torch.nn.Module):
        pass

    module = object.__new__(LayoutProbe)
    helper = getattr(loaded(_FSDP_INIT), "_apply_to_module", None)
    if helper is not None:
        call = _bind_helper(helper, module, construction)
        if call is None:
            return None
    else:
        def call() -> None:
            name = f"{construction.prefix}{LayoutProbe.__name__}"
            dct = {"__deepcopy__": construction.deepcopy}
            module.__class__ = type(name, (construction.wrapper, LayoutProbe), dct)
    try:
        call()
    except TypeError as error:
        if "__class__" in str(error) and type(module) is LayoutProbe:
            return True
        logger.debug("the layout probe failed otherwise (%s)", error)
        return None
    # Accepted: the instance now is of a subclass of the wrapper, as torch's modules become.
    return False if isinstance(module, construction.wrapper) else None


def _bind_helper(
    helper: Callable[..., Any], module: object, construction: Construction
) -> Optional[Callable[[], Any]]:
    """``helper`` called with this probe's arguments matched to its signature by name; None when
    it takes a required parameter this package does not know."""
    values: dict[str, Any] = {
        "modules": (module,),
        "cls_to_wrapper_cls": {},  # throwaway: torch's module-level cache never sees the probe
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
            logger.debug("torch's %s takes %s, unknown to this package: not probed",
                         getattr(helper, "__qualname__", helper), parameter.name)
            return None
    return lambda: helper(*args, **kwargs)


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a layout probe class is never copied")


def _fsdp2_construction() -> Optional[Construction]:
    """How this torch builds ``FSDP<Name>`` classes: from a known site, or else from the
    wrapper class ``torch.distributed.fsdp`` exports (its layout is all the probe needs)."""
    for site in FULLY_SHARD_SITES:
        resolved = _resolve(site)
        if resolved is not None:
            return resolved[1]
    # Read while torch.distributed.fsdp may still be running its __init__ (the post-import hook).
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        wrapper = getattr(sys.modules.get(name), "FSDPModule", None)
        if isinstance(wrapper, type):
            return Construction(wrapper, "FSDP", _unimplemented_deepcopy, name)
    return None
