"""Test sessions, each in its own virtual environment under tests/.nox/.

    nox -f tests/noxfile.py -s tests      # everything, against torch 2.13.0 + transformers 4.55.2
    nox -f tests/noxfile.py -s fast       # the tests that need no torch, on Python 3.9 - 3.13

The package is always installed from a freshly built wheel, never from the checkout, so the
tests see what users install: the .pth at the root of site-packages included.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent.parent
PYTHONS = ["3.9", "3.10", "3.11", "3.12", "3.13"]
# torch 2.13.0 is the CPU wheel on this machine kind's local disk; pip finds it, uv does not.
TORCH = "torch==2.13.0"
TRANSFORMERS = "transformers==4.55.2"
REQUIRE = {"FSDP_AUTOPATCH_TEST_REQUIRE": "1"}

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = False


def install_wheel(session: nox.Session, *requirements: str) -> None:
    """Build the package's wheel and install it with ``requirements`` into the session."""
    dist = Path(session.create_tmp()) / "dist"
    for old in dist.glob("*.whl"):
        old.unlink()
    session.run("python", "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), str(ROOT))
    (wheel,) = dist.glob("fsdp_autopatch-*.whl")
    session.install(str(wheel), *requirements)
    # From the checkout's root, where test paths given after "--" are meant; pytest puts tests/
    # (not the root) on sys.path, so the package under test is the installed wheel.
    session.chdir(ROOT)


@nox.session(python="3.11", venv_backend="venv")
def tests(session: nox.Session) -> None:
    """All tests, slow ones included: real torch, transformers and gloo in subprocesses."""
    install_wheel(session, TORCH, TRANSFORMERS, "pytest")
    session.run("pytest", *session.posargs, env=REQUIRE)


@nox.session(python=PYTHONS, venv_backend="venv")
def fast(session: nox.Session) -> None:
    """The tests that need no torch (layout rules, matrix, switches, start-up), per Python."""
    install_wheel(session, "pytest")
    session.run("pytest", "-m", "not slow", *session.posargs, env=REQUIRE)
