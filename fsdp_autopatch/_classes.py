"""The classes the fix builds, as the package keeps them: what became of each, and how it says so.

The fix is ``_wrapper_cls.make_wrapper_cls``, the function ``upstream/torch.diff`` adds to torch
as ``torch/distributed/_wrapper_cls.py``, character for character. Around the classes it builds,
the package keeps:

- ``record``: what became of each original class at a site (torch's class, a compatible one, or
  none), listed in ``status().classes`` and said once in the log;
- ``accepts``: CPython's verdict on torch's class for a module's class, asked as the fix asks it:
  for the status (a class torch will fail to set) and for the classes torch cached before the
  patch;
- ``called_from``: the fix called as if from torch's builder module, so the classes it builds
  carry the module name torch's own ``type(...)`` call gives them there;
- ``ByIdentity``: tables keyed by the identity of classes, held weakly;
- ``mirror_base``: where a class built by the fix sits, as the status and the log name it.

Pure Python; no torch here.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

from fsdp_autopatch import _wrapper_cls

# What became of an original class at a construction site.
TORCH = "torch"  # torch's own class, which CPython accepts
COMPATIBLE = "compatible"  # CPython refuses torch's class; the fix built one that it accepts
REFUSED = "refused"  # CPython refuses torch's class and the fix has none: torch raises its error

Value = TypeVar("Value")

logger = logging.getLogger("fsdp_autopatch")

# A class's names and namespace as CPython keeps them, read as the fix reads a class's fields:
# no metaclass's __getattribute__ or property of a user's runs for the status or the log.
name_of, bases_of = _wrapper_cls._NAME, _wrapper_cls._BASES
dict_of, mro_of = _wrapper_cls._DICT, _wrapper_cls._MRO
qualname_of = type.__dict__["__qualname__"].__get__
module_of = type.__dict__["__module__"].__get__

# Set on the throwaway classes the package sends through torch's construction to check it: they
# are neither logged nor listed as the user's classes; what became of them is kept on them.
THROWAWAY = "__fsdp_autopatch_throwaway__"
CHOSEN = "__fsdp_autopatch_chosen__"


@dataclass(frozen=True)
class ClassRecord:
    """What became of one original class at one site, for ``status().classes``."""

    name: str  # the original class's __qualname__
    module: str
    site: str
    wrapper: str  # the name of the class the site used
    outcome: str  # TORCH, COMPATIBLE or REFUSED
    parent: Optional[str] = None  # COMPATIBLE: the base its mirror of the wrapper sits on, e.g. "abc.ABC"
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
records = ClassRecords(CLASS_RECORD_LIMIT)


def outcome(wrapper: type, cls: type, built: type) -> tuple[str, Optional[type], Optional[str]]:
    """What the fix gave ``cls`` for ``wrapper``: torch's class (which CPython accepts, or refuses:
    then torch raises its own error, and the reason says why the fix has none), or the compatible
    one and the base its mirror of the wrapper sits on."""
    if bases_of(built)[0] is not wrapper:
        return COMPATIBLE, mirror_base(built, wrapper), None
    if accepts(cls, built):
        return TORCH, None, None
    if not _wrapper_cls._layout_root(cls).__dictoffset__:
        return REFUSED, None, "its instances have no __dict__, which every wrapper class adds"
    return REFUSED, None, f"no mirror of {wrapper.__name__} fits its class (docs/how-it-works.md#limits)"


def record(site: str, wrapper: type, cls: type, built: type) -> None:
    """List the class in the status and say once in the log what became of it at ``site``."""
    became, parent, reason = outcome(wrapper, cls, built)
    if dict_of(cls).get(THROWAWAY):
        type.__setattr__(cls, CHOSEN, became)
        return
    base = parent_name(parent) if parent is not None else None
    kept = ClassRecord(qualname_of(cls), module_of(cls), site, name_of(built), became, base, reason)
    records.add(kept)
    original = f"{kept.module}.{kept.name}"
    if became == COMPATIBLE:
        logger.info("built %s on %s for %s at %s: CPython refuses torch's own class for it",
                    kept.wrapper, base, original, site)
    elif became == REFUSED:
        logger.info("cannot build a layout-compatible %s for %s at %s (%s): torch will raise its own "
                    "error for it", kept.wrapper, original, site, reason)
    else:
        logger.debug("left %s to torch at %s: CPython accepts torch's own %s", original, site, kept.wrapper)


class ByIdentity(Generic[Value]):
    """A table keyed by the identity of its keys, held weakly: it never calls a key's ``__eq__``
    or ``__hash__`` (a user's metaclass may define them, by name or not at all), and an entry goes
    with its key. CPython calls a weak reference's callback before the key's memory, and so its
    id, can be reused."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Value]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Any) -> Optional[Value]:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None

    def set(self, key: Any, value: Value) -> None:
        entries, ident = self._entries, id(key)

        def forget(reference: weakref.ref[Any]) -> None:
            if entries.get(ident, (None,))[0] is reference:
                del entries[ident]

        entries[ident] = (weakref.ref(key, forget), value)


def in_module(function: types.FunctionType, module_name: str) -> types.FunctionType:
    """``function`` as if ``module_name`` defined it: its code, with its own module's globals
    under that module's name."""
    namespace = {**function.__globals__, "__name__": module_name}
    return types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)


def _call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


def called_from(module_name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as code in ``module_name`` calls it. ``type(name, bases, ns)`` names a new
    class's ``__module__`` after the globals of the code that calls it (or ``abc`` where
    ABCMeta's own ``__new__`` is that code), and ``make_wrapper_cls`` after its caller's, as torch's
    own ``type(...)`` call there names them."""
    return functools.partial(in_module(_call, module_name), function)  # type: ignore[arg-type]


def accepts(cls: type, new: type) -> bool:
    """Does CPython accept ``new``, a class torch built for ``cls`` (``(wrapper, cls)``), for
    instances of ``cls``? Asked as the fix asks it: of an instance of the class where the layout
    check stops on ``new``'s chain (torch's wrapper class), never of ``cls``, so that no code of
    the user's classes runs (a ``__del__`` would, on an instance of theirs)."""
    old_root, new_root = _wrapper_cls._layout_root(cls), _wrapper_cls._layout_root(new)
    return old_root is new_root or _wrapper_cls._can_switch(new_root, old_root)


def mirror_base(built: type, wrapper: type) -> type:
    """The base that the mirror of ``wrapper`` sits on in a class the fix built: ``abc.ABC``,
    ``typing.Generic``. The mirrors copy the wrapper's chain, one class each, on top of it."""
    mirror = bases_of(built)[0]
    for _ in mro_of(wrapper)[1:-1]:
        mirror = bases_of(mirror)[0]
    return bases_of(mirror)[0]  # type: ignore[no-any-return]


def parent_name(parent: type) -> str:
    """``abc.ABC``, ``typing.Generic``: how a mirror's base is named in the status and the log."""
    return f"{module_of(parent)}.{qualname_of(parent)}"
