"""``fsdp-autopatch doctor``: does this environment have the bug, and will the installed patch fix it?

It answers from installed metadata, the version matrix and this interpreter's site configuration,
and never imports torch or transformers, so it takes well under a second. What it cannot see,
training processes find out for themselves: there the patch asks torch and CPython directly
whether the class swap fails, and ``fsdp-autopatch verify`` shows that answer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import site
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import fsdp_autopatch
from fsdp_autopatch import _config, _matrix, _patch
from fsdp_autopatch._console import (
    DISTRIBUTION,
    EXIT_BROKEN,
    EXIT_OK,
    PACKAGES,
    PROG,
    Console,
    installed_version,
)

PTH_NAME = "fsdp_autopatch.pth"
START_NAME = "fsdp_autopatch.start"


def same_path(a: Path, b: Path) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


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


def find_startup_file(name: str) -> Optional[Path]:
    """The installed file, looked for beside the distribution first, then in every site directory."""
    candidates: list[Path] = []
    try:
        candidates.append(Path(str(metadata.distribution(DISTRIBUTION).locate_file(""))))
    except metadata.PackageNotFoundError:
        pass
    candidates.extend(site_directories())
    candidates.extend(Path(entry) for entry in sys.path if entry)
    for directory in candidates:
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


def check_startup() -> StartupCheck:
    pth, start = find_startup_file(PTH_NAME), find_startup_file(START_NAME)
    # PEP 829: from Python 3.15 a matching .start file replaces the .pth import line, and from
    # 3.18 .pth import lines are not run at all.
    uses_start = sys.version_info >= (3, 15) and start is not None
    used = start if uses_start else pth
    if used is None:
        return StartupCheck(pth, start, None, False,
                            f"{PTH_NAME} is not installed; reinstall: pip install --force-reinstall "
                            f"{DISTRIBUTION}")
    if not uses_start and sys.version_info >= (3, 18):
        return StartupCheck(pth, start, used, False,
                            f"Python 3.18+ ignores import lines in .pth files and {START_NAME} is "
                            f"missing; reinstall: pip install --force-reinstall {DISTRIBUTION}")
    read, detail = site_reads(used.parent)
    return StartupCheck(pth, start, used, read, detail)


def check_wrapt() -> tuple[Optional[str], Optional[str]]:
    """wrapt's version, or None and why it cannot be imported (the hooks need it)."""
    try:
        import wrapt
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"
    return str(getattr(wrapt, "__version__", "unknown")), None


@dataclass
class DoctorReport:
    version: str
    package_path: str
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
    # (the layout is unknown); None: cannot tell (no FSDP2, or torch's files cannot be read).
    layout_known: Optional[bool]
    layout: str
    would_apply: Optional[bool]
    reason: str
    pth_installed: Optional[str]
    start_installed: Optional[str]
    startup_file: Optional[str]
    startup_read: bool
    startup_detail: str
    armed_here: bool
    problems: list[str] = field(default_factory=list)
    verdict: str = ""
    ok: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_layout(torch_version: Optional[str]) -> tuple[Optional[bool], str]:
    """Whether the installed torch has one of the class-construction sites the patch knows,
    read from its source files (cheap, and without importing it)."""
    if torch_version is None:
        return None, "torch is not installed"
    try:
        row = _matrix.row_for(_matrix.TORCH_ROWS, torch_version)
    except ValueError:
        row = None
    if row is not None and not row.affected:
        return None, f"torch {torch_version} has no FSDP2"
    try:
        distribution = metadata.distribution("torch")
        for site in _patch.FULLY_SHARD_SITES:
            source = Path(str(distribution.locate_file(site.module.replace(".", "/") + ".py")))
            if source.is_file() and (site.cache or "type(") in source.read_text(errors="replace"):
                return True, f"known: {site.name}"
        if not Path(str(distribution.locate_file("torch/__init__.py"))).is_file():
            return None, "cannot tell: torch's source files are not where its metadata says"
    except (OSError, metadata.PackageNotFoundError) as error:
        return None, f"cannot tell: torch's source files cannot be read ({error})"
    return False, _patch.unknown_layout_reason(torch_version)


def newer_than_matrix(torch_version: Optional[str]) -> bool:
    try:
        return torch_version is not None and _matrix.row_for(_matrix.TORCH_ROWS, torch_version) is None
    except ValueError:
        return False


def diagnose() -> DoctorReport:
    mode = _config.mode_from_environment()
    torch_version, transformers_version = (installed_version(name) for name in PACKAGES)
    wrapt_version, wrapt_error = check_wrapt()
    startup = check_startup()
    try:
        # Whether the pair has the bug does not depend on the switch; whether it gets fixed does.
        pair = _matrix.decide(_config.AUTO, torch_version, transformers_version)
        decision = _matrix.decide(mode.name, torch_version, transformers_version)
    except ValueError as error:
        pair = decision = _matrix.Decision(False, f"unreadable version: {error}", None)
    matrix_apply: Optional[bool] = decision.apply
    reason = pair.reason
    if mode.name == _config.AUTO and pair.in_matrix is None and newer_than_matrix(torch_version) \
            and transformers_version is not None:
        matrix_apply = None
        reason = (f"torch {torch_version} is newer than the matrix: on import, a probe asks torch "
                  "and CPython whether the class swap still fails, and the patch applies only if it "
                  f"does; see its answer with: {PROG} verify")
    layout_known, layout = check_layout(torch_version)

    problems = []
    if mode.name == _config.OFF:
        problems.append(f"{_config.MODE_VARIABLE}={mode.raw} disables the patch; unset "
                        f"{_config.MODE_VARIABLE} (or set it to auto)")
    if not startup.read:
        problems.append(startup.detail)
    if wrapt_version is None:
        problems.append(f"wrapt cannot be imported ({wrapt_error}); install it: pip install wrapt")
    # Listed whatever the matrix says, as training processes report it (status().reason) before
    # any decision: a torch whose FSDP2 this version cannot find cannot be patched for any module.
    # The verdict, and so --strict's exit code, still turn on whether the bug would stay.
    if layout_known is False:
        problems.append(layout)
    would_apply: Optional[bool] = False if problems else matrix_apply

    report = DoctorReport(
        version=fsdp_autopatch.__version__,
        package_path=str(Path(fsdp_autopatch.__file__).parent),
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
        layout_known=layout_known,
        layout=layout,
        would_apply=would_apply,
        reason=reason,
        pth_installed=str(startup.pth) if startup.pth else None,
        start_installed=str(startup.start) if startup.start else None,
        startup_file=str(startup.used) if startup.used else None,
        startup_read=startup.read,
        startup_detail=startup.detail,
        armed_here=fsdp_autopatch.armed,
        problems=problems,
    )
    report.verdict, report.ok = doctor_verdict(report, decision.reason)
    return report


def doctor_verdict(report: DoctorReport, mode_reason: str) -> tuple[str, bool]:
    """The one-line summary, and False when the bug is present and would not be fixed."""
    pair = f"torch {report.torch} with transformers {report.transformers}"
    if report.in_matrix:
        if report.would_apply:
            return (f"OK: {pair} has the FSDP2 layout bug, and the patch will fix it in every "
                    f"process of this Python; prove it with: {PROG} verify"), True
        return (f"PROBLEM: {pair} has the FSDP2 layout bug and it will NOT be fixed: "
                f"{report.problems[0]}"), False
    if report.would_apply is None:
        if report.problems:
            return (f"WARNING: torch {report.torch} is newer than the matrix and may still need the "
                    f"patch, but {report.problems[0]}"), True
        return f"OK: {report.reason}", True
    if report.mode == _config.FORCE:
        if report.would_apply:
            return f"OK: {mode_reason}", True
        if report.problems:
            return f"WARNING: {_config.MODE_VARIABLE}=force has no effect: {report.problems[0]}", True
    return f"OK: nothing to fix: {report.reason}", True


def run_doctor(options: argparse.Namespace, console: Console) -> int:
    report = diagnose()
    if report.mode_problem:
        console.warning(report.mode_problem)
    if options.json:
        print(json.dumps(report.to_dict()), file=console.out)
    else:
        show_doctor(report, console)
    if options.strict and not report.ok:
        return EXIT_BROKEN
    return EXIT_OK


def show_doctor(report: DoctorReport, console: Console) -> None:
    def row(label: str, text: str) -> None:
        console.detail(f"  {label:<14}{text}")

    def missing(version: Optional[str]) -> str:
        return version if version is not None else console.paint("not installed", "dim")

    console.detail(console.paint(f"{PROG} {report.version} doctor", "bold"))
    row("package", report.package_path)
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
    layout = {True: report.layout, False: console.paint(report.layout, "red"), None: report.layout}
    row("FSDP2 layout", layout[report.layout_known])
    row(".pth", report.pth_installed or console.paint("not installed", "red"))
    row(".start", report.start_installed or console.paint("not installed", "dim"))
    read = console.paint("read", "green") if report.startup_read else console.paint("NOT read", "red")
    row("start-up", f"{read}: {report.startup_detail}")
    row("this process", "armed by the start-up file" if report.armed_here else "not armed")
    would = {True: "yes", False: "no", None: "decided on import, by a probe"}
    row("would apply", would[report.would_apply])
    colour = "green" if report.verdict.startswith("OK") else "red" if not report.ok else "yellow"
    console.verdict(report.verdict, colour)

