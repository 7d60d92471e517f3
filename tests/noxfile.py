"""Test sessions, each in its own virtual environment under tests/.nox/.

    nox -f tests/noxfile.py -s tests      # the default: all but the stress loops, the pinned torch
                                          # and transformers, two pytest workers
    nox -f tests/noxfile.py -s stress     # the stress loops: threads, processes, pip life cycles
    nox -f tests/noxfile.py -s ci_tier    # CI's tier: upstream/torch.diff applied to a copy of torch
    nox -f tests/noxfile.py -s fast       # the tests that need no torch, on Python 3.9 - 3.13
    nox -f tests/noxfile.py -s wrapt_floor  # the hooks on the oldest wrapt pyproject.toml allows
    nox -f tests/noxfile.py -s stacks     # accelerate, TRL, PEFT, verl, DCP, compile (tests/stacks/)
    nox -f tests/noxfile.py -s module -- tests/test_hooks.py   # one module's tests, in a kept venv

The package is always installed from a freshly built wheel, never from the checkout, so the
tests see what users install: the .pth at the root of site-packages included. Arguments after
``--`` go to pytest (``nox -f tests/noxfile.py -s tests -- tests/test_classes.py -x``). Every
version installed is pinned in harness.py (``TORCH_PIN``, ``TRANSFORMERS_PIN``, ``STACKS_PINS``).
"""

from __future__ import annotations

import atexit
import re
import shutil
import sys
import tempfile
from pathlib import Path

import nox

# nox loads this file by path; its neighbour harness.py (shared with the tests, the matrix and
# the benchmarks) is importable once tests/ is on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, STACKS_PINS, build_wheel, requirements

PYTHONS = ["3.9", "3.10", "3.11", "3.12", "3.13"]
# No index is named here: from PyPI alone pip takes a CUDA build (about 5 GB); with
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu in the environment, torch's CPU build.
TORCH_STACK = requirements("torch", "transformers")
# Only the tests session: Megatron-FSDP's site is proven there (it needs Python 3.10+).
MEGATRON = requirements("megatron-fsdp")
REQUIRE = {"FSDP_AUTOPATCH_TEST_REQUIRE": "1"}
# Progress on every test (-v) and the slowest tests at the end; conftest.py adds a line every
# 30 s for a test still running.
REPORTING = ("-v", "--durations=15")

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = False
# A missing interpreter must fail the run: nox would otherwise skip the session and exit 0.
nox.options.error_on_missing_interpreters = True


# The wheel is pure Python, the same for every session and Python of one nox run: built once.
_wheels: list[Path] = []


def package_wheel(session: nox.Session) -> Path:
    """The package's wheel built from the checkout (with the first session's pip) for this nox run."""
    if not _wheels:
        session.log("building the fsdp-autopatch wheel from the checkout")
        into = Path(tempfile.mkdtemp(prefix="fsdp-autopatch-wheel-"))
        atexit.register(shutil.rmtree, into, ignore_errors=True)
        _wheels.append(build_wheel(into, python=str(Path(session.bin) / "python")))
    return _wheels[0]


def test_environment(session: nox.Session) -> dict[str, str]:
    """What pytest runs with: a missing requirement fails the run, and the tests that install the
    package somewhere else take the wheel this session installed instead of building another."""
    return {**REQUIRE, "FSDP_AUTOPATCH_TEST_WHEEL": str(package_wheel(session))}


def install_torch_stack(session: nox.Session, *packages: str) -> None:
    """torch and transformers (with ``packages``) without compiling their bytecode at install: pip
    would compile every one of their 8,000 modules (20 CPU-seconds of torch's and transformers'
    30 to install, measured 2026-12-03), where the tests' first interpreter compiles the ones
    they import, once (about 7: the tests' interpreters write bytecode, their environment drops
    PYTHONDONTWRITEBYTECODE)."""
    session.install("--no-compile", *TORCH_STACK, *packages)


def install_wheel(session: nox.Session, *packages: str) -> None:
    """Install the package's wheel with ``packages``."""
    session.install(str(package_wheel(session)), *packages)
    # From the checkout's root, where test paths given after "--" are meant; pytest puts tests/
    # (not the root) on sys.path, so the package under test is the installed wheel.
    session.chdir(ROOT)


@nox.session(python="3.11", venv_backend="venv")
def tests(session: nox.Session) -> None:
    """All tests but the stress loops and CI's tier: real torch, transformers and gloo in
    subprocesses."""
    install_torch_stack(session, *MEGATRON)
    install_wheel(session, *TESTS_REQUIREMENTS)
    # Two workers: the tests are subprocess-bound, and each starts its own interpreters, venvs
    # and gloo groups on free ports, so none waits on another.
    session.run("pytest", "-n", "2", *REPORTING, "-m", TESTS_MARKERS, *session.posargs,
                env=test_environment(session))


# What the tests session runs: all but the stress loops and CI's tier (its own session, below).
TESTS_MARKERS = "not stress and not ci_tier"
# What the tests session installs beside the package (build: the packaging tests build the sdist
# and the wheel as a release would; expecttest: torch's own tests import it).
TESTS_REQUIREMENTS = (*TORCH_STACK, *MEGATRON, *requirements("expecttest"), "pytest", "pytest-xdist", "build")


@nox.session(python="3.11", venv_backend="venv", reuse_venv=True)
def module(session: nox.Session) -> None:
    """A contributor's loop: the tests named after ``--`` (``-- tests/test_hooks.py``), in the
    tests session's environment, made on the first run and kept (``tests/.nox/module``), with
    the tests session's markers unless ``-m`` is given (``-- tests/test_ddp.py -m ci_tier``). Each
    run rebuilds and reinstalls only the package's wheel; the pinned requirements are installed
    again only when they change."""
    if not session.posargs:
        session.error("name the tests to run after --, e.g. -- tests/test_hooks.py")
    wheel = package_wheel(session)
    # The package's own dependencies are declared in pyproject.toml: a change there reinstalls too.
    stamp = Path(session.virtualenv.location) / "fsdp-autopatch-requirements.txt"
    wanted = "\n".join((*TESTS_REQUIREMENTS, (ROOT / "pyproject.toml").read_text(encoding="utf-8")))
    if not stamp.is_file() or stamp.read_text(encoding="utf-8") != wanted:
        install_torch_stack(session, *MEGATRON)
        session.install(str(wheel), *TESTS_REQUIREMENTS)
        stamp.write_text(wanted, encoding="utf-8")
    session.run("python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                "--force-reinstall", str(wheel))
    session.chdir(ROOT)
    # The tests session's selection, unless the arguments choose markers themselves.
    markers = () if "-m" in session.posargs else ("-m", TESTS_MARKERS)
    session.run("pytest", "-n", "2", *REPORTING, *markers, *session.posargs, env=test_environment(session))


@nox.session(python="3.11", venv_backend="venv")
def ci_tier(session: nox.Session) -> None:
    """CI's tier (marker ci_tier): what is proven beyond the README's command, such as
    upstream/torch.diff applied to a copy of torch. .ci/run runs it in the tests session's venv."""
    install_torch_stack(session, *MEGATRON)
    install_wheel(session, *TESTS_REQUIREMENTS)
    session.run("pytest", "-n", "2", *REPORTING, "-m", "ci_tier", *session.posargs,
                env=test_environment(session))


@nox.session(python="3.11", venv_backend="venv")
def stress(session: nox.Session) -> None:
    """The stress loops: many racing threads and processes, pip install/upgrade/uninstall cycles."""
    install_torch_stack(session)
    install_wheel(session, "pytest", "pytest-xdist")
    session.run("pytest", "-n", "2", *REPORTING, "-m", "stress", *session.posargs, env=REQUIRE)


@nox.session(python="3.11", venv_backend="venv")
def stacks(session: nox.Session) -> None:
    """accelerate, TRL, PEFT, verl, DCP, meta init and torch.compile around sharded reward models
    and critics, each with the package on and off (tests/stacks/).

    ``-- ci``: only the cases CI runs (marker ``stacks_ci``: accelerate, DCP, torch.compile, Ray).
    ``-- --docs``: write the "Works with" table of docs/works-with.md (only after a run of every
    case; ``--readme`` is its older name).
    """
    args = list(session.posargs)
    env = {**REQUIRE, "FSDP_AUTOPATCH_STACKS": "1"}
    for flag in ("--docs", "--readme"):
        if flag in args:
            args.remove(flag)
            env["FSDP_AUTOPATCH_STACKS_DOCS"] = "1"
    ci = "ci" in args
    if ci:
        args.remove("ci")
        args += ["-m", "stacks_ci"]
    # The CI cases need accelerate and ray only; verl alone brings wandb and tensordict.
    install_torch_stack(session, *requirements(*(("accelerate", "ray") if ci else STACKS_PINS)))
    install_wheel(session, "pytest")
    session.run("pytest", *REPORTING, "tests/stacks", *args, env=env)


def oldest_wrapt() -> str:
    """``wrapt==X`` for the ``wrapt>=X`` pyproject.toml declares: the floor users may get."""
    match = re.search(r'"wrapt>=([0-9][0-9.]*)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    if match is None:
        raise RuntimeError("pyproject.toml declares no wrapt>=X dependency; fix its dependencies")
    return f"wrapt=={match.group(1)}"


@nox.session(python="3.11", venv_backend="venv")
def wrapt_floor(session: nox.Session) -> None:
    """The hooks and every import order on the oldest wrapt allowed (1.14 runs post-import
    hooks under its global lock)."""
    install_torch_stack(session)
    install_wheel(session, "pytest", "pytest-xdist", oldest_wrapt())
    session.run("python", "-c", "import wrapt; print('wrapt', wrapt.__version__)")
    session.run(
        "pytest", "-n", "2", *REPORTING, "-m", "not stress", "tests/test_hooks.py",
        "tests/test_concurrency.py", "tests/test_replicate.py",
        "tests/test_fully_shard.py::test_affected_heads_shard_and_train_like_the_unsharded_model",
        *session.posargs, env=REQUIRE,
    )


@nox.session(python=PYTHONS, venv_backend="venv")
def fast(session: nox.Session) -> None:
    """The tests that need no torch (layout rules, matrix, switches, start-up), per Python."""
    # Two workers: half the wall time is verify's own time-outs and signals being waited
    # for, which overlap with other tests there.
    install_wheel(session, "pytest", "pytest-xdist")
    session.run("pytest", "-n", "2", "-m", "not slow and not stress", *session.posargs, env=REQUIRE)
