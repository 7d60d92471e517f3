"""The patch: the torch function that builds wrapper classes calls a stand-in for ``type``.

Each site of ``_sites`` builds ``type(f"{prefix}{name}", (Wrapper, cls), {"__deepcopy__": ...})``
in a function (the *builder*) that calls ``type`` by its global name. ``install`` gives that one
function's code object a private global name in place of ``type`` (``code.replace``: the function
object stays, so every alias of ``fully_shard`` and ``replicate`` users hold reaches the fix) and
binds a ``TypeStandIn`` under that name. The module's own ``type`` stays the builtin, so its
public names, star imports, annotations and ``eval`` are torch's alone. For the site's call shape
the stand-in calls what ``upstream/torch.diff`` has torch call there instead of ``type``:
``_wrapper_cls.make_wrapper_cls``, called as if from torch's module (``_classes.called_from``),
which builds torch's own class wherever CPython accepts it and a layout-compatible one where not.
Every other call is the builtin's (or whatever the module's ``type`` is now, if a user rebound it).
What stays around that function is the package's own: the records, the log, ``status()``.

After installing, ``check`` sends a throwaway ``class (ABC)`` instance through torch's
construction at the site; only a site that passes counts as patched, and ``undone`` tells, when
the status is asked, whether that is still so. ``probe`` does the same unpatched, to ask torch
and CPython, site by site, whether the bug is there at all.
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
from types import CodeType, FunctionType, ModuleType
from typing import Any, Callable, Optional

from fsdp_autopatch import _classes, _matrix, _sites, _wrapper_cls
from fsdp_autopatch._sites import Site

logger = logging.getLogger("fsdp_autopatch")

# Guards the package's own tables only: never held while a class is built, so users'
# __init_subclass__, metaclasses and logging handlers run with no lock of ours held, as without
# the patch. Reentrant for the logging and the self-check that run under the hooks' lock.
_lock = threading.RLock()

# The global name under which a builder's code finds the stand-in, in place of ``type``: private
# (a leading underscore keeps it out of star imports), and bound in that builder's module only.
PRIVATE_TYPE = "_fsdp_autopatch_type"


class Construction:
    """How torch builds a site's wrapper classes: ``type(prefix + name, (wrapper, cls),
    {"__deepcopy__": deepcopy})``, called from ``builder`` in ``module`` (which names the class's
    ``__module__``). ``helper``: the builder function, where it is not the entry (torch 2.11+)."""

    def __init__(self, site: Site, wrapper: type, deepcopy: Optional[Callable[..., Any]], module: ModuleType,
                 helper: Optional[Callable[..., Any]]) -> None:
        self.site = site
        self.wrapper = wrapper
        self.deepcopy = deepcopy
        self.module = module
        self.helper = helper
        # The original classes listed in the status (by identity, held weakly): each once, whether
        # torch caches its class (FSDP2) or builds one per call (composable DDP).
        self.recorded: _classes.ByIdentity[bool] = _classes.ByIdentity()
        # The builder function whose code was redirected, and its code before and after.
        self.function: Optional[FunctionType] = None
        self.patched_code: Optional[CodeType] = None

    def name(self, cls: type) -> str:
        return f"{self.site.prefix}{_classes.name_of(cls)}"

    def namespace(self) -> dict[str, Any]:
        """The namespace torch passes (the self-check's and the probe's, at inline sites)."""
        return {} if self.deepcopy is None else {"__deepcopy__": self.deepcopy}


def after_fork_in_child() -> None:
    """A thread that held a lock at fork() does not exist in the child: nothing would release it."""
    global _lock
    _lock = threading.RLock()
    _classes.records._lock = threading.Lock()


class TypeStandIn:
    """What a builder's code calls in place of ``type`` (see the module's doc).

    It answers ``isinstance``, ``issubclass`` and attribute look-ups as the module's ``type``
    does, so the rest of the builder's code cannot tell it from ``type``.
    """

    def __init__(self, module_globals: dict[str, Any]) -> None:
        self.globals = module_globals
        module_name = module_globals.get("__name__", "?")
        self.module_name = module_name
        # type() names a new class's __module__ after the calling frame's globals: torch's module,
        # for the classes of the fix as for every other call.
        self.build = _classes.called_from(module_name, builtins.type)
        self.make_wrapper_cls = _classes.called_from(module_name, _wrapper_cls.make_wrapper_cls)
        self.constructions: dict[int, Construction] = {}  # by the identity of the wrapper class
        # The functions whose code loads this stand-in: function -> its code before.
        self.originals: dict[FunctionType, CodeType] = {}

    def own_type(self) -> Any:
        """What the module's own code calls ``type`` now: the builtin, unless a user rebound it."""
        return self.globals.get("type", builtins.type)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        own = self.own_type()
        if own is not builtins.type:  # rebound after the install: the user's, as without the patch
            return own(*args, **kwargs)
        try:
            construction = self.construction_of(args, kwargs)
            if construction is None:
                return self.build(*args, **kwargs)
            # The class torch's call asks for, built by the fix torch is asked to take, called
            # here in torch's place: one class per call, as torch's own ``type``. No lock is held
            # while it is built, since it runs users' class hooks, which may wrap modules from
            # other threads; nor a frame of the package's beyond this one.
            built = self.make_wrapper_cls(*args)
            self.record(construction, args[1][1], built)
            return built
        except BaseException as error:
            # What a user's class hook (or torch) raised, with the package's frames taken out of
            # its traceback, as CPython's import system takes out its own: this frame stays.
            raise error.with_traceback(_without_own_frames(error.__traceback__))  # noqa: B904

    def construction_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Construction]:
        """The construction whose call shape ``type(*args, **kwargs)`` is, or None."""
        if len(args) != 3 or kwargs:
            return None
        name, bases, _namespace = args
        if builtins.type(bases) is not tuple or len(bases) != 2 \
                or not isinstance(bases[0], builtins.type) or not isinstance(bases[1], builtins.type):
            return None
        construction = self.constructions.get(id(bases[0]))
        if construction is None or construction.wrapper is not bases[0]:
            return None
        return construction if name == construction.name(bases[1]) else None

    @staticmethod
    def record(construction: Construction, cls: type, built: type) -> None:
        """List ``cls`` and log what became of it, once per original class."""
        with _lock:
            first = construction.recorded.get(cls) is None
            if first:
                construction.recorded.set(cls, True)
        if first:
            _classes.record(construction.site.name, construction.wrapper, cls, built)

    def __instancecheck__(self, instance: Any) -> bool:
        return isinstance(instance, self.own_type())

    def __subclasscheck__(self, subclass: type) -> bool:
        return issubclass(subclass, self.own_type())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.own_type(), name)

    def __repr__(self) -> str:
        return f"<fsdp_autopatch stand-in for type in {self.module_name}>"


_LOAD_GLOBAL = dis.opmap["LOAD_GLOBAL"]
_EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]
# From 3.11, LOAD_GLOBAL's argument is the name's index shifted left by one, its low bit saying
# whether to push NULL before the value.
_LOAD_GLOBAL_SHIFT = 1 if sys.version_info >= (3, 11) else 0


def redirected(code: CodeType, old: str = "type", new: str = PRIVATE_TYPE) -> Optional[CodeType]:
    """``code`` (and the code nested in it) with every ``LOAD_GLOBAL old`` loading ``new``; None
    when that cannot be done without moving instructions.

    Where no other instruction uses the name (``x.type`` is an attribute of the same name), the
    name itself is renamed in ``co_names``; else ``new`` is appended and each LOAD_GLOBAL's
    argument rewritten in place, within the bytes it has (its EXTENDED_ARG prefixes included).
    Instruction offsets, jumps, line and exception tables stay as they are on CPython 3.9 - 3.15.
    """
    consts = []
    for const in code.co_consts:
        if isinstance(const, CodeType):
            nested = redirected(const, old, new)
            if nested is None:
                return None
            const = nested
        consts.append(const)
    changes: dict[str, Any] = {"co_consts": tuple(consts)}
    if old in code.co_names:
        instructions = list(dis.get_instructions(code))
        loads = [i for i in instructions if i.opcode == _LOAD_GLOBAL and i.argval == old]
        shared = any(i.opcode in dis.hasname and i.opcode != _LOAD_GLOBAL and i.argval == old
                     for i in instructions)
        if not shared:
            changes["co_names"] = tuple(new if name == old else name for name in code.co_names)
        else:
            index = len(code.co_names)
            raw = bytearray(code.co_code)
            low = (1 << _LOAD_GLOBAL_SHIFT) - 1
            for load in loads:
                argument = (index << _LOAD_GLOBAL_SHIFT) | ((load.arg or 0) & low)
                start = load.offset
                while start >= 2 and raw[start - 2] == _EXTENDED_ARG:
                    start -= 2
                room = (load.offset - start) // 2 + 1
                if argument >= 1 << (8 * room):
                    return None
                for byte in range(room):
                    raw[load.offset - 2 * byte + 1] = (argument >> (8 * byte)) & 0xFF
            changes["co_code"] = bytes(raw)
            changes["co_names"] = (*code.co_names, new)
    return code.replace(**changes)


def bound_function(module_name: str, name: str) -> Any:
    """What the loaded module binds under ``name``, under its decorators (``functools.wraps``
    chains, as torch's ``contract`` makes); None where the module or the name is missing."""
    value = getattr(sys.modules.get(module_name), name, None)
    return inspect.unwrap(value) if callable(value) else value


def builder_function(construction: Construction) -> Optional[FunctionType]:
    """The function whose code calls ``type`` at this site, or None."""
    function = bound_function(construction.site.builder_module, construction.site.builder)
    return function if isinstance(function, FunctionType) else None


def code_before(function: FunctionType) -> CodeType:
    """The function's code as torch wrote it: before this package redirected it, if it did."""
    stand_in = function.__globals__.get(PRIVATE_TYPE)
    if isinstance(stand_in, TypeStandIn):
        return stand_in.originals.get(function, function.__code__)
    return function.__code__


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
    function = bound_function(module_name, name)
    if isinstance(function, FunctionType):
        return [code_before(function)]
    code = getattr(function, "__code__", None)
    return [] if code is None else [code]


def _has(module_name: str, name: str) -> bool:
    return hasattr(sys.modules.get(module_name), name)


def _origin(module_name: str, name: str) -> Optional[str]:
    """The module that defines the function the module binds under ``name``."""
    origin = getattr(bound_function(module_name, name), "__module__", None)
    return origin if isinstance(origin, str) else None


def resolve(site: Site, just_ran: Optional[object] = None) -> Optional[Construction]:
    """The site's construction in the loaded torch, or None: a module not loaded (or still being
    imported), a name missing, or bytecode that does not build classes as the site says."""
    module, builder_module = loaded(site.module, just_ran), loaded(site.builder_module, just_ran)
    if module is None or builder_module is None:
        return None
    if _sites.shape_problem(site, _has, _code_of, _origin) is not None or user_binding(site) is not None:
        return None
    wrapper = next(getattr(module, name) for name in site.wrappers if hasattr(module, name))
    # A builder in another module is torch 2.11+'s shared helper, called with the construction's
    # arguments; it is taken as the entry calls it (its own module's binding), so that the
    # self-check goes where fully_shard goes. A builder in the entry's module builds inline.
    helper = getattr(module, site.builder) if site.builder_module != site.module else None
    if not isinstance(wrapper, type):
        return None
    deepcopy = getattr(module, site.deepcopy) if site.deepcopy else None
    return Construction(site, wrapper, deepcopy, builder_module, helper)


def user_binding(site: Site) -> Optional[str]:
    """What a user bound in torch's module before the install that keeps the site from torch's
    own construction: a ``type`` of their own, or another function under the builder's name.
    None where torch's are there (or the module is not loaded)."""
    module = sys.modules.get(site.builder_module)
    if module is None:
        return None
    before = "bound before fsdp-autopatch installed"
    own = module.__dict__.get("type", builtins.type)
    if own is not builtins.type:
        return f"{site.builder_module}.type is {own!r}, not the builtin: {before}"
    function = bound_function(site.builder_module, site.builder)
    origin = str(getattr(function, "__module__", site.builder_module))
    # torch's own functions may be bound in another of its modules (a helper imported by name).
    if function is not None and origin.split(".")[0] != site.builder_module.split(".")[0]:
        return (f"{site.builder_module}.{site.builder} is {origin}.{getattr(function, '__qualname__', '?')}, "
                f"not torch's: {before}")
    return None


def resolve_api(api: str, just_ran: Optional[object] = None) -> Optional[Construction]:
    """The first site of ``api`` that the loaded torch has, among the rows of its release: a
    release older than a row's does not have it, whatever modules it holds (every row, where
    the loaded ``__version__`` is unreadable)."""
    version = getattr(sys.modules.get(_sites.top_package(api)), "__version__", None)
    release = _matrix.release_or_none(str(version) if version is not None else None)
    for site in _sites.sites_of(api, release):
        construction = resolve(site, just_ran)
        if construction is not None:
            return construction
    return None


# The constructions installed, in order, for ``undone``.
installed: list[Construction] = []


def install(construction: Construction) -> None:
    """Redirect the builder's code to the stand-in for this construction's wrapper, and drop what
    torch cached before the patch for classes CPython refuses (its failed attempts), so that the
    next call for them builds anew. Raises TypeError where the code cannot be redirected."""
    function = builder_function(construction)
    if function is None:
        raise TypeError(f"{construction.site.builder} is not a plain function")
    with _lock:
        stand_in = function.__globals__.get(PRIVATE_TYPE)
        if not isinstance(stand_in, TypeStandIn):
            stand_in = TypeStandIn(function.__globals__)
        if function not in stand_in.originals:
            patched = redirected(function.__code__)
            if patched is None:
                raise TypeError(f"{construction.site.builder}'s bytecode cannot be redirected")
            function.__globals__[PRIVATE_TYPE] = stand_in
            stand_in.originals[function] = function.__code__
            function.__code__ = patched
        stand_in.constructions[id(construction.wrapper)] = construction
        construction.function, construction.patched_code = function, function.__code__
        installed.append(construction)
    cache = getattr(sys.modules.get(construction.site.module), construction.site.cache or "", None)
    if isinstance(cache, dict):
        for cls, built in list(cache.items()):
            if isinstance(cls, type) and isinstance(built, type) and not _classes.accepts(cls, built):
                cache.pop(cls, None)
                logger.debug("dropped %s, which torch cached at %s before the patch and CPython "
                             "refuses for %s", _classes.name_of(built), construction.site.name,
                             _classes.qualname_of(cls))


def uninstall(construction: Construction) -> None:
    """Take this construction's wrapper out of the stand-in; torch's code, and a module without
    the stand-in, are back once it serves no other wrapper."""
    function = construction.function
    with _lock:
        if construction in installed:
            installed.remove(construction)
        if function is None:
            return
        stand_in = function.__globals__.get(PRIVATE_TYPE)
        if not isinstance(stand_in, TypeStandIn):
            return
        stand_in.constructions.pop(id(construction.wrapper), None)
        if not stand_in.constructions:
            for redirected_function, code in stand_in.originals.items():
                redirected_function.__code__ = code
            stand_in.originals.clear()
            del function.__globals__[PRIVATE_TYPE]


def undone(construction: Construction) -> Optional[str]:
    """Why the installed fix no longer reaches this site's modules, in a few words; None while it
    does. Asked whenever the status is: a reload of torch's module, a builder, entry or ``type``
    rebound, or code replaced since the install all undo it."""
    site, function = construction.site, construction.function
    if function is None:
        return "it was never installed"
    stand_in = function.__globals__.get(PRIVATE_TYPE)
    current = bound_function(site.builder_module, site.builder)
    if current is not function:
        reloaded = isinstance(current, FunctionType) and \
            current.__code__.co_filename == function.__code__.co_filename
        if reloaded:
            return f"{site.builder_module} was reloaded, which made a new {site.builder}"
        return f"{site.builder_module}.{site.builder} was rebound to {current!r}"
    if function.__code__ is not construction.patched_code:
        return f"the code of {site.builder_module}.{site.builder} was replaced"
    if not isinstance(stand_in, TypeStandIn) or stand_in.constructions.get(id(construction.wrapper)) \
            is not construction:
        return "the stand-in for type was removed"
    own = stand_in.own_type()
    if own is not builtins.type:
        return f"{site.builder_module}.type was rebound to {own!r}"
    if site.builder_module != site.module:  # the entry calls the builder by its own module's name
        helper = bound_function(site.module, site.builder)
        if helper is not function:
            return f"{site.module}.{site.builder} was rebound to {helper!r}"
    entry_module = sys.modules.get(site.module)
    wrapper = next((getattr(entry_module, name) for name in site.wrappers if hasattr(entry_module, name)),
                   None)
    if wrapper is not construction.wrapper:
        return f"{site.module} was reloaded, which made a new {construction.wrapper.__name__}"
    return None


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
    ``class (ABC)`` instance goes through torch's construction at the site, patched,
    and CPython accepts the class it gets. Never raises."""
    site = construction.site.name
    try:
        cls = _throwaway_abc_module("SelfCheck")
        instance = object.__new__(cls)
        try:
            _apply_construction(construction, instance, patched=True)
        except TypeError as error:
            refused = cls.__dict__.get(_classes.CHOSEN) == _classes.REFUSED
            why = " (the fix has no compatible class for it)" if refused else ""
            return f"a throwaway ABC module still fails in torch's construction at {site}: {error}{why}"
    except Exception as error:
        return f"the self-check at {site} failed: {type(error).__name__}: {error}"
    if not isinstance(instance, construction.wrapper):
        return f"a throwaway ABC module did not become a {construction.wrapper.__name__} at {site}"
    return None


# What torch's own construction at a site does with an ABC module (``probe``).
TORCH_REFUSED, TORCH_ACCEPTED, TORCH_FIXED = "refused", "accepted", "torch builds a compatible class"


def probe(construction: Construction) -> Optional[str]:
    """What torch's own construction at ``construction``'s site, unpatched, does with an ABC
    module: TORCH_REFUSED (CPython refuses the class it builds: the bug), TORCH_ACCEPTED (CPython
    accepts torch's ``(Wrapper, cls)``), TORCH_FIXED (torch built another class, which CPython
    accepts: torch fixed it), or None (it cannot tell). Never raises.

    An uninitialised instance of a throwaway ``class (ABC)`` goes through torch's helper where
    the site has one, else through the construction its bytecode shows inline."""
    try:
        cls = _throwaway_abc_module("LayoutProbe")
        instance = object.__new__(cls)
        try:
            _apply_construction(construction, instance, patched=False)
        except TypeError as error:
            if "__class__" in str(error) and not isinstance(instance, construction.wrapper):
                return TORCH_REFUSED
            logger.debug("the layout probe failed otherwise (%s)", error)
            return None
        if not isinstance(instance, construction.wrapper):  # what torch's modules become
            return None
        return TORCH_ACCEPTED if type(instance).__bases__ == (construction.wrapper, cls) else TORCH_FIXED
    except Exception as error:
        logger.debug("the layout probe could not run (%s: %s)", type(error).__name__, error)
        return None


_PACKAGE_DIRECTORY = os.path.dirname(__file__)


def _is_own(filename: str) -> bool:
    """Is the code of ``filename`` the package's: a file in its directory (a neighbour whose name
    merely starts the same, such as ``fsdp_autopatch_userhooks/``, is not)."""
    return os.path.dirname(filename) == _PACKAGE_DIRECTORY


def _without_own_frames(traceback: Any) -> Any:
    """``traceback`` from its first frame that is not this package's."""
    while traceback is not None and _is_own(traceback.tb_frame.f_code.co_filename):
        traceback = traceback.tb_next
    return traceback


def _throwaway_abc_module(name: str) -> type:
    """A new ``class name(ABC)``, marked so that it is never listed as the user's. It has the
    layout of ``class (ABC, nn.Module)`` (a ``__dict__`` added on top of ``ABC``), which is what
    CPython judges, without being an ``nn.Module``: the class registries and tools that walk
    ``nn.Module.__subclasses__()`` never meet it, and it is freed with what torch built from it."""
    return type(name, (abc.ABC,), {_classes.THROWAWAY: True, "__module__": __name__})


def _apply_construction(construction: Construction, instance: object, patched: bool) -> None:
    """What torch does to a module at a site, with a throwaway class cache, as the patch has it
    or (not ``patched``) as torch wrote it: torch's helper where the site has one (torch 2.11+),
    else the construction the other sites run inline in their entry function (whose bytecode
    ``_sites.shape_problem`` checked), with torch's own fix where it has one. Raises TypeError
    where CPython refuses the swap, as torch does."""
    if construction.helper is None:
        module = construction.module
        if construction.site.torch_fix is not None:  # torch's own fix, called in place of type
            build = bound_function(*construction.site.torch_fix)
        elif patched:
            build = module.__dict__.get(PRIVATE_TYPE, builtins.type)
        else:
            build = _classes.called_from(module.__name__, builtins.type)
        cls = type(instance)
        bases = (construction.wrapper, cls)
        instance.__class__ = build(construction.name(cls), bases, construction.namespace())
        return
    call = _bind_helper(construction, instance, patched)
    if call is None:
        raise TypeError(f"torch's {construction.site.builder} takes arguments unknown to fsdp-autopatch")
    call()


def _bind_helper(construction: Construction, instance: object, patched: bool) -> Optional[Callable[[], Any]]:
    """torch's helper, its code as patched or as torch wrote it, called for ``instance`` with a
    throwaway cache, its arguments matched to its signature by the names the site's row gives
    them; None when it takes a required parameter the row does not name."""
    helper = construction.helper
    assert helper is not None
    site = construction.site
    by_role = {"modules": (instance,), "cache": {}, "wrapper": construction.wrapper, "prefix": site.prefix,
               "deepcopy": construction.deepcopy}
    values = {name: by_role[role] for name, role in zip(site.parameters, _sites.HELPER_ROLES)}
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
    function = inspect.unwrap(helper)
    if isinstance(function, FunctionType):
        # torch's code run under a name of its own: profilers (cProfile keys functions by their
        # code's file, line and name) then list torch's builder with its users' calls only.
        code = function.__code__ if patched else code_before(function)
        label = f"{code.co_name} (fsdp-autopatch {'self-check' if patched else 'probe'})"
        code = code.replace(co_name=label, **({"co_qualname": label} if sys.version_info >= (3, 11) else {}))
        helper = FunctionType(code, function.__globals__, label, function.__defaults__, function.__closure__)
        helper.__kwdefaults__ = function.__kwdefaults__
    return lambda: helper(*args, **kwargs)
