"""Helpers shared by the tests, ``tests/matrix.py``, ``tests/noxfile.py`` and ``benchmarks/``.

Standard library only, and importable without pytest, so that every script that builds the
package, makes environments or runs fresh interpreters does it the same way:

- ``TORCH_PIN``, ``TRANSFORMERS_PIN``, ``STACKS_PINS`` and ``requirements``: the versions the test
  sessions install and the benchmarks measure, named here only;
- ``scrubbed_environment``: this process's environment without anything that changes what a
  child interpreter imports;
- ``build_wheel``: the package's wheel, built from the checkout;
- ``make_venv`` / ``venv_layout``: a throwaway virtual environment, and where its parts are;
- ``run_logged``: an install or build step whose output is kept for the error it raises;
- ``torchrun``: a script on local gloo ranks, started by torch's own launcher;
- ``replace_section``: generated text between two markers of README.md or a page of docs/;
- ``split_importtime``: ``python -X importtime`` output, parsed;
- ``json_lines``: the JSON objects a program (or ranks sharing one pipe) printed;
- ``cpython_accepts``: whether CPython lets an instance of one class become another;
- ``portable_path`` / ``portable_command`` / ``portable_text``: paths as a reader of another
  machine can follow them.

(A free TCP port for a gloo rendezvous is the package's own ``fsdp_autopatch._verify.free_port``.)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The record the README links to; each generated section lives in one of these pages.
DOCS = ROOT / "docs"
BUILD_TIMEOUT = 600
# The transformers heads that inherit abc.ABC in the affected releases: every model of
# fsdp_autopatch._verify but its control, the causal LM.
AFFECTED = ("token-classification", "sequence-classification", "question-answering")

# The torch and transformers every test session installs (tests/noxfile.py) and the benchmarks
# measure: a transformers whose heads inherit abc.ABC, so the patch is at work in their
# processes. Version strings elsewhere in tests/ are data (a fake package claiming a release,
# the matrix's cells), not these pins.
TORCH_PIN = "2.13.0"
TRANSFORMERS_PIN = "4.55.2"
# Megatron-FSDP with the experimental fully_shard the package patches (torch, einops, packaging).
MEGATRON_FSDP_PIN = "0.6.1"
# The frameworks tests/stacks/ runs around a sharded model, as the stacks session installs them.
STACKS_PINS = {
    "accelerate": "1.10.1", "trl": "0.21.0", "peft": "0.17.1", "datasets": "5.0.1", "verl": "0.6.1",
    # verl asks for ray[default]>=2.41.0; tests/stacks/test_ray.py runs on this one.
    "ray": "2.60.0",
    # verl pins numpy < 2; pyarrow from 22 on needs numpy 2 at import time (pip does not know).
    "pyarrow": "21.0.0",
}
# What torch's own tests import (upstream/test_wrapper_cls.py, run by tests/test_upstream.py).
EXPECTTEST_PIN = "0.3.0"
_PINS = {"torch": TORCH_PIN, "transformers": TRANSFORMERS_PIN, "megatron-fsdp": MEGATRON_FSDP_PIN,
         "expecttest": EXPECTTEST_PIN, **STACKS_PINS}


def requirements(*names: str) -> tuple[str, ...]:
    """``name==version`` for each of ``names``, at its pin above (torch, transformers or a stack's)."""
    return tuple(f"{name}=={_PINS[name]}" for name in names)


def scrubbed_environment(**overrides: Optional[str]) -> dict[str, str]:
    """This process's environment without the package's switches (``FSDP_AUTOPATCH*``), the
    interpreter's own variables (``PYTHON*``: path, start-up file, flags) and ``VIRTUAL_ENV``,
    plus ``overrides`` (a None value removes the variable)."""
    env = {
        key: value for key, value in os.environ.items()
        if not key.startswith(("FSDP_AUTOPATCH", "PYTHON")) and key != "VIRTUAL_ENV"
    }
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def build_wheel(
    into: Path,
    source: Path = ROOT,
    *,
    python: str = sys.executable,
    uv: Optional[str] = None,
    log: Optional[Path] = None,
) -> Path:
    """Build the package's wheel from ``source`` into ``into`` (older wheels there are removed),
    with ``uv build`` when ``uv`` is given, else ``python -m pip wheel``; returns its path.

    The build backend comes from the index, in an isolated build environment: the network is
    needed unless the installer's cache has it. Output goes to ``log`` when given, else into the
    error raised on failure.
    """
    into.mkdir(parents=True, exist_ok=True)
    for old in into.glob("fsdp_autopatch-*.whl"):
        old.unlink()
    if uv:
        command = [uv, "build", "--wheel", "--out-dir", str(into), str(source)]
    else:
        command = [python, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                   "--wheel-dir", str(into), str(source)]
    run_logged(command, log, env=scrubbed_environment())
    wheels = list(into.glob("fsdp_autopatch-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"{shlex.join(command)} left {len(wheels)} wheels in {into}; expected one")
    return wheels[0]


def run_logged(
    command: list[str], log: Optional[Path], env: Optional[dict[str, str]] = None,
    timeout: float = BUILD_TIMEOUT,
) -> str:
    """Run an install or build step; its output goes to ``log`` (appended) when given and is
    returned; a failure raises RuntimeError with the command and the end of its output."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    output = result.stdout + result.stderr
    if log is not None:
        with log.open("a") as file:
            file.write(f"$ {shlex.join(command)}\n{output}")
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited {result.returncode}:\n{output[-3000:]}")
    return result.stdout


# Ranks of a torchrun job in the tests: two, the fewest across which FSDP2 shards anything.
RANKS = 2


def torchrun(
    script: Path, *args: str, env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on ``RANKS`` local ranks under this interpreter's torch launcher (``-m
    torch.distributed.run --standalone``: it finds a free rendezvous port itself), so each rank
    starts as a user's training process does; returns its captured output once every rank has
    ended. An exit other than 0 raises RuntimeError with the command, the switch and the end of
    both streams (the ranks' tracebacks are on stderr)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               str(script), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout,
                            check=False)
    if result.returncode != 0:
        value = env.get("FSDP_AUTOPATCH")
        switch = "FSDP_AUTOPATCH unset" if value is None else f"FSDP_AUTOPATCH={value}"
        raise RuntimeError(f"{shlex.join(command)} ({switch}) exited {result.returncode}:\n"
                           f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}")
    return result


@dataclass(frozen=True)
class Venv:
    """Where the parts of a virtual environment are."""

    root: Path
    python: Path
    site_packages: Path
    scripts: Path


def venv_layout(root: Path) -> Venv:
    """The parts of the venv at ``root``, whatever Python it was made with."""
    scripts = root / ("Scripts" if sys.platform == "win32" else "bin")
    python = scripts / ("python.exe" if sys.platform == "win32" else "python")
    if sys.platform == "win32":
        site_packages = root / "Lib" / "site-packages"
    else:
        # One lib/pythonX.Y per venv; its version is the base interpreter's, maybe not this one's.
        found = sorted((root / "lib").glob("python3*/site-packages"))
        site_packages = found[0] if found else Path(sysconfig.get_paths(vars={"base": str(root)})["purelib"])
    return Venv(root, python, site_packages, scripts)


def make_venv(root: Path, *, with_pip: bool = False, base_python: str = sys.executable) -> Venv:
    """A new virtual environment at ``root`` made by ``base_python``.

    Without pip by default: pip and setuptools bring start-up files and modules of their own,
    which would blur what start-up costs; fill it with ``pip --python`` from outside instead.
    """
    command = [base_python, "-m", "venv", *(() if with_pip else ("--without-pip",)), str(root)]
    run_logged(command, None, env=scrubbed_environment())
    venv = venv_layout(root)
    if not (venv.python.exists() and venv.site_packages.is_dir()):
        raise RuntimeError(f"unexpected venv layout under {root}: no {venv.python} or {venv.site_packages}")
    return venv


def replace_section(start_marker: str, end_marker: str, text: str, document: Path = README) -> bool:
    """Put ``text`` between ``start_marker`` and ``end_marker`` in ``document`` (README.md or a
    page of docs/); False, with one line on stderr and the file untouched, when either marker is
    missing or they are out of order."""
    content = document.read_text(encoding="utf-8") if document.is_file() else ""
    start, end = content.find(start_marker), content.find(end_marker)
    if start < 0 or end < start:
        print(f"{document.name} has no {start_marker} ... {end_marker} markers; left it unchanged; "
              "add both markers where the generated text belongs", file=sys.stderr)
        return False
    head = content[: start + len(start_marker)]
    document.write_text(f"{head}\n{text.strip()}\n{content[end:]}", encoding="utf-8")
    return True


# "import time: self [us] | cumulative | imported package", one line per module imported; the
# header line ("import time: self [us] | cumulative | imported package") has no numbers.
_IMPORTTIME_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|\s*(\S+)\s*$")


def split_importtime(stderr: str) -> tuple[dict[str, int], list[str]]:
    """Parse ``python -X importtime`` output: self import time in microseconds per module
    imported, and every other line of ``stderr`` (what the program itself printed there)."""
    times: dict[str, int] = {}
    others: list[str] = []
    for line in stderr.splitlines():
        match = _IMPORTTIME_LINE.match(line)
        if match:
            times[match.group(3)] = int(match.group(1))
        elif not line.startswith("import time:"):
            others.append(line)
    return times, others


def _venv_root(path: Path) -> Optional[Path]:
    for parent in path.parents:
        if (parent / "pyvenv.cfg").is_file():
            return parent
    if not path.exists():
        # A path of another machine (a captured log): judged by its shape, bin/ or lib/pythonX.Y/.
        parts = path.parts
        for index in range(len(parts) - 1, 0, -1):
            if parts[index] == "bin" or (parts[index] == "lib" and index + 1 < len(parts)
                                          and parts[index + 1].startswith("python3")):
                return Path(*parts[:index])
    return None


def portable_path(path: str, root: Path = ROOT) -> str:
    """``path`` as a reader elsewhere can follow it: relative when under the checkout, as
    ``.venv/...`` when inside a virtual environment, else its last part (``python3``).
    Anything that is not an absolute path is returned unchanged."""
    if not os.path.isabs(path):
        return path
    # abspath, not resolve(): a venv's python is a symlink to an interpreter outside the venv.
    absolute = Path(os.path.abspath(path))
    if absolute == root or root in absolute.parents:
        return absolute.relative_to(root).as_posix() or "."
    venv = _venv_root(absolute)
    if venv is not None:
        return (Path(".venv") / absolute.relative_to(venv)).as_posix()
    return absolute.name


def portable_command(argv: Iterable[str], root: Path = ROOT) -> str:
    """A command line with every absolute path in it made portable (see ``portable_path``);
    ``--option=/abs/path`` forms included."""
    words = []
    for word in argv:
        option, equals, value = word.partition("=")
        if equals and option.startswith("-"):
            words.append(f"{option}={portable_path(value, root)}")
        else:
            words.append(portable_path(word, root))
    return shlex.join(words)


# An absolute POSIX path inside text: starts at a "/" that does not follow a word character. A
# directory's name may hold single spaces between its words ("/tmp/déjà vu/checkout"); the last
# part may not, since text goes on after a path with a space.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:[\w.+@-]+(?: [\w.+@-]+)*/)*[\w.+@-]+")


def portable_text(text: str, root: Path = ROOT) -> str:
    """``text`` (captured output, a header) with every absolute path in it made portable."""
    return _ABSOLUTE_PATH.sub(lambda match: portable_path(match.group(0), root), text)


def json_lines(output: str) -> list[dict[str, Any]]:
    """The JSON objects printed one per line, skipping whatever else was printed. Ranks that share
    one pipe (under a launcher) can put two objects on one line ("{...}{...}"): every object that
    starts a line or follows another is read."""
    decoder = json.JSONDecoder()
    objects = []
    for line in output.splitlines():
        position = 0
        while line.startswith("{", position):
            try:
                found, position = decoder.raw_decode(line, position)
            except ValueError:
                break
            if isinstance(found, dict):
                objects.append(found)
    return objects


def cpython_accepts(cls: type, new: type) -> bool:
    """Whether CPython's ``__class__`` assignment lets an instance of ``cls`` become a ``new``
    (its layout check), asked on an object made without running either class's ``__init__``."""
    instance = object.__new__(cls)
    try:
        instance.__class__ = new
    except TypeError:
        return False
    return True
