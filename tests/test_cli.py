"""The command line, run as users run it: ``fsdp-autopatch`` and ``python -m fsdp_autopatch`` in fresh
interpreters of the installed package, one test per exit code and per JSON contract.

Tests that need torch and transformers installed are marked slow, as in the rest of the suite, even
those that only read their metadata. Environments without torch are real virtual environments
holding a copy of the installed package; the one "without torch.distributed" holds a minimal torch
that reports exactly that.
"""

from __future__ import annotations

import io
import os
import platform
import re
import signal
import subprocess
import sys
import sysconfig
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Optional

import pytest
from conftest import (
    LAYOUT_ERROR,
    PROGRAMS,
    environment,
    json_lines,
    layout_bug_here,
    make_throwaway,
    marked_run,
    needs_proc,
    pip_in,
    processes_marked,
    site_packages,
    verify_at_work,
)
from harness import AFFECTED, split_importtime
from verify_output import HEAD_CLASSES

import fsdp_autopatch
from fsdp_autopatch import _config, _console, _matrix, _sites, _verify
from fsdp_autopatch._console import installed_version

SCRIPT = Path(sysconfig.get_path("scripts")) / ("fsdp-autopatch.exe" if os.name == "nt" else "fsdp-autopatch")
DOCTOR_KEYS = {"version", "python", "executable", "installation", "torch", "transformers", "wrapt",
               "mode", "in_matrix", "reason", "sites", "would_apply", "pth_installed", "start_installed",
               "startup_file", "startup_read", "plugin_arms", "arms_by", "armed_by", "startup_error", "facts",
               "problems", "unknowns", "outcome", "verdict", "exit_code"}
PROOF = "Proof: fsdp-autopatch verify"
FIXED = f"OK: the patch will fix the bug in every process of this Python. {PROOF}"
VERIFY_KEYS = {"exit_code", "ok", "verdict", "warning", "version", "python", "torch", "transformers", "nproc",
               "status", "models", "ranks", "timed_out", "seconds"}


def run_cli(
    *args: str,
    env: Optional[dict[str, str]] = None,
    command: Optional[list[str]] = None,
    timeout: float = 600,
    **popen: object,
) -> subprocess.CompletedProcess[str]:
    """``python -m fsdp_autopatch *args`` (or ``command *args``), run away from the checkout."""
    return subprocess.run(
        [*(command or [sys.executable, "-m", "fsdp_autopatch"]), *args],
        capture_output=True, text=True, env=environment() if env is None else env,
        cwd=site_packages().parent, timeout=timeout, check=False, **popen,  # type: ignore[arg-type]
    )


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def one_object(output: str) -> dict[str, object]:
    (document,) = json_lines(output)
    return document


def imported_packages(importtime_log: str) -> set[str]:
    """Top-level packages named in ``python -X importtime`` output."""
    return {name.split(".")[0] for name in split_importtime(importtime_log)[0]}


def add_distribution(site_packages: Path, name: str, version: str, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = site_packages / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    dist_info = site_packages / f"{name}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture(scope="module")
def without_torch(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The python of an environment with fsdp-autopatch and neither torch, transformers nor wrapt."""
    venv = tmp_path_factory.mktemp("without-torch") / "venv"
    return str(make_throwaway(venv, installed, wrapt=False).python)


@pytest.fixture(scope="module")
def without_distributed(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The python of an environment whose torch 2.13.0 was built without torch.distributed (as
    ``USE_DISTRIBUTED=0`` builds are), with transformers 4.55.2 and no wrapt."""
    venv = tmp_path_factory.mktemp("without-distributed") / "venv"
    throwaway = make_throwaway(venv, installed, wrapt=False)
    site_packages = throwaway.site_packages
    add_distribution(site_packages, "torch", "2.13.0", {
        "torch/__init__.py": '__version__ = "2.13.0"\n',
        "torch/distributed/__init__.py": "def is_available() -> bool:\n    return False\n",
    })
    add_distribution(site_packages, "transformers", "4.55.2",
                     {"transformers/__init__.py": '__version__ = "4.55.2"\n'})
    return str(throwaway.python)


# --------------------------------------------------------------------------------------------- entry points


@pytest.mark.parametrize("entry", ["script", "module"])
def test_help_and_version_on_both_entry_points(installed: Path, entry: str) -> None:
    command = [str(SCRIPT)] if entry == "script" else [sys.executable, "-m", "fsdp_autopatch"]
    if entry == "script" and not SCRIPT.is_file():
        pytest.fail(f"the console script is not installed at {SCRIPT}")
    shown = run_cli("--help", command=command)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: fsdp-autopatch ")
    for text in ("doctor", "verify", "--quiet", "--version", _console.DOCKERFILE_LINE):
        assert text in shown.stdout
    for sub in ("doctor", "verify"):
        sub_help = run_cli(sub, "--help", command=command)
        assert sub_help.returncode == 0 and "--json" in sub_help.stdout, sub_help.stderr
        assert "exit codes (the verdict):" in sub_help.stdout
    version = run_cli("--version", command=command)
    expected = f"fsdp-autopatch {metadata.version('fsdp-autopatch')}\n"
    assert (version.returncode, version.stdout) == (0, expected)


@pytest.mark.parametrize("args", [(), ("verify", "--nproc", "0"), ("doctor", "--no-such-option")])
def test_usage_errors_exit_2_with_one_line_saying_what_to_do(installed: Path, args: tuple[str, ...]) -> None:
    result = run_cli(*args)
    assert result.returncode == 2 and result.stdout == ""
    # argparse's "fsdp-autopatch verify: error: ..." or our own "fsdp-autopatch: choose ..."
    assert last_line(result.stderr).startswith("fsdp-autopatch") and ": " in last_line(result.stderr)
    if not args:
        assert "choose a command: doctor" in result.stderr


# --------------------------------------------------------------------------------------------- doctor


@pytest.mark.slow
def test_doctor_json_reports_the_environment_without_importing_torch(
    installed: Path, real_torch: dict[str, str]
) -> None:
    result = run_cli("-X", "importtime", "-m", "fsdp_autopatch", "doctor", "--json", command=[sys.executable])
    assert result.returncode == 0, result.stderr
    loaded = imported_packages(result.stderr)
    assert "fsdp_autopatch" in loaded and "wrapt" in loaded
    assert not loaded & {"torch", "transformers"}
    report = one_object(result.stdout)
    assert DOCTOR_KEYS <= set(report)
    assert report["version"] == metadata.version("fsdp-autopatch")
    assert report["python"] == platform.python_version()
    assert (report["torch"], report["transformers"]) == (real_torch["torch"], real_torch["transformers"])
    bug = layout_bug_here()  # the matrix doctor answers from agrees with the probe
    assert (report["mode"], report["in_matrix"], report["would_apply"]) == ("auto", bug, bug)
    for site in report["sites"]:  # type: ignore[attr-defined]
        # Every API whose distribution is installed, at a release that has it, is known; another
        # (megatron-fsdp not installed, a release that predates the API) is simply absent.
        version = installed_version(_sites.distribution_of(site["api"]))
        if version is not None and _sites.sites_of(site["api"], _matrix.release(version)):
            assert site["known"] is True, site
        else:
            assert site["known"] is None, site
    assert report["pth_installed"] == str(installed / "fsdp_autopatch.pth")
    assert report["start_installed"] == str(installed / "fsdp_autopatch.start")
    assert report["startup_file"] == str(installed / fsdp_autopatch.START_FILE)
    assert report["startup_read"] is True and report["armed_by"] == fsdp_autopatch.START_FILE_ROUTE
    assert report["problems"] == [] and report["startup_error"] is None
    assert (report["outcome"], report["exit_code"]) == ("OK", 0) and str(report["verdict"]).startswith("OK: ")


def shown_width(line: str) -> int:
    """A line's length with every path counted as one word."""
    return len(re.sub(r"/\S+", "/P", line))


@pytest.mark.slow
def test_doctor_fits_a_screen_one_line_per_fact_and_ends_with_the_verdict(
    installed: Path, real_torch: dict[str, str]
) -> None:
    result = run_cli("doctor")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"fsdp-autopatch {metadata.version('fsdp-autopatch')} doctor (Python " \
                       f"{platform.python_version()}, {sys.executable})"
    assert len(lines) <= 30 and max(map(shown_width, lines)) <= 100, result.stdout
    facts = lines[1:-1]
    assert all(line[:6] in ("   ok ", " FAIL ", "   ?? ", "   -- ", "      ") for line in facts), facts
    bug = layout_bug_here()
    pair = f"torch {real_torch['torch']}, transformers {real_torch['transformers']}"
    assert f"   ok  {pair}, CPython {platform.python_version()}: the bug is here (version matrix)" in facts \
        or not bug
    for expected in (f"   ok  fsdp-autopatch installed in {installed}",
                     "   ok  FSDP2 fully_shard site known: _fsdp_init._apply_to_module",
                     "   ok  composable DDP replicate site known: replicate.replicate",
                     "   ok  armed at interpreter start by fsdp_autopatch.pth (torch's plugin entry point "
                     "also present)",
                     "   ok  switch: auto (FSDP_AUTOPATCH unset)"):
        assert expected in facts, result.stdout
    assert lines[-1] == (FIXED if bug else lines[-1]) and lines[-1].startswith("OK: ")
    # The caveat is said once.
    assert result.stdout.count("fsdp-autopatch verify") == 1
    quiet = run_cli("--quiet", "doctor")
    assert quiet.stdout == lines[-1] + "\n"
    assert run_cli("doctor", "-q").stdout == quiet.stdout


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_doctor_colours_only_a_terminal(installed: Path) -> None:
    def on_terminal(**env: Optional[str]) -> str:
        leader, follower = os.openpty()
        try:
            process = subprocess.Popen([sys.executable, "-m", "fsdp_autopatch", "doctor"], stdout=follower,
                                       stderr=subprocess.DEVNULL, env=environment(TERM="xterm", **env))
        finally:
            os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed with the child
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(leader)
        assert process.wait(timeout=60) == 0
        return b"".join(chunks).decode()

    assert "\x1b[32mOK: " in on_terminal(NO_COLOR=None)
    assert "\x1b[" not in on_terminal(NO_COLOR="1")


@pytest.mark.slow
def test_doctors_exit_code_is_its_verdict(installed: Path, real_torch: dict[str, str]) -> None:
    """As a Dockerfile's RUN step: a broken image fails the build."""
    assert run_cli("doctor").returncode == 0
    disabled = environment(FSDP_AUTOPATCH="0")
    shown = run_cli("doctor", env=disabled)
    if not layout_bug_here():  # nothing to fix, so nothing stays broken
        assert shown.returncode == 0 and last_line(shown.stdout).startswith("OK: nothing to fix: ")
        assert "   --  switch: FSDP_AUTOPATCH=0 turns the patch off" in shown.stdout.splitlines()
        return
    assert shown.returncode == 1
    assert last_line(shown.stdout) == (
        "PROBLEM: the layout bug will not be fixed here: FSDP_AUTOPATCH=0 turns the patch off")
    assert shown.stdout.splitlines()[-3:-1] == [" FAIL  switch: FSDP_AUTOPATCH=0 turns the patch off",
                                                "        unset FSDP_AUTOPATCH to let it run"]
    # The route is there and switched off: never "ok  armed" above the switch's FAIL.
    assert not any(line.startswith("   ok  armed") for line in shown.stdout.splitlines())
    assert "   --  fsdp_autopatch.pth read at interpreter start, switched off by FSDP_AUTOPATCH=0" \
        in shown.stdout.splitlines()
    report = one_object(run_cli("doctor", "--json", env=disabled).stdout)
    assert (report["mode"], report["in_matrix"], report["would_apply"]) == ("off", True, False)
    # --strict, once needed for this, is still accepted and changes nothing.
    assert run_cli("doctor", "--strict", env=disabled).returncode == 1


def test_doctor_reads_a_value_that_is_not_a_switch_value_as_the_runtime_does(installed: Path) -> None:
    """A mistyped switch: processes print one line naming the accepted values and run in auto
    mode, so doctor prints that same line and judges auto mode (0.2.0 exited 1, PROBLEM, while
    training ran patched)."""
    mistyped = environment(FSDP_AUTOPATCH="sometimes")
    line = _config.parse_mode("sometimes").problem
    runtime = subprocess.run([sys.executable, "-c", "import fsdp_autopatch; fsdp_autopatch.apply()"],
                             capture_output=True, text=True, env=mistyped, timeout=120, check=False)
    assert (runtime.returncode, runtime.stderr.splitlines()) == (0, [line])
    result = run_cli("doctor", "--json", env=mistyped)
    unset = run_cli("doctor", "--json")
    assert result.stderr.splitlines() == [line]
    report, auto = one_object(result.stdout), one_object(unset.stdout)
    assert (report["mode"], report["mode_value"]) == ("auto", "sometimes")
    assert (result.returncode, report["verdict"], report["problems"]) == (
        unset.returncode, auto["verdict"], auto["problems"])
    shown = run_cli("doctor", env=mistyped)
    assert ("   ok  switch: auto (FSDP_AUTOPATCH='sometimes' is not a switch value, so processes run in "
            "auto mode)") in shown.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("plugins", [True, False], ids=["plugins on", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"])
def test_doctor_says_which_route_arms_an_interpreter_that_skips_the_pth(
    installed: Path, real_torch: dict[str, str], plugins: bool
) -> None:
    """-S: no site processing; the package is still importable from PYTHONPATH, as in embedded
    setups. torch's plugin entry point arms it there; with torch's switch off nothing does, and
    --strict exits 1."""
    switch = {} if plugins else {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    command = [sys.executable, "-S", "-m", "fsdp_autopatch"]
    env = environment(PYTHONPATH=str(installed), **switch)
    result = run_cli("doctor", "--json", command=command, env=env)
    shown = run_cli("doctor", command=command, env=env)
    report = one_object(result.stdout)
    assert (report["startup_read"], report["armed_by"], report["plugin_arms"]) == (False, None, plugins)
    assert report["pth_installed"] == str(installed / "fsdp_autopatch.pth")
    assert result.returncode == shown.returncode
    if plugins:
        # Armed at import torch: no advice to install anything, and the verdict agrees.
        assert result.returncode == 0, result.stderr
        assert report["arms_by"] == fsdp_autopatch.PLUGIN_ROUTE
        assert report["would_apply"] is layout_bug_here()
        assert ("   ok  armed at import torch by torch's plugin entry point (python -S reads no start-up "
                "file)" in shown.stdout.splitlines())
        assert "install" not in shown.stdout.replace("fsdp-autopatch installed in", "")
        return
    if not layout_bug_here():
        assert result.returncode == 0
        return
    assert result.returncode == 1, result.stderr
    assert report["arms_by"] is None and report["would_apply"] is False
    facts = shown.stdout.splitlines()
    start = facts.index(" FAIL  not armed at interpreter start: python -S reads no start-up file")
    assert facts[start + 1:start + 3] == [
        " FAIL  not armed at import torch: TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns torch's plugins off",
        "        unset TORCH_DEVICE_BACKEND_AUTOLOAD, or call fsdp_autopatch.apply() in the training script"]
    assert facts[-1] == "PROBLEM: the layout bug will not be fixed here: nothing arms the patch"


def test_doctor_in_an_environment_without_torch(without_torch: str) -> None:
    result = run_cli("doctor", "--json", command=[without_torch, "-m", "fsdp_autopatch"])
    assert result.returncode == 0, result.stderr
    report = one_object(result.stdout)
    assert DOCTOR_KEYS <= set(report)
    assert (report["torch"], report["transformers"], report["wrapt"]) == (None, None, None)
    assert report["in_matrix"] is None and report["would_apply"] is False
    assert report["verdict"] == "OK: nothing to fix: torch is not installed"
    # What would matter with torch (wrapt missing) is shown, marked as not mattering here.
    shown = run_cli("doctor", command=[without_torch, "-m", "fsdp_autopatch"])
    assert "   --  wrapt cannot be imported (ModuleNotFoundError: No module named 'wrapt')" in shown.stdout


def test_doctor_exits_1_when_wrapt_is_missing(without_distributed: str) -> None:
    command = [without_distributed, "-m", "fsdp_autopatch"]
    result = run_cli("doctor", command=command)
    # What doctor answers from: the rows, for this interpreter (the throwaway venv runs it too).
    pair = _matrix.decide(_config.AUTO, "2.13.0", "4.55.2")
    report = one_object(run_cli("doctor", "--json", command=command).stdout)
    if pair.in_matrix:
        assert result.returncode == 1, result.stderr
        missing = "wrapt cannot be imported (ModuleNotFoundError: No module named 'wrapt')"
        assert last_line(result.stdout) == ("PROBLEM: the layout bug will not be fixed here: wrapt cannot be "
                                            "imported")
        assert f" FAIL  {missing}" in result.stdout
        assert f"        {pip_in(without_distributed, 'install wrapt')}" in result.stdout.splitlines()
        assert report["problems"] == [missing]
        return
    # This CPython accepts the swap: nothing would stay broken, and the missing wrapt is shown as
    # not mattering here.
    assert result.returncode == 0, result.stdout + result.stderr
    assert last_line(result.stdout).startswith("OK: nothing to fix: ")
    assert (report["in_matrix"], report["would_apply"], report["wrapt"]) == (False, False, None)


def test_doctor_says_when_torch_has_no_fsdp2_site_it_knows(without_distributed: str) -> None:
    # That torch 2.13.0 holds none of FSDP2's files: to doctor, a torch whose FSDP2 moved.
    result = run_cli("doctor", "--json", command=[without_distributed, "-m", "fsdp_autopatch"])
    report = one_object(result.stdout)
    fully_shard = report["sites"][0]  # type: ignore[index]
    assert fully_shard["known"] is False and report["would_apply"] is False
    assert fully_shard["text"].startswith("torch 2.13.0's FSDP2 layout is unknown to fsdp-autopatch ")
    # Listed where the bug is, among what files cannot answer; the missing wrapt is what certainly
    # stands in the way.
    if report["in_matrix"]:
        assert fully_shard["text"] in report["unknowns"]  # type: ignore[operator]
    assert fully_shard["text"] not in report["problems"]  # type: ignore[operator]


# --------------------------------------------------------------------------------------------- verify


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "0", "-5"])
def test_verify_refuses_a_timeout_that_is_not_a_finite_number_of_seconds(installed: Path, value: str) -> None:
    """``nan`` and ``inf`` parse as floats, and would leave verify without a deadline."""
    result = run_cli("verify", f"--timeout={value}")
    assert (result.returncode, result.stdout) == (2, "")
    assert last_line(result.stderr) == (f"fsdp-autopatch verify: error: argument --timeout: must be a finite "
                                        f"number more than 0, not {value}")


@pytest.mark.slow
def test_verify_without_a_usable_temporary_directory_exits_2_saying_what_to_set(
    real_torch: dict[str, str]
) -> None:
    """Every directory tempfile would try is unusable (tests/programs/no_temp_dir.py): no
    traceback and no exit 1, which says the bug is there, but one line and 2."""
    result = run_cli(command=[sys.executable, str(PROGRAMS / "no_temp_dir.py")], timeout=120)
    assert (result.returncode, "Traceback" in result.stderr) == (2, False), result.stderr
    tried = "['/nonexistent/tmp', '/nonexistent/var/tmp']"
    assert result.stdout == (f"cannot verify: no temporary directory for the ranks' output ([Errno 2] No "
                             f"usable temporary directory found in {tried}); set TMPDIR to a writable "
                             "directory\n")


@pytest.mark.slow
@pytest.mark.ci_tier
def test_verify_under_python_s_with_site_packages_on_pythonpath_judges_a_python_s_script(
    installed: Path, real_torch: dict[str, str]
) -> None:
    """What the README says of ``python -S``: with site-packages on PYTHONPATH, as a ``python -S``
    training script needs it, verify's ranks run with -S too and are armed by torch's plugin."""
    result = run_cli("verify", "--model", "token-classification",
                     command=[sys.executable, "-S", "-m", "fsdp_autopatch"],
                     env=environment(PYTHONPATH=str(installed)))
    assert result.returncode == 0, result.stdout + result.stderr
    if layout_bug_here():
        assert last_line(result.stdout).endswith(f"by the patch, armed by {fsdp_autopatch.PLUGIN_ROUTE}")


def test_verify_exits_2_when_torch_is_not_installed(without_torch: str) -> None:
    command = [without_torch, "-m", "fsdp_autopatch"]
    result = run_cli("verify", command=command)
    assert result.returncode == 2
    assert result.stdout == (f"cannot verify: torch and transformers are not installed for {without_torch}; "
                             "install torch and transformers into this environment\n")
    document = one_object(run_cli("verify", "--json", command=command).stdout)
    assert VERIFY_KEYS <= set(document)
    assert (document["exit_code"], document["ok"], document["models"]) == (2, False, [])


def test_verify_exits_2_when_torch_has_no_distributed(without_distributed: str) -> None:
    result = run_cli("verify", command=[without_distributed, "-m", "fsdp_autopatch"], timeout=120)
    assert result.returncode == 2, result.stderr
    assert last_line(result.stdout) == (
        "cannot verify: torch 2.13.0 was built without torch.distributed; install a build that has it "
        "(the PyPI wheels do)")


@pytest.mark.slow
@pytest.mark.ci_tier
def test_verify_json_on_two_ranks_without_torch_in_the_parent(real_torch: dict[str, str]) -> None:
    def verify(**env: Optional[str]) -> dict[str, object]:
        # Only the token classifier is asked for: verify adds the causal LM, its control.
        result = run_cli("-X", "importtime", "-m", "fsdp_autopatch", "verify", "--nproc", "2", "--json",
                         "--model", "token-classification", command=[sys.executable], env=environment(**env))
        # verify's own stderr holds only the parent's imports: the ranks' stderr goes to their files.
        assert not imported_packages(result.stderr) & {"torch", "transformers"}
        document = one_object(result.stdout)
        assert document["exit_code"] == result.returncode
        assert VERIFY_KEYS <= set(document) and document["nproc"] == 2 and document["timed_out"] is False
        return document

    fixed = verify()
    assert fixed["exit_code"] == 0, fixed["verdict"]
    assert fixed["status"]["applied"] is layout_bug_here()  # type: ignore[index]
    runs = _verify.runs(("token-classification", "causal-lm"))
    assert [(m["model"], m["result"], m["outcome"]) for m in fixed["models"]] == [  # type: ignore[attr-defined]
        (run, "wrapped", "trained") for run in runs]
    assert fixed["warning"] is None
    # Both ranks built their own classes, and said which.
    ranks = fixed["ranks"]
    assert [rank["rank"] for rank in ranks] == [0, 1]  # type: ignore[attr-defined]
    for rank in ranks:  # type: ignore[attr-defined]
        assert rank["reported"] is True
        if not layout_bug_here():  # the patch stood aside: no site was patched
            assert (rank["classes"], rank["classes_seen"]) == ([], 0)
            continue
        outcomes = {record["wrapper"]: (record["outcome"], record["parent"]) for record in rank["classes"]}
        # fully_shard wraps the decoder layers and the root; composable DDP the root.
        assert rank["classes_seen"] == len(outcomes) == 5, rank
        head = HEAD_CLASSES["token-classification"]
        for wrapper in ("FSDPQwen2DecoderLayer", "FSDPQwen2ForCausalLM", "DDPQwen2ForCausalLM"):
            assert outcomes[wrapper] == ("torch", None)
        assert outcomes[f"FSDP{head}"] == outcomes[f"DDP{head}"] == ("compatible", "abc.ABC")

    broken = verify(FSDP_AUTOPATCH="0")
    assert broken["status"]["mode"] == "off"  # type: ignore[index]
    assert broken["ranks"] == [{"rank": number, "classes": [], "classes_seen": 0, "reported": True}
                               for number in (0, 1)]
    if not layout_bug_here():
        assert broken["exit_code"] == 0, broken["verdict"]
        return
    assert broken["exit_code"] == 1 and broken["ok"] is False
    assert [(m["model"], m["sharded"]) for m in broken["models"]] == [  # type: ignore[attr-defined]
        (run, _verify.run_kind(run)[0] == "causal-lm") for run in runs]
    assert LAYOUT_ERROR in broken["models"][0]["error"]  # type: ignore[index]


@pytest.mark.slow
@needs_proc
def test_verify_timeout_exits_2_and_stops_every_rank(real_torch: dict[str, str]) -> None:
    marker, env = marked_run()
    # One second is not enough to import torch, so this stops the ranks while they start.
    result = run_cli("verify", "--nproc", "2", "--timeout", "1", env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert last_line(result.stdout) == ("cannot verify: not finished within 1 s (0 of 8 runs done); rerun "
                                        "with a larger --timeout on a less loaded machine")
    assert processes_marked(marker) == []


@pytest.mark.slow
@pytest.mark.ci_tier
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or not Path("/proc/self/environ").is_file(),
                    reason="sends SIGTERM, finds leftover ranks through /proc")
def test_verify_stopped_by_sigterm_leaves_no_rank_running(real_torch: dict[str, str]) -> None:
    marker, env = marked_run()
    process = verify_at_work(env, stdout=subprocess.DEVNULL)
    assert process.stderr is not None
    process.send_signal(signal.SIGTERM)  # a cancelled CI job: to verify alone, not to its ranks
    assert process.wait(timeout=120) == 128 + signal.SIGTERM
    process.stderr.close()
    assert processes_marked(marker) == []


def verdict_for(*results: dict[str, object], torch: str = "2.8.0") -> tuple[int, str, Optional[str]]:
    """What verify would say about these rank-0 result lines, with the patch applied."""
    from fsdp_autopatch import _verify_command

    run = _verify_command.VerifyRun(nproc=2, models=[str(result["model"]) for result in results],
                                    status={"applied": True, "torch": torch, "transformers": "4.55.2",
                                            "armed_by": fsdp_autopatch.START_FILE_ROUTE},
                                    results=list(results))
    code, verdict = _verify_command.verify_verdict(run, timeout=60)
    return code, verdict, _verify_command.torch_warning(run)


def losses(first: float, second: float) -> dict[str, object]:
    """A trained result whose sharded losses differ from the unsharded [1.0, 1.0] by this much."""
    return {"sharded": True, "trained": True, "losses": [1.0 + first, 1.0 + second],
            "reference_losses": [1.0, 1.0], "max_loss_difference": max(first, second)}


def test_a_model_that_shards_but_cannot_train_fails_unless_the_causal_lm_cannot_either() -> None:
    untrained = {"sharded": True, "trained": False, "train_error": "RuntimeError: no CUDA GPUs"}
    # torch 2.4's FSDP2 cannot train on a CPU at all: sharding is all there is to prove.
    code, verdict, warning = verdict_for(dict(untrained, model="token-classification"),
                                         dict(untrained, model="causal-lm"), torch="2.4.1")
    assert code == 0 and "FSDP2 cannot train in this torch (RuntimeError: no CUDA GPUs)" in verdict
    assert warning is None
    # torch's own class trains, the patched one does not: that is the patch's fault.
    code, verdict, _ = verdict_for(dict(untrained, model="token-classification"),
                                   dict(losses(0.0, 0.0), model="causal-lm"))
    assert code == 1
    assert verdict.startswith("FAIL: 1 of 2 runs cannot be used (token-classification: RuntimeError")


def test_losses_that_differ_for_the_causal_lm_too_are_torchs_and_only_warned_about() -> None:
    # torch 2.8.0 on 2 gloo ranks: the first loss matches, the update does not, for every model.
    code, verdict, warning = verdict_for(dict(losses(0.0, 0.00082), model="token-classification"),
                                         dict(losses(0.0, 0.0027), model="causal-lm"))
    assert code == 0 and verdict == (f"OK: 2 of 2 runs wrapped and trained; fixed by the patch, armed by "
                                     f"{fsdp_autopatch.START_FILE_ROUTE}"), verdict
    assert warning is not None and "\n" not in warning
    assert warning.startswith("warning: torch 2.8.0's FSDP2 on 2 gloo CPU ranks trains differently") \
        and "does not decide the exit code" in warning
    # The same drift where the causal LM trains exactly is the patched class's doing.
    code, verdict, warning = verdict_for(dict(losses(0.0, 0.00082), model="token-classification"),
                                         dict(losses(0.0, 0.0), model="causal-lm"))
    assert (code, warning) == (1, None) and "losses differ by 0.00082" in verdict
    # Worse than the causal LM (a first loss that already differs) fails too.
    code, verdict, _ = verdict_for(dict(losses(0.5, 0.5), model="token-classification"),
                                   dict(losses(0.0, 0.0027), model="causal-lm"))
    assert code == 1 and "losses differ by 0.5" in verdict


def test_verify_always_runs_the_causal_lm_as_the_control() -> None:
    from fsdp_autopatch._verify_command import models_to_run

    # Each model with fully_shard, then each with composable DDP, graded against its own control.
    assert models_to_run(["token-classification"]) == [
        "token-classification", "causal-lm", "token-classification (DDP)", "causal-lm (DDP)"]
    assert models_to_run(["causal-lm", "question-answering"]) == [
        "causal-lm", "question-answering", "causal-lm (DDP)", "question-answering (DDP)"]
    assert models_to_run(None) == [*AFFECTED, "causal-lm",
                                   *(f"{kind} (DDP)" for kind in (*AFFECTED, "causal-lm"))]


def test_console_writes_to_the_streams_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_autopatch import _console

    console = _console.Console(quiet=False)
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    console.detail("a detail")
    console.verdict("OK: a verdict", "green")
    console.progress("some progress")
    console.warning("a warning")
    assert (out.getvalue(), err.getvalue()) == ("a detail\nOK: a verdict\n", "some progress\na warning\n")
    monkeypatch.setattr(sys, "stdout", None)  # pythonw
    monkeypatch.setattr(sys, "stderr", None)
    console.verdict("OK: nowhere to go", "green")
    console.warning("nowhere either")


def test_the_matrix_grades_by_verifys_rule_and_checks_its_exit_codes() -> None:
    import matrix  # tests/matrix.py, beside this file

    def result(run: str, patched: bool) -> dict[str, object]:
        plain = _verify.run_kind(run)[0] == "causal-lm"
        if not plain and not patched:
            return {"model": run, "sharded": False, "error": f"__class__ assignment: ... {LAYOUT_ERROR} ..."}
        return dict(losses(0.0, 0.0027), model=run, upstream_bases=plain, wrapper={"name": run})

    def document(patched: bool, code: int) -> dict[str, object]:
        # Every model with fully_shard and with composable DDP, as verify runs them.
        return {"exit_code": code, "verdict": "...", "first_attempt_failed": None,
                "status": {"applied": patched, "in_matrix": True, "sites": []},
                "models": [result(run, patched) for run in _verify.runs(_verify.MODELS)]}

    def judged(patched_code: int, unpatched_code: int) -> list[str]:
        record = {"torch": "2.8.0", "transformers": "4.55.2", "python": "3.11.7",
                  "models": {kind: {"available": True, "abc_in_mro": kind != "causal-lm"}
                             for kind in _verify.MODELS},
                  "patched": document(True, patched_code), "unpatched": document(False, unpatched_code)}
        return list(matrix.judge(record)["problems"])

    # torch 2.8.0 on two gloo ranks: every model drifts alike, which is not the patch's doing.
    assert judged(0, 1) == []
    assert [problem.split(":")[0] for problem in judged(1, 1)] == ["verify exit codes (patched, unpatched)"]
    assert [problem.split(":")[0] for problem in judged(0, 0)] == ["verify exit codes (patched, unpatched)"]


@pytest.mark.slow
def test_doctor_on_python_3_15_says_the_abc_heads_need_no_patch(
    real_torch: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_autopatch import _doctor, _matrix

    if _matrix.row_for(_matrix.TRANSFORMERS_ROWS, real_torch["transformers"]).abc_heads is not True:  # type: ignore[union-attr]
        pytest.fail(f"transformers {real_torch['transformers']} has no ABC heads: nothing to tell apart")
    here = _doctor.diagnose()
    monkeypatch.setattr(_matrix, "python_version", lambda: "3.15.2")
    later = _doctor.diagnose()
    assert (here.in_matrix, later.in_matrix, later.would_apply) == (layout_bug_here(), False, False)
    assert "CPython 3.15.2 accepts" in later.reason and later.verdict.startswith("OK: nothing to fix: ")


def test_json_lines_reads_reports_of_ranks_that_shared_a_line() -> None:
    # Two ranks writing to one pipe at once can put their reports on one line.
    output = 'warning: noise\n{"rank": 0}{"rank": 1}\n{"rank": 2} trailing\n{not json}\n["a list"]\n'
    assert json_lines(output) == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
