"""``fsdp-autopatch doctor``: does this environment have the bug, and will the installed patch fix it?

One line per marked fact, then the verdict, which is the exit code. It reads installed metadata,
the version matrix, site configuration and torch's source files (compiled, never run), so it
answers in well under a second; ``fsdp-autopatch verify`` runs the fix.
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
from typing import Any, Callable, NamedTuple, Optional
from urllib.parse import unquote, urlparse

import fsdp_autopatch
from fsdp_autopatch import PTH_NAME, START_NAME, _config, _console, _matrix, _sites
from fsdp_autopatch._console import PROG, Console, installed_version

PLUGIN_GROUP = "torch.backends"
OK, PROBLEM, CANNOT_TELL = "OK", "PROBLEM", "CANNOT TELL"
EXIT_CODE = {OK: _console.EXIT_OK, PROBLEM: _console.EXIT_NOT_FIXED, CANNOT_TELL: _console.EXIT_CANNOT_TELL}
# A fact's mark: fine, a problem, files cannot tell, a problem that does not matter here.
GOOD, FAILED, UNKNOWN, IRRELEVANT = "ok", "FAIL", "??", "--"
PROOF = f"Proof: {PROG} verify"  # the one caveat, said once, on the verdict line
INSTALLED, EDITABLE, SOURCE_TREE, UNOWNED = "installed", "editable", "source tree", "not installed"


def same_path(a: Path, b: Path) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


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


def check_installation() -> tuple[str, str]:
    """Is the fsdp_autopatch imported here an installed one (its kind, and a line)? ``python -m`` in a
    checkout's root imports the checkout, which says nothing of what training processes load."""
    package = Path(fsdp_autopatch.__file__).resolve().parent
    try:
        distribution: Optional[metadata.Distribution] = metadata.distribution(_console.DISTRIBUTION)
    except metadata.PackageNotFoundError:
        distribution = None
    installed = Path(str(distribution.locate_file("fsdp_autopatch"))) if distribution else None
    editable = editable_directory(distribution) if distribution else None
    if installed is not None and installed.is_dir():
        if same_path(installed, package):
            return INSTALLED, f"installed in {package.parent}"
    elif editable is not None:
        if same_path(editable, package.parent):
            return EDITABLE, f"an editable install of {package.parent}"
        installed = editable / "fsdp_autopatch"
    if not is_source_tree(package.parent):
        return UNOWNED, f"{package} belongs to no installed distribution"
    if distribution is not None:
        return SOURCE_TREE, (f"{package.parent} is a source tree, not the installed fsdp-autopatch "
                             f"{installed} (run from another directory)")
    hidden = hidden_site_packages()
    if hidden is not None:
        where = _config.quoted_for_paste(str(hidden))
        return SOURCE_TREE, (f"{package.parent} is a source tree, and python -S hides {hidden}, where "
                             f"fsdp-autopatch is installed: set PYTHONPATH={where}, as for a python -S "
                             "training script, and run from another directory")
    return SOURCE_TREE, (f"{package.parent} is a source tree, and fsdp-autopatch is not installed for "
                         f"{sys.executable} ({_config.pip_command('install .')} there; doctor answers from "
                         "any other directory)")


def hidden_site_packages() -> Optional[str]:
    """The site-packages holding fsdp-autopatch that ``python -S`` keeps off ``sys.path``, or None.
    Under -S, sys.prefix is the base interpreter's even in a virtual environment (site.py is what
    reads pyvenv.cfg), so the environment is found as site.py finds it: beside the executable."""
    if not sys.flags.no_site:
        return None
    import sysconfig

    candidates = [sysconfig.get_paths()["purelib"]]
    here = os.path.dirname(os.path.abspath(sys.executable))
    for root in (here, os.path.dirname(here)):
        if os.path.isfile(os.path.join(root, "pyvenv.cfg")):
            candidates.insert(0, sysconfig.get_paths(vars={"base": root, "platbase": root})["purelib"])
    return next((where for where in candidates
                 if next(iter(metadata.distributions(name=_console.DISTRIBUTION, path=[where])), None)), None)


def installed_file(name: str) -> Optional[Path]:
    """A file the distribution installed at the root of its site directory, or None."""
    try:
        path = Path(str(metadata.distribution(_console.DISTRIBUTION).locate_file(name)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def check_startup(pth: Optional[Path], start: Optional[Path]) -> tuple[Optional[Path], bool, str]:
    """Of the start-up files installed, the one this Python uses, whether site.py reads it here, and why."""
    # PEP 829: from Python 3.15 a matching .start file replaces the .pth import line, and from
    # 3.18 .pth import lines are not run at all.
    used = start if sys.version_info >= (3, 15) and start is not None else pth
    if used is None:
        return None, False, f"{PTH_NAME} is not installed"
    if used == pth and sys.version_info >= (3, 18):
        return used, False, f"Python 3.18+ ignores {PTH_NAME}'s import line"
    directory, user = used.parent, site.getusersitepackages()
    on_path = any(same_path(directory, Path(entry)) for entry in sys.path if entry)
    if sys.flags.no_site:
        read, detail = False, "python -S reads no start-up file"
    elif any(same_path(directory, Path(path)) for path in site.getsitepackages()):
        read, detail = on_path, f"{directory} is {'' if on_path else 'not '}on sys.path here"
    elif user and same_path(directory, Path(user)):
        read = bool(site.ENABLE_USER_SITE)
        detail = f"this interpreter {'reads' if read else 'skips'} the user site directory {directory}"
    else:
        read, detail = False, f"{directory} is not a site directory (PYTHONPATH or pip install --target?)"
    return used, read, detail


def check_plugin(torch_version: Optional[str]) -> tuple[bool, str]:
    """Whether ``import torch`` arms the package here by torch's plugin entry point, and why."""
    switch = _config.PLUGIN_SWITCH
    if torch_version is None:
        return False, "torch is not installed"
    try:
        if _matrix.release(torch_version) < _matrix.PLUGIN_FIRST_TORCH:
            return False, f"torch {torch_version} calls no plugin entry points (torch 2.5+ does)"
    except ValueError:
        return False, f"torch's version {torch_version!r} is unreadable"
    if os.environ.get(switch, "1") != "1":
        return False, f"{switch}={os.environ[switch]} turns torch's plugins off"
    try:
        found = metadata.entry_points()
        # Python 3.9 returns a dict by group; 3.10+ selects.
        group = found.select(group=PLUGIN_GROUP) if hasattr(found, "select") else found.get(PLUGIN_GROUP, ())
        ours = any(entry.name == "fsdp_autopatch" for entry in group)
    except Exception as error:
        return False, f"the {PLUGIN_GROUP} entry points cannot be read ({type(error).__name__}: {error})"
    return ours, f"torch calls its {PLUGIN_GROUP} entry point" if ours else \
        f"its {PLUGIN_GROUP} entry point is not installed"


def arming_remedy(plugin_detail: str) -> str:
    """What to do where nothing arms this Python: no reinstall where the installation is whole
    (tooling that strips .pth files strips them again)."""
    if plugin_detail.startswith(_config.PLUGIN_SWITCH):
        return f"unset {_config.PLUGIN_SWITCH}, or call fsdp_autopatch.apply() in the training script"
    if plugin_detail.endswith("entry point is not installed"):
        return f"reinstall: {_config.pip_command(_console.REINSTALL_ARGUMENTS)}"
    return "call fsdp_autopatch.apply() in the training script"


def module_file(name: str) -> Optional[Path]:
    """The source file of module ``name``, found as the import system finds it, without running
    it or its packages (``find_spec`` for the top level, each module in its parent's path)."""
    parts = name.split(".")
    try:
        spec = util.find_spec(parts[0])
        for end in range(2, len(parts) + 1):
            locations = getattr(spec, "submodule_search_locations", None)
            if locations is None:
                return None
            spec = machinery.PathFinder.find_spec(".".join(parts[:end]), list(locations))
    except Exception:  # ImportError, ValueError; KeyError from a namespace package's unimported parent
        return None
    origin = getattr(spec, "origin", None)
    path = Path(origin) if origin and spec.has_location else None  # type: ignore[union-attr]
    return path if path is not None and path.suffix == ".py" and path.is_file() else None


class Compiled(NamedTuple):
    """A module's source compiled, not run: what the patch reads of a live module."""

    # Each name its top level binds (if/try/with blocks included), and the module that binds it:
    # the one a ``from ... import`` names, the module itself for its own functions and classes;
    # None for any other value, or a name bound from two places.
    origins: dict[str, Optional[str]]
    functions: dict[str, list[types.CodeType]]  # the code of its top-level functions, by name


def compile_module(path: Path, module: str) -> Compiled:
    """Module ``module``'s source file at ``path``, compiled."""
    code = compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    instructions = list(dis.get_instructions(code))
    origins: dict[str, Optional[str]] = {}
    imported: Optional[str] = None  # the module of the latest import statement
    source: Optional[str] = None  # where the value about to be stored comes from
    for index, instruction in enumerate(instructions):
        if instruction.opname == "IMPORT_NAME":  # after LOAD_CONST <level>, LOAD_CONST <names>
            level = instructions[index - 2].argval if index >= 2 else 0
            imported = absolute_module(instruction.argval, level if isinstance(level, int) else 0, package)
        elif instruction.opname == "IMPORT_FROM":
            source = imported
        elif instruction.opname == "MAKE_FUNCTION":  # a def or a class, decorated or not
            source = module
        elif instruction.opname in ("STORE_NAME", "STORE_GLOBAL"):
            name = instruction.argval
            origins[name] = source if origins.get(name, source) == source else None
            source = None
    functions: dict[str, list[types.CodeType]] = {}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            functions.setdefault(const.co_name, []).append(const)
    return Compiled(origins, functions)


def absolute_module(name: str, level: int, package: str) -> str:
    """The module an import statement in ``package`` names (``from .._x import y``: level 2)."""
    if level == 0:
        return name
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{name}" if name else base


Lookups = tuple[Callable[[str, str], bool], Callable[[str, str], list[types.CodeType]],
                Callable[[str, str], Optional[str]]]


def file_lookups(compiled: dict[str, Compiled]) -> Lookups:
    """``_sites.shape_problem``'s ``has``, ``code_of`` and ``origin``, over compiled modules."""
    empty = Compiled({}, {})

    def has(module: str, name: str) -> bool:
        return name in compiled.get(module, empty).origins

    def code_of(module: str, name: str) -> list[types.CodeType]:
        return compiled.get(module, empty).functions.get(name, [])

    def origin(module: str, name: str) -> Optional[str]:
        return compiled.get(module, empty).origins.get(name)

    return has, code_of, origin


def find_site(api: str, torch_version: Optional[str]) -> dict[str, Any]:
    """Whether torch (or the API's distribution) has one of the API's sites, by the patch's own
    bytecode check (``_sites.shape_problem``) on its source files. ``known``: True, a site; False,
    a layout unknown to this version; None, nothing to tell, or, ``doubt``, unreadable files."""
    distribution = _sites.distribution_of(api)
    version = torch_version if distribution == "torch" else installed_version(distribution)
    row = _matrix.torch_row_for(version) if distribution == "torch" else None

    def answer(known: Optional[bool], text: str, site: Optional[_sites.Site] = None,
               file: Optional[Path] = None, doubt: bool = False) -> dict[str, Any]:
        return {"api": api, "known": known, "text": text, "site": site and site.name,
                "site_key": site and site.key, "file": file and str(file), "doubt": doubt,
                "fixed": bool(site and site.fixed)}

    # The rows of this release only: an older one does not have a newer row's site, whatever files
    # it holds (every row, where the version is unreadable).
    sites = _sites.sites_of(api, _matrix.release_or_none(version))
    top = _sites.top_package(api)
    if version is None:
        return answer(None, f"{distribution} is not installed")
    if row is not None and not row.has_fsdp2:
        return answer(None, f"torch {version} has no FSDP2")
    if not sites:  # FSDP2's replicate came in torch 2.9, for one
        return answer(None, f"{distribution} {version} has no {api}")
    if module_file(top) is None:
        return answer(None, f"cannot tell: no {top} package with source files is importable", doubt=True)
    compiled: dict[str, Compiled] = {}
    files: dict[str, Path] = {}
    missing: dict[Path, list[str]] = {}  # per file, what each site found missing there
    for candidate in sites:
        for name in candidate.modules:
            path = module_file(name)
            if path is not None and name not in compiled:
                try:
                    compiled[name], files[name] = compile_module(path, name), path
                except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as error:
                    return answer(None, f"cannot tell: {path} cannot be compiled here ({error})", file=path,
                                  doubt=True)
        if candidate.module not in compiled:
            continue
        problem = _sites.shape_problem(candidate, *file_lookups(compiled))
        if problem is None:
            where = f"{candidate.builder_module.rsplit('.', 1)[-1]}.{candidate.builder}"
            fixed = " (torch's own fix)" if candidate.fixed else ""
            return answer(True, f"{api} site known: {where}{fixed}", candidate, files[candidate.module])
        details = missing.setdefault(files[candidate.module], [])
        details += [problem] if problem not in details else []
    found = "; ".join(f"{path}: {', and '.join(details)}" for path, details in missing.items())
    return answer(False, f"{_sites.unknown_layout(api, version)}: "
                         f"{found or 'none of the modules where it looks is there'}")


@dataclass
class Fact:
    mark: str
    text: str
    remedy: str = ""
    cause: str = ""  # a FAIL's cause in a few words, for the verdict


@dataclass
class DoctorReport:
    version: str
    python: str
    executable: str
    installation: str  # INSTALLED, EDITABLE, SOURCE_TREE or UNOWNED
    installation_detail: str
    torch: Optional[str]
    transformers: Optional[str]
    wrapt: Optional[str]
    wrapt_error: Optional[str]
    mode: str
    mode_value: Optional[str]
    mode_problem: Optional[str]
    in_matrix: Optional[bool]  # the version rows: the pair has the bug on this Python; None: no row
    reason: str
    sites: list[dict[str, Any]]  # per API, find_site's answer
    pth_installed: Optional[str]
    start_installed: Optional[str]
    startup_file: Optional[str]  # the one this Python uses
    startup_read: bool
    startup_detail: str
    plugin_arms: bool
    plugin_detail: str
    arms_by: Optional[str]  # the route that arms interpreters like this one, if any
    armed_by: Optional[str]  # what armed this very process, and what arming caught here
    startup_error: Optional[str]
    would_apply: Optional[bool] = None  # None: files cannot tell
    facts: list[Fact] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what certainly keeps the fix out
    unknowns: list[str] = field(default_factory=list)  # what files cannot answer
    outcome: str = OK
    verdict: str = ""
    exit_code: int = _console.EXIT_OK


def diagnose() -> DoctorReport:
    mode = _config.mode_from_environment()
    kind, detail = check_installation()
    torch_version, transformers_version = (installed_version(name) for name in _console.TRAINING_PACKAGES)
    try:
        import wrapt

        wrapt_version, wrapt_error = str(getattr(wrapt, "__version__", "unknown")), None
    except Exception as error:
        wrapt_version, wrapt_error = None, f"{type(error).__name__}: {error}"
    pth, start = installed_file(PTH_NAME), installed_file(START_NAME)
    startup_file, startup_read, startup_detail = check_startup(pth, start)
    plugin_arms, plugin_detail = check_plugin(torch_version)
    try:  # whether the pair has the bug does not depend on the switch
        pair = _matrix.decide(_config.AUTO, torch_version, transformers_version)
    except ValueError as error:
        pair = _matrix.Decision(False, f"unreadable version: {error}", None)
    plugin = sys.modules.get("_fsdp_autopatch_plugin")
    report = DoctorReport(
        version=fsdp_autopatch.__version__, python=platform.python_version(), executable=sys.executable,
        installation=kind, installation_detail=detail, torch=torch_version, transformers=transformers_version,
        wrapt=wrapt_version, wrapt_error=wrapt_error, mode=mode.name, mode_value=mode.raw,
        mode_problem=mode.problem or None, in_matrix=pair.in_matrix, reason=pair.reason,
        sites=[find_site(api, torch_version) for api in _sites.APIS],
        pth_installed=pth and str(pth), start_installed=start and str(start), startup_read=startup_read,
        startup_file=startup_file and str(startup_file), startup_detail=startup_detail,
        plugin_arms=plugin_arms, plugin_detail=plugin_detail,
        arms_by=(fsdp_autopatch.START_FILE_ROUTE if startup_read else
                 fsdp_autopatch.PLUGIN_ROUTE if plugin_arms else None),
        armed_by=fsdp_autopatch.armed_by,
        startup_error=fsdp_autopatch.startup_error or getattr(plugin, "error", None),
    )
    judge(report)
    return report


class Marks:
    """Marks one report's facts: one that keeps the fix out fails where the fix is needed, and
    is merely shown where it is not."""

    def __init__(self, report: DoctorReport, needed: bool) -> None:
        self.report = report
        self.needed = needed

    def fact(self, good: bool, text: str, remedy: str = "", cause: str = "") -> None:
        mark = GOOD if good else FAILED if self.needed else IRRELEVANT
        self.report.facts.append(Fact(mark, text, remedy, cause or text))
        if mark == FAILED:
            self.report.problems.append(text)

    def unknown(self, text: str, matters: bool = True) -> None:
        self.report.facts.append(Fact(UNKNOWN if matters else IRRELEVANT, text))
        if matters:
            self.report.unknowns.append(text)

    def shown(self, text: str) -> None:
        self.report.facts.append(Fact(IRRELEVANT, text))


def judge(report: DoctorReport) -> None:
    """The facts, each marked, and the verdict they add up to."""
    torch, row = report.torch, _matrix.torch_row_for(report.torch)
    forced = report.mode == _config.FORCE and torch is not None and (row is None or row.has_fsdp2)
    newer = (report.in_matrix is None and torch is not None and row is None
             and report.transformers is not None and not forced)
    needed = (bool(report.in_matrix) or forced or newer) and not torch_fixes_it(report)
    marks = Marks(report, needed)
    if report.installation == SOURCE_TREE:  # whatever the versions: nothing here is an installation
        marks.unknown(report.installation_detail)
    else:
        marks.fact(True, f"fsdp-autopatch {report.installation_detail}")
    if newer:
        marks.unknown(f"torch {torch} is newer than the version matrix: a probe decides at import")
    else:
        marks.fact(True, pair_fact(report, forced))
    for answer in report.sites:
        if answer["known"]:
            marks.fact(True, answer["text"])
        elif answer["known"] is False or answer["doubt"]:
            marks.unknown(answer["text"], needed)
    arming_facts(report, marks)
    marks.fact(report.wrapt is not None, f"wrapt {report.wrapt}" if report.wrapt else
               f"wrapt cannot be imported ({report.wrapt_error})", _config.pip_command("install wrapt"),
               "wrapt cannot be imported")
    switch_fact(report, marks)
    if report.startup_error:
        marks.fact(False, f"arming failed in this interpreter: {report.startup_error}",
                   f"report it with the output of: {PROG} doctor --json", "arming failed")
    report.would_apply = False if report.problems else None if report.unknowns or newer else needed
    report.outcome, report.verdict = verdict(report, forced, needed)
    report.exit_code = EXIT_CODE[report.outcome]


def arming_facts(report: DoctorReport, marks: Marks) -> None:
    """What arms an interpreter of this Python: the start-up file, else torch's plugin entry
    point. Under the off switch a route is there and arms nothing: said so, beside the switch's."""
    switched_off = f", switched off by {_config.MODE_VARIABLE}={report.mode_value}"
    if report.startup_read:
        also = " (torch's plugin entry point also present)" if report.plugin_arms else ""
        name = Path(str(report.startup_file)).name
        if report.mode == _config.OFF:
            marks.shown(f"{name} read at interpreter start{switched_off}")
        else:
            marks.fact(True, f"armed at interpreter start by {name}{also}")
    elif report.plugin_arms:
        if report.mode == _config.OFF:
            marks.shown(f"torch's plugin entry point at import torch{switched_off}")
        else:
            marks.fact(True, f"armed at import torch by torch's plugin entry point ({report.startup_detail})")
    else:
        unarmed, remedy = "nothing arms the patch", arming_remedy(report.plugin_detail)
        marks.fact(False, f"not armed at interpreter start: {report.startup_detail}", cause=unarmed)
        marks.fact(False, f"not armed at import torch: {report.plugin_detail}", remedy, unarmed)


def switch_fact(report: DoctorReport, marks: Marks) -> None:
    """What ``FSDP_AUTOPATCH`` makes of every process; a value that is not a switch value is what
    the runtime makes of it: one line on stderr (run_doctor prints the same), then auto mode."""
    if report.mode_problem:
        marks.fact(True, f"switch: auto ({_config.MODE_VARIABLE}={report.mode_value!a} is not a switch "
                         "value, so processes run in auto mode)")
        return
    switch = (f"{_config.MODE_VARIABLE} unset" if report.mode_value is None
              else f"{_config.MODE_VARIABLE}={report.mode_value!r}")
    off = f"{_config.MODE_VARIABLE}={report.mode_value} turns the patch off"
    marks.fact(report.mode != _config.OFF, f"switch: {report.mode} ({switch})" if report.mode != _config.OFF
               else f"switch: {off}", f"unset {_config.MODE_VARIABLE} to let it run", off)


def torch_fixes_it(report: DoctorReport) -> bool:
    """Every site torch's files have builds classes CPython accepts itself (a torch with the fix)."""
    known = [answer for answer in report.sites
             if answer["known"] and _sites.distribution_of(answer["api"]) == "torch"]
    return bool(known) and all(answer["fixed"] for answer in known)


def pair_fact(report: DoctorReport, forced: bool) -> str:
    """The versions, and what the version matrix says of them on this Python."""
    torch, transformers, row = report.torch, report.transformers, _matrix.torch_row_for(report.torch)
    if torch is None or (row is not None and not row.has_fsdp2):
        return "torch is not installed" if torch is None else f"torch {torch} has no FSDP2 (version matrix)"
    if forced:
        return f"torch {torch}: {_config.MODE_VARIABLE}=force patches it, whatever the version matrix says"
    if transformers is None:
        return f"torch {torch}; transformers is not installed, so no affected head is"
    pair = f"torch {torch}, transformers {transformers}, {_matrix.interpreter()}"
    heads = _matrix.row_for(_matrix.TRANSFORMERS_ROWS, transformers)
    if torch_fixes_it(report):
        return f"{pair}: torch's files have the fix"
    if report.in_matrix or heads is None:
        return f"{pair}: the bug is here (version matrix)"
    why = ("no head inherits ABC" if not heads.abc_heads else "torch's own fix builds accepted classes"
           if row is not None and row.fixed else "CPython accepts the ABC swap")
    return f"{pair}: {why} (version matrix)"


def verdict(report: DoctorReport, forced: bool, needed: bool) -> tuple[str, str]:
    """OK, PROBLEM or CANNOT TELL, and the one line that starts with it."""
    cause = next((fact.cause for fact in report.facts if fact.mark == FAILED), "")
    if report.installation == SOURCE_TREE:  # nothing else describes an installation
        return CANNOT_TELL, f"CANNOT TELL: {report.installation_detail}"
    if not needed:
        return OK, f"OK: nothing to fix: {pair_fact(report, forced)}"
    if cause and not report.in_matrix and not forced:
        return CANNOT_TELL, f"CANNOT TELL: torch {report.torch} may need the patch, and it will not be " \
                            f"applied: {cause}"
    if cause:
        return PROBLEM, f"PROBLEM: the layout bug will not be fixed here: {cause}"
    if report.unknowns:
        return CANNOT_TELL, f"CANNOT TELL: files cannot tell whether the patch will fix it here. {PROOF}"
    if forced and not report.in_matrix:
        return OK, f"OK: {_config.MODE_VARIABLE}=force: the patch will be applied in every process. {PROOF}"
    return OK, f"OK: the patch will fix the bug in every process of this Python. {PROOF}"


def run_doctor(options: argparse.Namespace, console: Console) -> int:
    report = diagnose()
    # A mistyped switch is said as the runtime says it, the same line; the facts add that
    # processes run in auto mode.
    for problem in (report.mode_problem, _config.log_level_from_environment()[1]):
        if problem:
            console.warning(problem)
    if options.json:
        print(json.dumps(asdict(report)), flush=True)
        return report.exit_code
    console.detail(console.paint(f"{PROG} {report.version} doctor (Python {report.python}, "
                                 f"{report.executable})", "bold"))
    colours = {GOOD: "green", FAILED: "red", UNKNOWN: "yellow", IRRELEVANT: "dim"}
    for fact in report.facts:
        console.detail(f" {console.paint(f'{fact.mark:>4}', colours[fact.mark])}  {fact.text}")
        if fact.remedy and fact.mark == FAILED:
            console.detail(f"        {fact.remedy}")
    console.verdict(report.verdict, {OK: "green", PROBLEM: "red", CANNOT_TELL: "yellow"}[report.outcome])
    return report.exit_code
