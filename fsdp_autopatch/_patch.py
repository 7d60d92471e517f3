"""Where torch builds its FSDP2 wrapper classes, and how the layout fix is put there.

torch 2.5 - 2.15 build ``FSDP<Name>`` (and ``Replicate<Name>``) once per original class and
keep it in a module-level cache dict that the building code reads at call time, via
``cache.get(cls)``. Replacing that dict with ``LayoutFixingCache`` fills a miss for a class
that needs it with a layout-compatible class; for every other class the miss stays a miss and
torch builds exactly its own class. torch 2.4 has no cache: there, the module's global name
``type`` is shadowed by a function that does the same for the one call that builds the class.
Nothing of ``fully_shard`` itself is replaced, so every alias of it is covered.
"""

from __future__ import annotations

import abc
import builtins
import logging
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

from fsdp_autopatch import _layout

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

    @property
    def name(self) -> str:
        return f"{self.module}.{self.cache or 'type'}"


_FULLY_SHARD_2_6 = "torch.distributed.fsdp._fully_shard._fully_shard"
_FULLY_SHARD_2_4 = "torch.distributed._composable.fsdp.fully_shard"
REPLICATE_MODULE = "torch.distributed._composable.replicate_with_fsdp"

# First match wins: torch 2.6+ keeps a re-exporting shim at the 2.4/2.5 path.
FULLY_SHARD_SITES = (
    Site(_FULLY_SHARD_2_6, ("FSDPModule",), "FSDP", "_unimplemented_deepcopy", "cls_to_fsdp_cls"),
    Site(_FULLY_SHARD_2_4, ("FSDPModule",), "FSDP", "unimplemented_deepcopy", "cls_to_fsdp_cls"),
    Site(_FULLY_SHARD_2_4, ("FSDPModule",), "FSDP", "unimplemented_deepcopy", None),
)
# torch 2.9 wraps replicated modules in FSDPModule itself; 2.10+ in ReplicateModule(FSDPModule).
REPLICATE_SITE = Site(
    REPLICATE_MODULE, ("ReplicateModule", "FSDPModule"), "Replicate", "_unimplemented_deepcopy",
    "cls_to_replicate_cls",
)

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
        """A layout-compatible wrapper class for ``cls``, or None where torch's own is accepted."""
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

    def get(self, cls: Any, default: Any = None) -> Any:
        found = dict.get(self, cls)
        if found is None and isinstance(cls, type):
            found = self._build(cls)
        return default if found is None else found

    def _build(self, cls: type) -> Optional[type]:
        # One class per original class, also when threads shard modules of one class at once.
        with self._lock:
            found = dict.get(self, cls)
            if found is not None or cls in self._refused:
                return found
            try:
                built = self.construction.build(cls)
            except Exception as error:  # upstream then fails as it would have without us
                self._refused.add(cls)
                logger.warning("cannot build a layout-compatible %s%s (%s); leaving it to torch",
                               self.construction.prefix, cls.__name__, error)
                return None
            if built is not None:
                logger.debug("built %s for %s via %s", built.__name__, cls.__qualname__, self.site)
                self[cls] = built
            return built


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


def loaded(name: str) -> Optional[ModuleType]:
    """The module if it is imported and has finished running its body."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return None
    return module


def _resolve(site: Site) -> Optional[tuple[ModuleType, Construction]]:
    module = loaded(site.module)
    if module is None:
        return None
    wrapper = next((getattr(module, n) for n in site.wrappers if hasattr(module, n)), None)
    deepcopy = getattr(module, site.deepcopy, None)
    has_cache = site.cache is None or isinstance(getattr(module, site.cache, None), dict)
    if not isinstance(wrapper, type) or deepcopy is None or not has_cache:
        return None
    # torch 2.11+ calls type() in the shared helper _fsdp_init._apply_to_module.
    helper = getattr(module, "_apply_to_module", None)
    builder = getattr(helper, "__module__", None) or module.__name__
    return module, Construction(wrapper, site.prefix, deepcopy, builder)


def patch_site(site: Site) -> bool:
    """Install the fix at ``site``; False if the module does not have the site's names."""
    resolved = _resolve(site)
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
    """Has a module that builds FSDP2 classes finished importing? (Its package may still be
    running its ``__init__``: post-import hooks fire from inside it.)"""
    return any(loaded(site.module) is not None for site in FULLY_SHARD_SITES)


def install_fully_shard() -> str:
    """Patch fully_shard's class construction; returns the site's name or raises UnknownLayout."""
    for site in FULLY_SHARD_SITES:
        if patch_site(site):
            return site.name
    raise UnknownLayout(
        "torch's FSDP2 module has none of the class-construction names this package knows "
        f"({', '.join(s.name for s in FULLY_SHARD_SITES)})"
    )


def probe_still_broken() -> Optional[bool]:
    """Does this torch's own construction helper still build incompatible classes?

    torch 2.11+ exposes it as ``_fsdp_init._apply_to_module``; it is tried on a throwaway
    ``class (ABC, nn.Module)`` with a throwaway cache. None when there is no helper to try.
    """
    init = loaded("torch.distributed.fsdp._fully_shard._fsdp_init")
    resolved = _resolve(FULLY_SHARD_SITES[0])
    apply_to_module = getattr(init, "_apply_to_module", None)
    if apply_to_module is None or resolved is None:
        return None
    construction = resolved[1]
    import torch.nn

    class LayoutProbe(abc.ABC, torch.nn.Module):
        pass

    try:
        apply_to_module((LayoutProbe(),), {}, construction.wrapper, construction.prefix,
                        construction.deepcopy)
    except TypeError as error:
        return True if "__class__ assignment" in str(error) else None
    return False
