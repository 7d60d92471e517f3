"""Where torch swaps a module's class for a wrapper class: the one table of sites.

Every torch call that wraps a module in place does it the same way::

    new_cls = type(f"{prefix}{cls.__name__}", (Wrapper, cls), {"__deepcopy__": deepcopy})
    module.__class__ = new_cls

from a module-level function (the *builder*) that calls ``type`` by its global name. The patch
redirects that one function's ``type`` (``_patch``), so nothing of torch's public functions, and
none of torch's class caches, is touched. Each ``Site`` names the public function users call
(``entry``) and the package they import it from, where the wrapper class and the deep-copy stub
live, and the builder with its parameters. A torch release that moves a builder is one row here
per API that calls it (and its evidence row in ``_matrix``); nothing else in the package names a
site. A row applies to the releases from its ``since`` on, and ``key`` names it. How the patch
checks a site (by bytecode, at run time and in ``doctor`` alike) is ``shape_problem`` below.

The module names come from the start-up module, which watches them (and must import nothing more).
"""

from fsdp_autopatch import (
    DDP_MODULE,
    FSDP2_PACKAGES,
    FULLY_SHARD_MODULES,
    MEGATRON_FSDP_MODULE,
    REPLICATE_WITH_FSDP_MODULE,
    TORCH_MODULES,
    TRANSFORMERS,
    WATCHED_MODULES,
)

__all__ = ["APIS", "DDP_MODULE", "FSDP2_PACKAGES", "SITES", "TORCH_MODULES", "TRANSFORMERS",
           "WATCHED_MODULES", "Site"]


class Site:
    """One way a torch release builds wrapper classes for one public function."""

    __slots__ = ("api", "builder", "builder_module", "cache", "deepcopy", "entry", "module", "package",
                 "parameters", "prefix", "since", "torch_fix", "wrappers")

    def __init__(self, api: str, since: "tuple[int, ...]", module: str, entry: str,
                 wrappers: "tuple[str, ...]", prefix: str, deepcopy: "str | None", cache: "str | None" = None,
                 builder: "tuple[str, str, tuple[str, ...]] | None" = None, package: "str | None" = None,
                 torch_fix: "tuple[str, str] | None" = None) -> None:
        self.api = api  # what users call it: one of APIS
        # The first release of its distribution (torch, for most) that builds classes this way:
        # a torch from then on has imported the API once ``package`` is imported.
        self.since = since
        self.module = module  # the module of the entry function, the wrapper and the deep-copy stub
        self.entry = entry  # the public function whose call wraps a module
        self.wrappers = wrappers  # the wrapper class's global name in ``module``: the first one present
        self.prefix = prefix
        # The deep-copy stub torch puts in the class's namespace; None: an empty namespace.
        self.deepcopy = deepcopy
        # torch's cls -> wrapper-class cache in ``module``, if this release keeps one: the patch only
        # drops from it the classes torch cached before the patch and CPython refuses.
        self.cache = cache
        # The function that calls ``type``, if not ``entry`` itself, and its parameters: in another
        # module, torch 2.11+'s shared helper, which takes the construction as arguments, named in
        # the order of HELPER_ROLES; in ``module``, a function of the entry's that builds the class
        # inline (FSDP2 replicate's replicate_impl, 2.9 - 2.10), with no parameters named.
        self.builder_module, self.builder, self.parameters = builder or (module, entry, ())
        # Where users import ``entry`` from (``module`` itself unless another package exports it).
        self.package = package or module
        # Where torch builds a class CPython accepts itself: the (module, function) the builder
        # calls in place of ``type`` (the probe asks it at run time; doctor, which reads files,
        # finds the builder calling it).
        self.torch_fix = torch_fix

    @property
    def fixed(self) -> bool:
        return self.torch_fix is not None

    @property
    def modules(self) -> "tuple[str, ...]":
        """The modules whose code the site reads: the entry's, the builder's, torch's fix's."""
        fix_module = (self.torch_fix[0],) if self.torch_fix else ()
        return (self.module, self.builder_module, *fix_module)

    @property
    def name(self) -> str:
        """How the status, the log and doctor name the site: the function users call."""
        return f"{self.module}.{self.entry}"

    @property
    def key(self) -> str:
        """The row itself, as doctor and the tests name it: its API, the first release that has it,
        and whether torch's own fix builds its classes ("FSDP2 fully_shard since torch 2.11"). Every
        row of an API shares ``name``; ``key`` is one row's (unique in SITES, tests/test_sites.py)."""
        fix = " with torch's fix" if self.fixed else ""
        return f"{self.api} since {distribution_of(self.api)} {'.'.join(map(str, self.since))}{fix}"

    def __repr__(self) -> str:
        constructor = ".".join(self.torch_fix) if self.torch_fix else "type"
        return f"<site {self.key}: {constructor} called in {self.builder_module}.{self.builder}>"


FULLY_SHARD = "FSDP2 fully_shard"
FSDP2_REPLICATE = "FSDP2 replicate"
DDP_REPLICATE = "composable DDP replicate"
MEGATRON_FULLY_SHARD = "Megatron-FSDP fully_shard"
APIS = (FULLY_SHARD, FSDP2_REPLICATE, DDP_REPLICATE, MEGATRON_FULLY_SHARD)
# The distribution whose files hold an API's sites, where it is not torch.
API_DISTRIBUTIONS = {MEGATRON_FULLY_SHARD: "megatron-fsdp"}


def distribution_of(api: str) -> str:
    return API_DISTRIBUTIONS.get(api, "torch")


def top_package(api: str) -> str:
    """The top-level package of ``api``'s modules (torch, megatron_fsdp), whose version says which
    of its rows a loaded release may have."""
    return sites_of(api)[0].module.split(".")[0]


def sites_of(api: str, release: "tuple[int, ...] | None" = None) -> "list[Site]":
    """The sites of ``api``, newest first; with ``release`` (of its distribution), only those
    that release may have."""
    return [site for site in SITES if site.api == api and (release is None or site.since <= release)]


_FULLY_SHARD_2_6, _FULLY_SHARD_2_4 = FULLY_SHARD_MODULES
_FSDP_2_6, _FSDP_2_4 = FSDP2_PACKAGES
# What a helper that builds the wrapper classes is given, in the order Site.parameters names
# them: the modules to wrap, the class cache, the wrapper class, the prefix, the deep-copy stub.
HELPER_ROLES = ("modules", "cache", "wrapper", "prefix", "deepcopy")
# torch 2.11+ build both FSDP2 wrappers in one shared helper.
_HELPER_PARAMETERS = ("modules", "cls_to_wrapper_cls", "wrapper_module_cls", "wrapper_cls_prefix",
                      "unimplemented_deepcopy")
_APPLY_TO_MODULE = ("torch.distributed.fsdp._fully_shard._fsdp_init", "_apply_to_module", _HELPER_PARAMETERS)
# The fix torch needs (upstream/torch.diff; in no torch release up to 2.15.0): each builder calls this
# function in place of ``type``; it is this package's _wrapper_cls.make_wrapper_cls. A torch with
# it is found by its builders' bytecode (its rows' "since" is the oldest release the patch applies
# to); the probe, asking its builders, then finds no bug at any site, and the package stands aside.
_TORCH_FIX = ("torch.distributed._wrapper_cls", "make_wrapper_cls")

# Per API, newest first; the first one whose names and bytecode the loaded torch has is used
# (later releases keep re-exporting shims at the older paths).
SITES = (
    Site(FULLY_SHARD, (2, 13), _FULLY_SHARD_2_6, "fully_shard", ("FSDPModule",), "FSDP",
         "_unimplemented_deepcopy", "cls_to_fsdp_cls", _APPLY_TO_MODULE, _FSDP_2_6, torch_fix=_TORCH_FIX),
    Site(FULLY_SHARD, (2, 11), _FULLY_SHARD_2_6, "fully_shard", ("FSDPModule",), "FSDP",
         "_unimplemented_deepcopy", "cls_to_fsdp_cls", _APPLY_TO_MODULE, _FSDP_2_6),
    Site(FULLY_SHARD, (2, 6), _FULLY_SHARD_2_6, "fully_shard", ("FSDPModule",), "FSDP",
         "_unimplemented_deepcopy", "cls_to_fsdp_cls", package=_FSDP_2_6),
    # torch 2.4 - 2.5: FSDP2 lives in torch.distributed._composable.fsdp (torch.distributed.fsdp
    # is FSDP1 there).
    Site(FULLY_SHARD, (2, 4), _FULLY_SHARD_2_4, "fully_shard", ("FSDPModule",), "FSDP",
         "unimplemented_deepcopy", "cls_to_fsdp_cls", package=_FSDP_2_4),
    # FSDP2's replicate() wraps modules in ReplicateModule(FSDPModule) (2.10+) or in FSDPModule
    # itself (2.9), built in the shared helper (2.11+) or inline in replicate_impl.
    Site(FSDP2_REPLICATE, (2, 13), REPLICATE_WITH_FSDP_MODULE, "replicate", ("ReplicateModule", "FSDPModule"),
         "Replicate", "_unimplemented_deepcopy", "cls_to_replicate_cls", _APPLY_TO_MODULE,
         torch_fix=_TORCH_FIX),
    Site(FSDP2_REPLICATE, (2, 11), REPLICATE_WITH_FSDP_MODULE, "replicate", ("ReplicateModule", "FSDPModule"),
         "Replicate", "_unimplemented_deepcopy", "cls_to_replicate_cls", _APPLY_TO_MODULE),
    Site(FSDP2_REPLICATE, (2, 9), REPLICATE_WITH_FSDP_MODULE, "replicate", ("ReplicateModule", "FSDPModule"),
         "Replicate", "_unimplemented_deepcopy", "cls_to_replicate_cls",
         (REPLICATE_WITH_FSDP_MODULE, "replicate_impl", ())),
    # Composable DDP builds a new DDP<Name> on every call: no cache.
    Site(DDP_REPLICATE, (2, 13), DDP_MODULE, "replicate", ("DDP",), "DDP", "unimplemented_deepcopy",
         torch_fix=_TORCH_FIX),
    Site(DDP_REPLICATE, (2, 4), DDP_MODULE, "replicate", ("DDP",), "DDP", "unimplemented_deepcopy"),
    # megatron-fsdp 0.6.0 - 0.6.1: a new ExperimentalFsdp<Name>(FsdpModule, <Name>) per call, with
    # an empty namespace, built in _attach_mixin beside fully_shard (0.5.0 has no such module).
    Site(MEGATRON_FULLY_SHARD, (0, 6), MEGATRON_FSDP_MODULE, "fully_shard", ("FsdpModule",),
         "ExperimentalFsdp", None, builder=(MEGATRON_FSDP_MODULE, "_attach_mixin", ())),
)


def unknown_layout(api: str, version: "str | None") -> str:
    """"torch X's FSDP2 layout is unknown to fsdp-autopatch V": the start of what the status, the
    log and doctor say when the loaded torch (``version``; megatron-fsdp for its API) has none of
    ``api``'s sites. fully_shard's layout is what the docs call FSDP2's."""
    import fsdp_autopatch

    distribution = distribution_of(api)
    owner = f"{distribution} {version}" if version else f"this {distribution}"
    what = "FSDP2" if api == FULLY_SHARD else api
    return f"{owner}'s {what} layout is unknown to fsdp-autopatch {fsdp_autopatch.__version__}"


def shape_problem(site: Site, has: "object", code_of: "object", origin: "object") -> "str | None":
    """What the loaded (or compiled) torch lacks for ``site``, in a few words; None when it has it.

    ``has(module, name)``: does the module bind ``name`` at its top level; ``code_of(module,
    name)``: the code objects of the functions named so; ``origin(module, name)``: the module
    that what it binds so comes from (None: cannot tell). One implementation for the patch (live
    modules) and for doctor (torch's source compiled, not imported): the builder must load the
    global ``type`` by name, and an entry that is not its own builder must load the builder so,
    bound from the builder's module.
    """
    module = site.module
    wrapper = next((name for name in site.wrappers if has(module, name)), None)  # type: ignore[operator]
    if wrapper is None:
        return f"no {' or '.join(site.wrappers)} class"
    for name in filter(None, (site.deepcopy, site.entry)):
        if not has(module, name):  # type: ignore[operator]
            return f"no {name}"
    if (site.builder_module, site.builder) != (module, site.entry):
        # The entry calls the helper by the name its own module binds (torch imports it by name).
        if not has(module, site.builder):  # type: ignore[operator]
            return f"no {site.builder}"
        if not any(loads_global(code, site.builder) for code in code_of(module, site.entry)):  # type: ignore[operator]
            return f"{site.entry} does not call {site.builder}"
        # A release that moves a helper may keep the old one, or one of the same name elsewhere:
        # the row of the place the entry does not call must not match, nor patch what is never run.
        # A function from outside the builder's package (a user's replacement) tells no release.
        source = origin(module, site.builder)  # type: ignore[operator]
        package = site.builder_module.split(".")[0]
        if source is not None and source != site.builder_module and source.split(".")[0] == package:
            return f"{site.builder} comes from {source}"
    # What the builder calls to build the class: the global type, or torch's own fix in its place.
    constructor = "type"
    if site.torch_fix is not None:
        fix_module, constructor = site.torch_fix
        if not has(fix_module, constructor):  # type: ignore[operator]
            return f"no {constructor}"
    if not any(loads_global(code, constructor) for code in code_of(site.builder_module, site.builder)):  # type: ignore[operator]
        return f"{site.builder} does not call the global {constructor}"
    return None


def loads_global(code: "object", name: str) -> bool:
    """Does ``code`` (or a function or class nested in it) load the global ``name``, so that
    rebinding the module's global reaches it?"""
    import dis

    for instruction in dis.get_instructions(code):  # type: ignore[arg-type]
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME") and instruction.argval == name:
            return True
    return any(loads_global(const, name) for const in getattr(code, "co_consts", ())
               if hasattr(const, "co_code"))
