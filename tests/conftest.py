"""Shared test helpers: fresh interpreters of the environment under test, and what they print.

Claims about start-up and about fully_shard are checked in fresh subprocesses of
``sys.executable``, so the installed ``fsdp_autopatch.pth`` is what runs, exactly as for a user.
``nox -f tests/noxfile.py -s tests`` builds that environment: the package from a wheel, torch
(CPU) and transformers at their pins (``harness.TORCH_PIN``, ``harness.TRANSFORMERS_PIN``).
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import pytest
from harness import AFFECTED, build_wheel, json_lines, make_venv, scrubbed_environment

from fsdp_autopatch._verify import LAYOUT_ERROR

__all__ = [
    "AFFECTED",
    "LAYOUT_ERROR",
    "PLUGIN_MODULE",
    "REPOSITORY_ONLY",
    "ROOT",
    "SCENARIO",
    "STAND_IN",
    "Throwaway",
    "abc_swap_refused",
    "alive",
    "assert_trains_like_unsharded",
    "ci_tier",
    "command_line",
    "ctrl_c_as_at_a_terminal",
    "environment",
    "fake_torch",
    "fake_transformers",
    "json_lines",
    "layout_bug_here",
    "lent_site_packages",
    "make_throwaway",
    "marked_run",
    "needs_proc",
    "own_lines",
    "pip_in",
    "processes_marked",
    "repository_file",
    "run_program",
    "run_python",
    "run_scenario",
    "shard_abc_head",
    "site_packages",
    "write_module",
]

# "still running <test> (N s)" lines while a long test runs (tests/progress.py); the stress
# mark, which keeps the longest loops out of the default session (tests/stress.py).
pytest_plugins = ["progress", "stress"]

ROOT = Path(__file__).resolve().parent.parent
# The programs the tests run (tests/programs/README.md); two of their helpers the tests import too.
PROGRAMS = ROOT / "tests" / "programs"
sys.path.insert(0, str(PROGRAMS))
SCENARIO = PROGRAMS / "scenario.py"
# Set by the nox sessions: a missing prerequisite there is a failure, not a skip.
REQUIRE_VARIABLE = "FSDP_AUTOPATCH_TEST_REQUIRE"
# Every process the suite starts carries this variable: it is set here, in the process that
# runs pytest (xdist's workers inherit it), and every child's environment is this one's. What
# still carries it when the session ends was left behind by a test (pytest_sessionfinish).
SESSION_MARKER_VARIABLE = "AUTOPATCH_TESTS_SESSION"
if not os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ[SESSION_MARKER_VARIABLE] = uuid.uuid4().hex
SESSION_MARKER = f"{SESSION_MARKER_VARIABLE}={os.environ.get(SESSION_MARKER_VARIABLE)}".encode()
LEFT_RUNNING: list[str] = []  # what the check at the end found, for the terminal summary
# The package's own lines on stderr, told by their start: "fsdp-autopatch: ..." (a switch it
# ignores), "fsdp-autopatch WARNING: ..." (its log), "fsdp-autopatch verify: ..." (the command).
# Never a substring anywhere: a checkout's path, which others' warnings print, may hold the name.
OWN_LINE = re.compile(r"fsdp-autopatch(?: [A-Za-z]+)?: ")


# Every child interpreter starts from this process's environment less anything that changes
# what it imports; the one scrubber, shared with tests/matrix.py and benchmarks/.
environment = scrubbed_environment
# The wheel the nox session built and installed (tests/noxfile.py), for the tests that install
# the package elsewhere: one wheel per session.
WHEEL_VARIABLE = "FSDP_AUTOPATCH_TEST_WHEEL"


def ci_tier(*values: Any) -> list[Any]:
    """Parameters whose cases run in CI's tier only (marker ci_tier): the same claim is proven in
    the README's tests by the parameters left unmarked."""
    return [pytest.param(value, marks=pytest.mark.ci_tier) for value in values]


# The module of torch's plugin entry point, installed at the root of site-packages.
PLUGIN_MODULE = "_fsdp_autopatch_plugin.py"
# What this environment's site-packages lends a directory or venv without the package: everything
# but the package under test (with its plugin module), pip and start-up files.
NOT_LENT = re.compile(
    r"^(fsdp_autopatch|fsdp-autopatch|_fsdp_autopatch_plugin|pip|_distutils_hack|__pycache__)([-._]|$)|\.pth$",
    re.I)


def lent_site_packages(where: Path) -> Path:
    """A directory of links to this environment's site-packages, less what ``NOT_LENT`` names."""
    site_packages = Path(sysconfig.get_paths()["purelib"])
    where.mkdir()
    for entry in site_packages.iterdir():
        if not NOT_LENT.search(entry.name):
            (where / entry.name).symlink_to(entry)
    return where


# What the repository has and the sdist does not ship: CI, the workflows, raw benchmark results.
REPOSITORY_ONLY = (".ci/", ".github/", "benchmarks/results/results.json")


def repository_file(relative: str) -> Path:
    """``ROOT / relative``, for a file only the repository has; the test is skipped, naming the
    file, where it is missing (the tests run from an extracted sdist)."""
    assert relative.startswith(REPOSITORY_ONLY), f"{relative} ships in the sdist: read it directly"
    path = ROOT / relative
    if not path.exists():
        pytest.skip(f"needs {relative}, which the repository has and the sdist does not ship")
    return path


def _run(
    command: list[str], request: dict[str, Any], flags: tuple[str, ...], env: Optional[dict[str, str]],
    python: str, cwd: Optional[Path], timeout: float, prepared: bool,
) -> subprocess.CompletedProcess[str]:
    """``python *flags *command`` in a fresh interpreter away from the checkout, or ``request`` in
    a child of the prepared interpreter for ``env`` (tests/programs/prepared.py)."""
    env = environment() if env is None else env
    cwd = cwd or site_packages().parent
    if prepared:
        assert not flags and python == sys.executable, "a prepared interpreter takes no flags"
        return prepared_interpreter(env).run(request, env, cwd, timeout)
    return subprocess.run([python, *flags, *command], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, check=False)


def run_python(
    code: str = "pass",
    *flags: str,
    env: Optional[dict[str, str]] = None,
    python: str = sys.executable,
    cwd: Optional[Path] = None,
    timeout: float = 600,
    prepared: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (``python *flags -c code``) away from the checkout;
    ``prepared``: in a child of the prepared interpreter for ``env`` instead (tests/programs/prepared.py)."""
    code = textwrap.dedent(code)
    return _run(["-c", code], {"code": code, "args": []}, flags, env, python, cwd, timeout, prepared)


def run_program(
    program: Path, *args: str, flags: tuple[str, ...] = (), env: Optional[dict[str, str]] = None,
    timeout: float = 600, prepared: bool = False, check: bool = True, python: str = sys.executable,
) -> subprocess.CompletedProcess[str]:
    """Run a program file of tests/ (``python *flags program *args``) in a fresh interpreter of
    this environment (or ``python``), away from the checkout, or, ``prepared``, in a child of the
    prepared interpreter for ``env``; fail with its stderr if it fails (unless not ``check``)."""
    result = _run([str(program), *args], {"program": str(program), "args": list(args)}, flags, env,
                  python, None, timeout, prepared)
    assert not check or result.returncode == 0, (f"{program.name} {args} exited {result.returncode}:\n"
                                                 f"{result.stderr[-4000:]}")
    return result


def run_scenario(
    *args: str, env: Optional[dict[str, str]] = None, timeout: float = 600, prepared: bool = False
) -> list[dict[str, Any]]:
    """Run tests/programs/scenario.py in a fresh interpreter (or a prepared one's child); its JSON lines."""
    return json_lines(run_program(SCENARIO, *args, env=env, timeout=timeout, prepared=prepared).stdout)


# --- prepared interpreters ---------------------------------------------------------------------

PREPARED = PROGRAMS / "prepared.py"


class PreparedInterpreter:
    """tests/programs/prepared.py, started with one environment: torch's wrappers and transformers
    imported once, a forked child per case. Its own stderr (a failed start) goes to a file."""

    def __init__(self, env: dict[str, str]) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="fsdp-autopatch-prepared-"))
        self.replies, reply_end = os.pipe()
        self.log = (self.scratch / "prepared.err").open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(PREPARED), str(reply_end)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=env,
            cwd=site_packages().parent, pass_fds=(reply_end,),
        )
        os.close(reply_end)
        self.pending = b""
        self.cases = 0
        assert self.next_reply(600).get("ready"), "the prepared interpreter did not get ready"

    def next_reply(self, timeout: float) -> dict[str, Any]:
        """The next JSON line it sends, within ``timeout`` seconds (TimeoutError if not)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.replies], [], [], left)[0]:
                raise TimeoutError(f"no reply from the prepared interpreter in {timeout} s")
            chunk = os.read(self.replies, 65536)
            if not chunk:
                self.process.wait(timeout=60)
                raise RuntimeError("the prepared interpreter exited "
                                   f"{self.process.returncode}: {self.errors()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def errors(self) -> str:
        return (self.scratch / "prepared.err").read_text(errors="replace")[-4000:]

    def run(self, request: dict[str, Any], env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """One case in a forked child: what ``subprocess.run`` would return for it."""
        self.cases += 1
        out, err = self.scratch / f"{self.cases}.out", self.scratch / f"{self.cases}.err"
        request = dict(request, env=env, cwd=str(cwd), stdout=str(out), stderr=str(err))
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        described = [request.get("program", "-c"), *request["args"]]
        pid = self.next_reply(60)["pid"]
        try:
            returncode = self.next_reply(timeout)["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self.next_reply(60)
            raise subprocess.TimeoutExpired(described, timeout) from None
        result = subprocess.CompletedProcess(
            described, returncode, out.read_text(errors="replace"), err.read_text(errors="replace"))
        out.unlink()
        err.unlink()
        return result

    def close(self) -> None:
        """End it (stdin at its end ends it) and wait for it."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self.replies)
        self.log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


_prepared: dict[frozenset[tuple[str, str]], PreparedInterpreter] = {}
# Each holds torch and transformers in memory (about 0.5 GB); a test process keeps this many.
PREPARED_LIMIT = 4


def prepared_interpreter(env: dict[str, str]) -> PreparedInterpreter:
    """This process's prepared interpreter for ``env``, started on first use."""
    # pytest names the running test in the environment: a variable nothing reads at start-up
    # (the case's child gets the current value).
    key = frozenset((name, value) for name, value in env.items() if name != "PYTEST_CURRENT_TEST")
    if key not in _prepared:
        while len(_prepared) >= PREPARED_LIMIT:  # the least recently started goes: memory
            _prepared.pop(next(iter(_prepared))).close()
        _prepared[key] = PreparedInterpreter(env)
    return _prepared[key]


def close_prepared_interpreters() -> None:
    while _prepared:
        _prepared.popitem()[1].close()


SHARD_ABC_HEAD = PROGRAMS / "shard_abc_head.py"


def shard_abc_head(
    *flags: str, calls: Optional[str] = None, finder: Optional[str] = None, prepared: bool = False,
    **env: Optional[str],
) -> dict[str, Any]:
    """tests/programs/shard_abc_head.py (``--calls``, ``--finder``) in a fresh interpreter with ``flags``,
    or, ``prepared``, in a prepared one's child: the status before and after, and the error."""
    assert not (prepared and finder), "the finder goes in before the imports: it needs a fresh interpreter"
    args = [*(("--calls", calls) if calls else ()), *(("--finder", finder) if finder else ())]
    result = run_program(SHARD_ABC_HEAD, *args, flags=flags, env=environment(**env), prepared=prepared)
    (report,) = json_lines(result.stdout)
    return report


def assert_trains_like_unsharded(result: dict[str, Any]) -> None:
    """A run of fsdp_autopatch._verify.shard_and_train that sharded (FSDP2) and trained as the
    unsharded copy did."""
    assert result["sharded"], result.get("error")
    assert result["is_fsdp_module"] and result["original_at_mro_2"]
    assert result["layer_wrapper"] == "FSDPQwen2DecoderLayer"
    assert len(result["losses"]) == 2
    assert result["max_loss_difference"] < 1e-5, (result["losses"], result["reference_losses"])


def delegating_finder(position: str) -> str:
    """Code that puts tests/programs/delegating_finder.py's finder "ahead" of the start-up watcher or
    "behind" it, before anything else is imported."""
    return (f"import sys; sys.path.insert(0, {str(ROOT / 'tests' / 'programs')!r})\n"
            f"import delegating_finder; delegating_finder.install({position!r})\n")


# --- throwaway environments --------------------------------------------------------------------


@dataclass(frozen=True)
class Throwaway:
    """A venv without pip whose site-packages holds only what a test put there."""

    root: Path
    python: Path
    site_packages: Path

    def run(
        self, code: str = "pass", *flags: str, **variables: Optional[str]
    ) -> subprocess.CompletedProcess[str]:
        return run_python(code, *flags, env=environment(**variables), python=str(self.python))

    def run_program(
        self, program: Path, *args: str, **variables: Optional[str]
    ) -> subprocess.CompletedProcess[str]:
        """A program file of tests/ in a fresh interpreter of this venv (its exit not checked)."""
        return run_program(program, *args, env=environment(**variables), python=str(self.python),
                           check=False)


def make_throwaway(
    root: Path, installed: Path, *, package: bool = True, pth: bool = True, wrapt: bool = True,
    plugin: bool = True,
) -> Throwaway:
    """A venv holding copies of what ``installed`` has: the package (with its dist-info), its
    start-up files, torch's plugin module, wrapt; each can be left out to make a broken
    environment."""
    venv = make_venv(root)
    site_packages, python = venv.site_packages, venv.python
    # copytree keeps modification times, so the copied bytecode stays valid.
    if package:
        package_dir = installed / "fsdp_autopatch"
        if not package_dir.is_dir():  # an editable install: the package is the checkout's
            package_dir = ROOT / "fsdp_autopatch"
        shutil.copytree(package_dir, site_packages / "fsdp_autopatch")
        (dist_info,) = installed.glob("fsdp_autopatch-*.dist-info")
        shutil.copytree(dist_info, site_packages / dist_info.name)
    if pth:
        for name in ("fsdp_autopatch.pth", "fsdp_autopatch.start"):
            shutil.copy2(installed / name, site_packages / name)
    if plugin:
        plugin_module = installed / PLUGIN_MODULE
        if not plugin_module.is_file():  # an editable install: the checkout's
            plugin_module = ROOT / PLUGIN_MODULE
        shutil.copy2(plugin_module, site_packages / PLUGIN_MODULE)
    if wrapt:
        shutil.copytree(installed / "wrapt", site_packages / "wrapt")
    return Throwaway(root, python, site_packages)


def write_module(where: Path, dotted: str, source: str) -> None:
    """Write ``dotted`` as a package (every part a directory with an ``__init__.py``)."""
    folder = where.joinpath(*dotted.split("."))
    folder.mkdir(parents=True, exist_ok=True)
    parent = folder
    while parent != where:
        (parent / "__init__.py").touch()
        parent = parent.parent
    (folder / "__init__.py").write_text(textwrap.dedent(source))


# What torch 2.5+ does last in ``import torch`` (``_import_device_backends``): load and call every
# entry point of the group torch.backends, a failure of any one failing the import.
TORCH_PLUGIN_LOOP = """
import os
from importlib.metadata import entry_points
if os.getenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1":
    found = entry_points()  # torch 2.5+ needs Python 3.10+'s select(); the fake runs on 3.9 too
    name = "torch.backends"
    group = found.select(group=name) if hasattr(found, "select") else found.get(name, ())
    for backend_extension in group:
        try:
            backend_extension.load()()
        except Exception as err:
            raise RuntimeError(f"Failed to load the backend extension: {backend_extension.name}. "
                               "You can disable extension auto-loading with "
                               "TORCH_DEVICE_BACKEND_AUTOLOAD=0.") from err
"""


STAND_IN = ROOT / "tests" / "stand_in"


def fake_torch(where: Path, plugins: bool = False, version: str = "2.13.0") -> None:
    """The stand-in torch of tests/stand_in/ (torch's names, sites built as torch 2.13 builds them,
    milliseconds to import) copied into ``where``. ``plugins``: its ``import torch`` ends as torch
    2.5+'s does, calling the torch.backends entry points."""
    shutil.copytree(STAND_IN / "torch", where / "torch", ignore=shutil.ignore_patterns("__pycache__"),
                    dirs_exist_ok=True)
    source = f'__version__ = "{version}"\n' + (TORCH_PLUGIN_LOOP if plugins else "")
    (where / "torch" / "__init__.py").write_text(source)
    installed_as(where, "torch", version)


def fake_transformers(where: Path, source: Optional[str] = None, version: str = "4.55.2") -> None:
    """The stand-in transformers 4.55.2 of tests/stand_in/ (or a package of ``source``)."""
    shutil.copytree(STAND_IN / "transformers", where / "transformers",
                    ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    if source is not None:
        (where / "transformers" / "__init__.py").write_text(textwrap.dedent(source))
    installed_as(where, "transformers", version)


def installed_as(where: Path, name: str, version: str) -> None:
    """The installed metadata of a stand-in, as pip writes it (one distribution of each name)."""
    for old in where.glob(f"{name}-*.dist-info"):
        shutil.rmtree(old)
    dist_info = where / f"{name}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _missing(what: str) -> None:
    if os.environ.get(REQUIRE_VARIABLE):
        pytest.fail(f"{what}; this session requires it")
    pytest.skip(f"{what}; run the tests with: nox -f tests/noxfile.py -s tests")


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def ctrl_c_as_at_a_terminal() -> None:
    """For ``preexec_fn``: SIGINT back to its default in the child, as in a terminal's foreground
    job. A script's background job (``nox ... &``) starts with SIGINT ignored, and verify, as
    Python does, leaves a signal its parent ignores ignored: a Ctrl-C test would wait forever."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def verify_at_work(env: dict[str, str], stdout: Any = subprocess.PIPE, **popen: Any) -> subprocess.Popen[str]:
    """A real ``verify --nproc 2``, returned once rank 0 has printed the patch's status: the
    ranks are at work, so a signal sent now meets verify, torchrun and ranks all running."""
    process = subprocess.Popen([sys.executable, "-m", "fsdp_autopatch", "verify", "--nproc", "2"],
                               stdout=stdout, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=site_packages().parent, preexec_fn=ctrl_c_as_at_a_terminal, **popen)
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("patch "):
            break
    return process


def pip_in(python: str | Path, arguments: str) -> str:
    """The pip command a remedy names, printed by the interpreter ``python``: that interpreter's
    pip, never a bare ``pip`` (``_config.pip_command``)."""
    return f"{shlex.quote(str(python))} -m pip {arguments}"


def own_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` the package printed (OWN_LINE)."""
    return [line for line in stderr.splitlines() if OWN_LINE.match(line)]


def marked_run() -> tuple[bytes, dict[str, str]]:
    """An environment carrying a marker of its own, to find every process started with it."""
    marker = f"CLI_TEST_RUN={uuid.uuid4()}"
    key, value = marker.split("=")
    return marker.encode(), environment(**{key: value})


def processes_marked(marker: bytes) -> list[str]:
    """The live processes whose environment holds ``marker`` (``KEY=value``), this one aside;
    a zombie's environment is empty."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and int(entry.name) != os.getpid()
                    and marker in (entry / "environ").read_bytes().split(b"\0")):
                found.append(entry.name)
        except OSError:  # gone, or not ours
            pass
    return found


def alive(pid: int) -> bool:
    """Running: a zombie (dead, not yet reaped by whoever inherited it) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:  # the state follows the command's closing parenthesis
        return not stat.is_file() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # gone meanwhile
        return False


# For the tests that look for leftover processes through /proc/<pid>/environ.
needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").is_file(),
                                reason="finds leftover processes through /proc")


def command_line(pid: str) -> str:
    try:
        return (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """End this process's prepared interpreters; then fail the run when a process a test started
    is still running, and kill it by its id.

    Checked in the process that made the session's marker, last: under xdist, the controller,
    once its workers (which carry the marker too, and have ended their prepared interpreters)
    are gone; whatever a worker's tests started carries it as well."""
    close_prepared_interpreters()
    if os.environ.get("PYTEST_XDIST_WORKER") or not Path("/proc/self/environ").is_file():
        return
    left = {pid: command_line(pid) for pid in processes_marked(SESSION_MARKER)}
    if not left:
        return
    for pid in left:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:  # gone since
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    described = "; ".join(f"{pid}: {line}" for pid, line in left.items())
    LEFT_RUNNING.append(f"{len(left)} process(es) started by the tests still ran at the end and were killed; "
                        f"find the test that left them: {described}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What pytest_sessionfinish found, in the summary ahead of the counts."""
    if LEFT_RUNNING:
        terminalreporter.write_sep("=", "processes left running", red=True)
        for line in LEFT_RUNNING:
            terminalreporter.write_line(line, red=True)


@pytest.fixture(scope="session")
def installed() -> Path:
    """site-packages of this interpreter, holding an installed (not source) fsdp_autopatch."""
    where = site_packages()
    if not (where / "fsdp_autopatch.pth").is_file():
        _missing(f"fsdp_autopatch.pth is not installed in {where}")
    return where


@pytest.fixture(scope="session")
def real_torch(installed: Path) -> dict[str, str]:
    """torch and transformers versions of the environment (read without importing them)."""
    versions = {}
    for package in ("torch", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            _missing(f"{package} is not installed")
    return versions


PROBE_LAYOUT_BUG = PROGRAMS / "probe_layout_bug.py"
_layout_bug: list[bool] = []


def layout_bug_here() -> bool:
    """Does this environment's torch, on this Python, hit the layout error for an ABC module
    without the patch? Asked once per session of the package's probe, on real torch.

    Tests that expect "the layout error without the patch" branch on it: where it is False
    (CPython 3.15+ accepts the ABC swap) they check that the patch stands aside instead.
    """
    if not _layout_bug:
        try:
            metadata.version("torch")
        except metadata.PackageNotFoundError:
            _missing("torch is not installed")
        result = run_program(PROBE_LAYOUT_BUG, env=environment(FSDP_AUTOPATCH="0"), prepared=True)
        (line,) = json_lines(result.stdout)
        answer = line["bug"]
        assert isinstance(answer, bool), f"the layout probe cannot tell here: {result.stdout!r}"
        _layout_bug.append(answer)
    return _layout_bug[0]


@pytest.fixture(scope="session")
def layout_bug(real_torch: dict[str, str]) -> bool:
    """``layout_bug_here()`` as a fixture."""
    return layout_bug_here()


@pytest.fixture(scope="session")
def package_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's wheel: the one the test session installed, else one built here, once."""
    given = os.environ.get(WHEEL_VARIABLE)
    if given and Path(given).is_file():
        return Path(given)
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def abc_swap_refused() -> bool:
    """Does this CPython refuse to swap an ABC module's class for ``(Wrapper, cls)`` (3.9 - 3.14),
    as the package's probe asks it (a ``class (ABC)``, the layout of ``class (ABC, nn.Module)``)?
    For the tests that need no torch; layout_bug_here() asks real torch."""
    import abc

    module = object.__new__(type("Head", (abc.ABC,), {}))
    try:
        module.__class__ = type("WrappedHead", (type("Wrapper", (), {}), type(module)), {})
    except TypeError:
        return True
    return False
