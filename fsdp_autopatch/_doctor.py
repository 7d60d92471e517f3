"""``fsdp-autopatch doctor``: does this environment have the bug, and is the installed patch set up to fix it?

It answers from installed metadata, the version matrix, this interpreter's site configuration
and torch's source files, read with ``ast``; it never imports torch or transformers, so it takes
well under a second. Reading files cannot prove the fix: in training processes the patch asks
torch and CPython directly, and ``fsdp-autopatch verify`` shows their answer.

Its verdict is one of three: OK (nothing wrong in what it checked), PROBLEM (the bug is present
and the patch will not be applied) and CANNOT TELL (files cannot answer: a torch newer than the
matrix, an FSDP2 layout it does not recognise, a source tree instead of an installation).
``--strict`` turns them into exit codes 0, 1 and 2.
"""

from __future__ import annotations

import argparse
import dis
import json
import os
import platform
import re
import site
import sys
import types
from dataclasses import asdict, dataclass, field
from importlib import machinery, metadata, util
from pathlib import Path
from typing import Any, Optional, Sequence
from urllib.parse import unquote, urlparse

import fsdp_autopatch
from fsdp_autopatch import _config, _matrix, _sites
from fsdp_autopatch._console import (
    DISTRIBUTION,
    EXIT_BROKEN,
    EXIT_CANNOT_TELL,
    EXIT_OK,
    INSTALL_COMMAND,
    PACKAGES,
    PROG,
    REINSTALL_COMMAND,
    Console,
    installed_version,
)

PTH_NAME = "fsdp_autopatch.pth"
START_NAME = "fsdp_autopatch.start"

# The verdict's first word, and what --strict exits with for it.
OK, PROBLEM, CANNOT_TELL = "OK", "PROBLEM", "CANNOT TELL"
STRICT_EXIT = {OK: EXIT_OK, PROBLEM: EXIT_BROKEN, CANNOT_TELL: EXIT_CANNOT_TELL}


def same_path(a: Path, b: Path) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


# ---------------------------------------------------------------------------------------------
# which fsdp_autopatch this is: an installation, or a source tree


INSTALLED, EDITABLE, SOURCE_TREE, UNOWNED = "installed", "editable", "source tree", "not installed"


@dataclass(frozen=True)
class Installation:
    kind: str
    detail: str
    source_tree: Optional[Path] = None  # the checkout, when doctor runs from one


def is_source_tree(directory: Path) -> bool:
    """A checkout (or unpacked sdist) of this project: its pyproject.toml names the distribution."""
    try:
        text = (directory / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    named = re.search(r'^name\s*=\s*"fsdp-autopatch"\s*$', text, re.MULTILINE) is not None
    return named and (directory / "fsdp_autopatch" / "__init__.py").is_file()


def editable_directory(distribution: metadata.Distribution) -> Optional[Path]:
    """The directory an editable install points at (PEP 610's direct_url.json), or None."""
    try:
        document = json.loads(distribution.read_text("direct_url.json") or "null")
    except ValueError:
        return None
    if not isinstance(document, dict) or not (document.get("dir_info") or {}).get("editable"):
        return None
    url = urlparse(str(document.get("url", "")))
    return Path(unquote(url.path)) if url.scheme == "file" else None


def check_installation(package: Optional[Path] = None) -> Installation:
    """Is the fsdp_autopatch this process imported an installed one? A checkout's sources are
    imported when doctor runs from the checkout's root (``python -m`` puts the working directory
    first on ``sys.path``), and they say nothing about what training processes of this Python
    load at start-up."""
    package = Path(fsdp_autopatch.__file__).resolve().parent if package is None else package
    root = package.parent
    checkout = root if is_source_tree(root) else None
    try:
        distribution: Optional[metadata.Distribution] = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        distribution = None
    installed_at: Optional[Path] = None
    if distribution is not None:
        installed = Path(str(distribution.locate_file("fsdp_autopatch/__init__.py")))
        editable = editable_directory(distribution)
        if installed.is_file():
            if same_path(installed.parent, package):
                return Installation(INSTALLED, f"installed: {package}")
            installed_at = installed.parent
        elif editable is not None:
            if same_path(editable, root):
                return Installation(EDITABLE, f"an editable install of {root}")
            installed_at = editable / "fsdp_autopatch"
    if checkout is not None:
        if installed_at is not None:
            return Installation(SOURCE_TREE, (
                f"doctor is looking at the source tree {checkout}, not at the installed "
                f"fsdp-autopatch ({installed_at}), because it runs from that directory; run it "
                "from another directory"), checkout)
        return Installation(SOURCE_TREE, (
            f"doctor is looking at the source tree {checkout}, not at an installation: "
            f"fsdp-autopatch is not installed for {sys.executable}, so no start-up file patches "
            f"its processes; install it: pip install . (in {checkout}), then run doctor from "
            "another directory"), checkout)
    if installed_at is not None:
        return Installation(UNOWNED, f"{package} is not the installed fsdp-autopatch ({installed_at})")
    return Installation(UNOWNED, f"{package} belongs to no installed distribution (a PYTHONPATH copy?)")


# ---------------------------------------------------------------------------------------------
# the start-up file


@dataclass
class StartupCheck:
    """Which start-up file this interpreter would use, and whether its site processing reads it."""

    pth: Optional[Path]
    start: Optional[Path]
    used: Optional[Path]
    read: bool
    detail: str


def site_directories() -> list[Path]:
    directories = [Path(path) for path in site.getsitepackages()]
    user = site.getusersitepackages()
    if user:
        directories.append(Path(user))
    return directories


def find_startup_file(name: str, skip: Optional[Path] = None) -> Optional[Path]:
    """The installed file, looked for beside the distribution first, then in every site directory
    and ``sys.path`` entry; ``skip``: a source tree, whose copy is no installed file."""
    candidates: list[Path] = []
    try:
        candidates.append(Path(str(metadata.distribution(DISTRIBUTION).locate_file(""))))
    except metadata.PackageNotFoundError:
        pass
    candidates.extend(site_directories())
    candidates.extend(Path(entry) for entry in sys.path if entry)
    for directory in candidates:
        if skip is not None and same_path(directory, skip):
            continue
        if (directory / name).is_file():
            return directory / name
    return None


def site_reads(directory: Path) -> tuple[bool, str]:
    """Whether this interpreter's start-up (site.py) processes start-up files in ``directory``."""
    if sys.flags.no_site:
        return False, ("this interpreter runs with -S, which skips every .pth file; call "
                       "fsdp_autopatch.apply() in the training script")
    if any(same_path(directory, Path(path)) for path in site.getsitepackages()):
        on_path = any(same_path(directory, Path(entry)) for entry in sys.path if entry)
        if on_path:
            return True, f"{directory} is a site-packages directory of this interpreter"
        return False, (f"{directory} is a site-packages directory but is not on sys.path here; "
                       "call fsdp_autopatch.apply() in the training script")
    user = site.getusersitepackages()
    if user and same_path(directory, Path(user)):
        if site.ENABLE_USER_SITE:
            return True, f"{directory} is this interpreter's user site directory, which is enabled"
        return False, (f"{directory} is the user site directory, which this interpreter skips "
                       "(python -s, PYTHONNOUSERSITE or a virtual environment); install "
                       "fsdp-autopatch into the environment itself")
    return False, (f"{directory} is not a site directory of this interpreter (a PYTHONPATH or "
                   "pip install --target directory?); install fsdp-autopatch with pip into the "
                   "environment, or call fsdp_autopatch.apply() in the training script")


def check_startup(skip: Optional[Path] = None) -> StartupCheck:
    pth, start = find_startup_file(PTH_NAME, skip), find_startup_file(START_NAME, skip)
    # PEP 829: from Python 3.15 a matching .start file replaces the .pth import line, and from
    # 3.18 .pth import lines are not run at all.
    uses_start = sys.version_info >= (3, 15) and start is not None
    used = start if uses_start else pth
    if used is None:
        return StartupCheck(pth, start, None, False,
                            f"{PTH_NAME} is not installed; install it: {INSTALL_COMMAND}"
                            if skip is not None else
                            f"{PTH_NAME} is not installed; reinstall: {REINSTALL_COMMAND}")
    if not uses_start and sys.version_info >= (3, 18):
        return StartupCheck(pth, start, used, False,
                            f"Python 3.18+ ignores import lines in .pth files and {START_NAME} is "
                            f"missing; reinstall: {REINSTALL_COMMAND}")
    read, detail = site_reads(used.parent)
    return StartupCheck(pth, start, used, read, detail)


# torch's plugin route (_fsdp_autopatch_plugin): the entry point group torch 2.5+ calls at the end
# of ``import torch``, and torch's switch for the whole group.
PLUGIN_GROUP = "torch.backends"
PLUGIN_FIRST_TORCH = (2, 5)
PLUGIN_SWITCH = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def check_plugin(torch_version: Optional[str]) -> tuple[bool, str]:
    """Whether ``import torch`` arms the package here through torch's plugin route, and why."""
    if torch_version is None:
        return False, "torch is not installed"
    try:
        if _matrix.release(torch_version) < PLUGIN_FIRST_TORCH:
            return False, (f"torch {torch_version} calls no plugin entry points (torch 2.5+ does); "
                           "call fsdp_autopatch.apply() in the training script")
    except ValueError:
        return False, f"torch's version {torch_version!r} is unreadable"
    if os.environ.get(PLUGIN_SWITCH, "1") != "1":
        return False, (f"{PLUGIN_SWITCH}={os.environ[PLUGIN_SWITCH]} turns torch's plugin entry points off; "
                       "unset it, or call fsdp_autopatch.apply() in the training script")
    try:
        found = metadata.entry_points()
        # Python 3.9 returns a dict by group; 3.10+ selects.
        group = found.select(group=PLUGIN_GROUP) if hasattr(found, "select") else found.get(PLUGIN_GROUP, ())
        ours = [e for e in group if e.name == "fsdp_autopatch"]
    except Exception as error:
        return False, f"the {PLUGIN_GROUP} entry points cannot be read ({type(error).__name__}: {error})"
    if not ours:
        return False, (f"no {PLUGIN_GROUP} entry point of fsdp-autopatch is installed; reinstall: "
                       f"{REINSTALL_COMMAND}")
    return True, f"import torch calls fsdp-autopatch's {PLUGIN_GROUP} entry point ({ours[0].value})"


def check_wrapt() -> tuple[Optional[str], Optional[str]]:
    """wrapt's version, or None and why it cannot be imported (the hooks need it)."""
    try:
        import wrapt
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"
    return str(getattr(wrapt, "__version__", "unknown")), None


# ---------------------------------------------------------------------------------------------
# torch's class-construction sites, read from its source files


# Ends every answer about torch's layout: reading source cannot run torch's construction, which
# the patch's own self-check does in training processes and verify shows.
PROOF = f"doctor reads files only; `{PROG} verify` is the proof"


def module_file(name: str, search: Optional[Sequence[str]] = None) -> Optional[Path]:
    """The source file of module ``name``, found as the import system finds it, without running
    it or its packages: the top-level package with ``importlib.util.find_spec`` (or in the
    directories ``search``), each module below it in its parent's directories."""
    parts = name.split(".")
    try:
        spec = (util.find_spec(parts[0]) if search is None
                else machinery.PathFinder.find_spec(parts[0], list(search)))
        for end in range(2, len(parts) + 1):
            locations = getattr(spec, "submodule_search_locations", None)
            if spec is None or locations is None:
                return None
            spec = machinery.PathFinder.find_spec(".".join(parts[:end]), list(locations))
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    if spec is None or not origin or not spec.has_location:
        return None
    path = Path(origin)
    return path if path.suffix == ".py" and path.is_file() else None


@dataclass(frozen=True)
class CompiledModule:
    """A module's source compiled (not run): the names its top level binds, and the code of
    its top-level functions, which is what the patch reads of the live module's functions."""

    names: frozenset[str]
    functions: dict[str, list[types.CodeType]]


def compile_module(path: Path) -> CompiledModule:
    """Raises OSError, UnicodeDecodeError, SyntaxError or ValueError for a file this Python
    cannot read or compile."""
    code = compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)
    # if/try/with blocks at the top level are part of the module's own code object.
    names = frozenset(instruction.argval for instruction in dis.get_instructions(code)
                      if instruction.opname in ("STORE_NAME", "STORE_GLOBAL"))
    functions: dict[str, list[types.CodeType]] = {}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            functions.setdefault(const.co_name, []).append(const)
    return CompiledModule(names, functions)


@dataclass(frozen=True)
class LayoutAnswer:
    """For one API of ``_sites.APIS``: ``known``: True: a site the patch knows is in torch's
    files; False: torch has the API's module but none of the sites (a layout unknown to this
    version); None: cannot tell, or nothing to tell (no torch, no such API in this torch)."""

    api: str
    known: Optional[bool]
    text: str
    site: Optional[str] = None
    file: Optional[str] = None
    wrapper: Optional[str] = None
    doubt: bool = False  # None because torch's files cannot answer, not because there is no such API


def check_layout(torch_version: Optional[str], search: Optional[Sequence[str]] = None) -> list[LayoutAnswer]:
    """For each API of ``_sites.APIS``, whether the installed torch (megatron-fsdp, for its API)
    has one of the sites the patch knows, read from its compiled source files without importing
    it, by the same bytecode check the patch makes at run time (``_sites.shape_problem``).
    ``search``: directories to find the packages in instead of ``sys.path``."""
    torch_apis = [api for api in _sites.APIS if _sites.distribution_of(api) == "torch"]
    answers = {answer.api: answer for answer in _check_torch_layout(torch_version, torch_apis, search)}
    for api in _sites.APIS:
        if api not in answers:
            answers[api] = _check_other_layout(api, search)
    return [answers[api] for api in _sites.APIS]


def _check_other_layout(api: str, search: Optional[Sequence[str]]) -> LayoutAnswer:
    """An API of a package other than torch (Megatron-FSDP's): installed or not, and its sites."""
    distribution = _sites.distribution_of(api)
    version = installed_version(distribution)
    if version is None:
        return LayoutAnswer(api, None, f"{distribution} is not installed")
    top_module = next(site.module for site in _sites.SITES if site.api == api).split(".")[0]
    init = module_file(top_module, search)
    if init is None:
        return LayoutAnswer(api, None, f"cannot tell: {distribution} {version} is installed, but no "
                                       f"{top_module} package with source files is importable here",
                            doubt=True)
    return _read_api(api, version, init.parent.parent, search)


def _check_torch_layout(
    torch_version: Optional[str], apis: list[str], search: Optional[Sequence[str]]
) -> list[LayoutAnswer]:
    if torch_version is None:
        return [LayoutAnswer(api, None, "torch is not installed") for api in apis]
    try:
        row = _matrix.row_for(_matrix.TORCH_ROWS, torch_version)
    except ValueError:
        row = None
    if row is not None and not row.affected:
        return [LayoutAnswer(api, None, f"torch {torch_version} has no FSDP2") for api in apis]
    torch_init = module_file("torch", search)
    if torch_init is None:
        text = (f"cannot tell: torch {torch_version} is installed, but no torch package with source "
                f"files is importable here; {PROOF}")
        return [LayoutAnswer(api, None, text, doubt=True) for api in apis]
    top = torch_init.parent.parent
    return [_read_api(api, torch_version, top, search) for api in apis]


def _read_api(api: str, version: str, top: Path, search: Optional[Sequence[str]]) -> LayoutAnswer:
    """One API's answer from the files of its package (``version`` installed under ``top``)."""
    compiled: dict[str, CompiledModule] = {}
    files: dict[str, Path] = {}

    def has(module: str, name: str) -> bool:
        return module in compiled and name in compiled[module].names

    def code_of(module: str, name: str) -> list[types.CodeType]:
        return compiled[module].functions.get(name, []) if module in compiled else []

    missing: dict[str, list[str]] = {}  # shown file: what each site found missing there
    for candidate in (each for each in _sites.SITES if each.api == api):
        for name in (candidate.module, candidate.builder_module):
            path = module_file(name, search)
            if path is None or name in compiled:
                continue
            try:
                compiled[name], files[name] = compile_module(path), path
            except (OSError, UnicodeDecodeError) as error:
                return LayoutAnswer(api, None, f"cannot tell: {_shown(path, top)} cannot be read "
                                               f"({error}); {PROOF}", file=str(path), doubt=True)
            except (SyntaxError, ValueError) as error:
                return LayoutAnswer(api, None, f"cannot tell: this Python cannot compile "
                                               f"{_shown(path, top)} ({error}); {PROOF}",
                                    file=str(path), doubt=True)
        if candidate.module not in compiled:
            continue
        problem = _sites.shape_problem(candidate, has, code_of)
        shown = _shown(files[candidate.module], top)
        if problem is None:
            wrapper = next(name for name in candidate.wrappers if has(candidate.module, name))
            return LayoutAnswer(api, True, f"known: {candidate.name}: {candidate.builder} calls the "
                                           f"global type (wrapper class {wrapper}, in {shown}); {PROOF}",
                                candidate.name, str(files[candidate.module]), wrapper)
        details = missing.setdefault(shown, [])
        if problem not in details:
            details.append(problem)
    unknown = _sites.unknown_layout(api, version)
    if not missing and api != _sites.FULLY_SHARD:  # FSDP2's replicate came in 2.9, megatron's in 0.6
        return LayoutAnswer(api, None, f"{_sites.distribution_of(api)} {version} has no {api}")
    if not missing:  # every torch with FSDP2 has fully_shard somewhere
        modules = ", ".join(dict.fromkeys(site.module for site in _sites.SITES if site.api == api))
        return LayoutAnswer(api, False, f"{unknown}: none of the modules where it looks for the class "
                                        f"construction is in torch's files ({modules}); {PROOF}")
    found = "; ".join(f"{shown}: {', and '.join(details)}" for shown, details in missing.items())
    return LayoutAnswer(api, False, f"{unknown}: {found}; {PROOF}")


def _shown(path: Path, top: Path) -> str:
    try:
        return str(path.relative_to(top))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------------------------
# the report and its verdict


@dataclass
class DoctorReport:
    version: str
    package_path: str
    # INSTALLED, EDITABLE, SOURCE_TREE or UNOWNED, and what that means here.
    installation: str
    installation_detail: str
    source_tree: Optional[str]
    python: str
    executable: str
    torch: Optional[str]
    transformers: Optional[str]
    wrapt: Optional[str]
    wrapt_error: Optional[str]
    mode: str
    mode_value: Optional[str]
    mode_problem: Optional[str]
    # True: the matrix lists the pair as having the bug; False: as free of it; None: cannot tell.
    in_matrix: Optional[bool]
    # Always the matrix here: doctor imports no torch. Training processes ask a probe first.
    decided_by: str
    # True: a class-construction site the patch knows is in torch's source files; False: none is
    # (a layout unknown to this version); None: cannot tell (torch's files cannot be read) or
    # nothing to tell (no torch, no FSDP2).
    layout_known: Optional[bool]
    layout: str
    layout_site: Optional[str]
    layout_file: Optional[str]
    layout_wrapper: Optional[str]
    # The same answer for every API of _sites.APIS (FSDP2 fully_shard first): api, known, text,
    # site, file, wrapper, doubt.
    sites: list[dict[str, Any]]
    # True: the patch is set up to apply; False: it will not be; None: cannot tell from files.
    would_apply: Optional[bool]
    reason: str
    pth_installed: Optional[str]
    start_installed: Optional[str]
    startup_file: Optional[str]
    startup_read: bool
    startup_detail: str
    # torch's plugin route: whether import torch arms the package here, and why.
    plugin_arms: bool
    plugin_detail: str
    # The route that arms interpreters like this one (the start-up file, else torch's plugin
    # entry point), or None; and the one that armed this very process, if any.
    arms_by: Optional[str]
    armed_here: bool
    armed_by: Optional[str]
    # What certainly keeps the patch from being applied.
    problems: list[str] = field(default_factory=list)
    # What files cannot answer.
    unknowns: list[str] = field(default_factory=list)
    outcome: str = OK  # OK, PROBLEM or CANNOT_TELL
    verdict: str = ""
    ok: bool = True
    strict_exit_code: int = EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def newer_than_matrix(torch_version: Optional[str]) -> bool:
    try:
        return torch_version is not None and _matrix.row_for(_matrix.TORCH_ROWS, torch_version) is None
    except ValueError:
        return False


def diagnose() -> DoctorReport:
    mode = _config.mode_from_environment()
    installation = check_installation()
    torch_version, transformers_version = (installed_version(name) for name in PACKAGES)
    wrapt_version, wrapt_error = check_wrapt()
    startup = check_startup(skip=installation.source_tree)
    plugin_arms, plugin_detail = check_plugin(torch_version)
    try:
        # Whether the pair has the bug does not depend on the switch; whether it gets fixed does.
        pair = _matrix.decide(_config.AUTO, torch_version, transformers_version)
        decision = _matrix.decide(mode.name, torch_version, transformers_version)
    except ValueError as error:
        pair = decision = _matrix.Decision(False, f"unreadable version: {error}", None)
    matrix_apply: Optional[bool] = decision.apply
    reason = pair.reason
    unknowns = []
    if installation.kind == SOURCE_TREE:
        unknowns.append(installation.detail)
    # Whether the pair has the bug is the probe's to say, in training processes: files cannot.
    newer = (pair.in_matrix is None and newer_than_matrix(torch_version)
             and transformers_version is not None and mode.name != _config.FORCE)
    if newer and mode.name == _config.AUTO:
        matrix_apply = None
        reason = (f"torch {torch_version} is newer than the matrix: on import, a probe asks torch "
                  "and CPython whether the class swap still fails, and the patch applies only if it "
                  f"does; see its answer with: {PROG} verify")
    if newer:
        unknowns.append(reason)
    layouts = check_layout(torch_version)
    layout = layouts[0]  # fully_shard's
    unknowns += [answer.text for answer in layouts if answer.known is False or answer.doubt]
    unknowns = list(dict.fromkeys(unknowns))  # "cannot tell" is the same for every API

    problems = []
    if mode.name == _config.OFF:
        problems.append(f"{_config.MODE_VARIABLE}={mode.raw} disables the patch; unset "
                        f"{_config.MODE_VARIABLE} (or set it to auto)")
    if not (startup.read or plugin_arms):
        problems.append(f"{startup.detail} (and torch's plugin route does not arm it: {plugin_detail})")
    if wrapt_version is None:
        problems.append(f"wrapt cannot be imported ({wrapt_error}); install it: pip install wrapt")
    would_apply: Optional[bool] = False if problems else None if unknowns and matrix_apply is not False \
        else matrix_apply

    report = DoctorReport(
        version=fsdp_autopatch.__version__,
        package_path=str(Path(fsdp_autopatch.__file__).parent),
        installation=installation.kind,
        installation_detail=installation.detail,
        source_tree=str(installation.source_tree) if installation.source_tree else None,
        python=platform.python_version(),
        executable=sys.executable,
        torch=torch_version,
        transformers=transformers_version,
        wrapt=wrapt_version,
        wrapt_error=wrapt_error,
        mode=mode.name,
        mode_value=mode.raw,
        mode_problem=mode.problem or None,
        in_matrix=pair.in_matrix,
        decided_by=_matrix.MATRIX,
        layout_known=layout.known,
        layout=layout.text,
        layout_site=layout.site,
        layout_file=layout.file,
        layout_wrapper=layout.wrapper,
        sites=[asdict(answer) for answer in layouts],
        would_apply=would_apply,
        reason=reason,
        pth_installed=str(startup.pth) if startup.pth else None,
        start_installed=str(startup.start) if startup.start else None,
        startup_file=str(startup.used) if startup.used else None,
        startup_read=startup.read,
        startup_detail=startup.detail,
        plugin_arms=plugin_arms,
        plugin_detail=plugin_detail,
        arms_by=(f"{fsdp_autopatch.START_FILE_ROUTE}, at interpreter start" if startup.read else
                 "torch's plugin entry point (torch.backends), at import torch" if plugin_arms else None),
        armed_here=fsdp_autopatch.armed,
        armed_by=fsdp_autopatch.armed_by,
        problems=problems,
        unknowns=unknowns,
    )
    report.outcome, report.verdict = doctor_verdict(report, decision, newer)
    report.ok = report.outcome == OK
    report.strict_exit_code = STRICT_EXIT[report.outcome]
    return report


def doctor_verdict(report: DoctorReport, decision: _matrix.Decision, newer: bool) -> tuple[str, str]:
    """OK, PROBLEM or CANNOT TELL, and the one-line summary that starts with it."""
    if report.installation == SOURCE_TREE:  # nothing below describes an installation
        return CANNOT_TELL, f"CANNOT TELL: {report.installation_detail}"
    pair = f"torch {report.torch} with transformers {report.transformers}"
    forced = report.mode == _config.FORCE and decision.apply
    if not (report.in_matrix or forced or newer):
        return OK, f"OK: nothing to fix: {report.reason}"
    if report.problems:
        if report.in_matrix:
            return PROBLEM, (f"PROBLEM: {pair} has the FSDP2 layout bug and it will NOT be fixed: "
                             f"{report.problems[0]}")
        if forced:
            return PROBLEM, (f"PROBLEM: {_config.MODE_VARIABLE}=force asks for the patch, and it "
                             f"will NOT be applied: {report.problems[0]}")
        return CANNOT_TELL, (f"CANNOT TELL: torch {report.torch} is newer than the matrix and may "
                             f"still need the patch, but {report.problems[0]}")
    if report.unknowns:
        return CANNOT_TELL, f"CANNOT TELL: {report.unknowns[0]}"
    if forced and not report.in_matrix:
        return OK, f"OK: {decision.reason}; {PROOF}"
    return OK, (f"OK: {pair} has the FSDP2 layout bug; the installed patch is set up to fix it in "
                f"every process of this Python; {PROOF}")


def run_doctor(options: argparse.Namespace, console: Console) -> int:
    report = diagnose()
    if report.mode_problem:
        console.warning(report.mode_problem)
    if options.json:
        print(json.dumps(report.to_dict()), file=console.out, flush=True)
    else:
        show_doctor(report, console)
    return report.strict_exit_code if options.strict else EXIT_OK


def show_doctor(report: DoctorReport, console: Console) -> None:
    def row(label: str, text: str) -> None:
        console.detail(f"  {label:<16}{text}")

    def missing(version: Optional[str]) -> str:
        return version if version is not None else console.paint("not installed", "dim")

    console.detail(console.paint(f"{PROG} {report.version} doctor", "bold"))
    package = report.package_path
    if report.installation == SOURCE_TREE:
        package = console.paint(f"{package} (a source tree, not an installation)", "red")
    elif report.installation == EDITABLE:
        package = f"{package} (editable install)"
    row("package", package)
    row("python", f"{report.python} ({report.executable})")
    row("torch", missing(report.torch))
    row("transformers", missing(report.transformers))
    row("wrapt", report.wrapt or console.paint(f"cannot be imported: {report.wrapt_error}", "red"))
    switch = (f"{_config.MODE_VARIABLE} unset" if report.mode_value is None
              else f"{_config.MODE_VARIABLE}={report.mode_value!r}")
    row("mode", f"{report.mode} ({switch})")
    matrix = {True: "has the bug", False: "not affected", None: "not decided by the matrix"}
    row("matrix", f"{matrix[report.in_matrix]}: {report.reason}")
    row("decided by", "the version matrix here (doctor imports no torch); in training processes a "
                      "probe asks torch and CPython directly, and the matrix answers only where it "
                      f"cannot run; see the probe's answer with: {PROG} verify")
    # One row per API: "fully_shard", "replicate", "DDP replicate".
    labels = {_sites.FULLY_SHARD: "FSDP2 layout", _sites.FSDP2_REPLICATE: "FSDP2 replicate",
              _sites.DDP_REPLICATE: "DDP replicate", _sites.MEGATRON_FULLY_SHARD: "Megatron-FSDP"}
    for answer in report.sites:
        text = str(answer["text"])
        colour = {True: None, False: "red", None: "yellow" if answer["doubt"] else None}[answer["known"]]
        row(labels[answer["api"]], console.paint(text, colour) if colour else text)
    row(".pth", report.pth_installed or console.paint("not installed", "red"))
    row(".start", report.start_installed or console.paint("not installed", "dim"))
    read = console.paint("read", "green") if report.startup_read else console.paint("NOT read", "red")
    row("start-up", f"{read}: {report.startup_detail}")
    row("torch plugin", report.plugin_detail)
    row("arming", report.arms_by or console.paint("nothing arms it: call fsdp_autopatch.apply()", "red"))
    row("this process", f"armed by {report.armed_by}" if report.armed_here else "not armed")
    newer = report.in_matrix is None and report.reason.startswith(f"torch {report.torch} is newer")
    would = {True: "yes", False: "no",
             None: "decided on import, by a probe" if newer else "cannot tell from files"}
    row("would apply", would[report.would_apply])
    colour = {OK: "green", PROBLEM: "red", CANNOT_TELL: "yellow"}[report.outcome]
    console.verdict(report.verdict, colour)
