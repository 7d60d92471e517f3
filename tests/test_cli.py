"""The command line, run as users run it: ``fsdp-autopatch`` and ``python -m fsdp_autopatch`` in fresh
interpreters of the installed package, one test per exit code and per JSON contract.

Tests that need torch and transformers installed are marked slow, as in the rest of the suite, even
those that only read their metadata. Environments without torch are real virtual environments
holding a copy of the installed package; the one "without torch.distributed" holds a minimal torch
that reports exactly that.
"""

from __future__ import annotations

import io
import json
import os
import platform
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
    environment,
    json_lines,
    layout_bug_here,
    make_throwaway,
    marked_run,
    needs_proc,
    processes_marked,
    site_packages,
    verify_at_work,
)
from harness import AFFECTED, split_importtime
from verify_output import HEAD_CLASSES

from fsdp_autopatch import _config, _matrix, _verify

SCRIPT = Path(sysconfig.get_path("scripts")) / ("fsdp-autopatch.exe" if os.name == "nt" else "fsdp-autopatch")
DOCTOR_KEYS = {"version", "python", "torch", "transformers", "mode", "in_matrix", "decided_by",
               "layout_known", "layout", "would_apply", "reason", "pth_installed", "start_installed"}
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


def add_distribution(site: Path, name: str, version: str, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    dist_info = site / f"{name}-{version}.dist-info"
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
    site = throwaway.site
    add_distribution(site, "torch", "2.13.0", {
        "torch/__init__.py": '__version__ = "2.13.0"\n',
        "torch/distributed/__init__.py": "def is_available() -> bool:\n    return False\n",
    })
    add_distribution(site, "transformers", "4.55.2", {"transformers/__init__.py": '__version__ = "4.55.2"\n'})
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
    for text in ("doctor", "verify", "--quiet", "--version", "exit codes:", "fsdp-autopatch verify"):
        assert text in shown.stdout
    for sub in ("doctor", "verify"):
        sub_help = run_cli(sub, "--help", command=command)
        assert sub_help.returncode == 0 and "--json" in sub_help.stdout, sub_help.stderr
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
    assert (report["decided_by"], report["layout_known"]) == ("matrix", True)
    assert report["pth_installed"] == str(installed / "fsdp_autopatch.pth")
    assert report["start_installed"] == str(installed / "fsdp_autopatch.start")
    assert report["startup_read"] is True and report["armed_here"] is True
    assert report["problems"] == [] and str(report["verdict"]).startswith("OK: ")


def test_doctor_text_names_each_check_and_ends_with_the_verdict(installed: Path) -> None:
    result = run_cli("doctor")
    assert result.returncode == 0, result.stderr
    for label in ("package", "python", "torch", "transformers", "wrapt", "mode", "matrix", "decided by",
                  "FSDP2 layout", ".pth", ".start", "start-up", "would apply"):
        assert f"\n  {label} " in result.stdout
    assert "in training processes a probe asks torch and CPython directly" in result.stdout
    assert last_line(result.stdout).startswith("OK: ") and "\x1b[" not in result.stdout
    quiet = run_cli("--quiet", "doctor")
    assert quiet.stdout == last_line(result.stdout) + "\n"
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
def test_doctor_strict_exits_1_only_when_the_bug_would_stay(
    installed: Path, real_torch: dict[str, str]
) -> None:
    assert run_cli("doctor", "--strict").returncode == 0
    disabled = environment(FSDP_AUTOPATCH="0")
    assert run_cli("doctor", env=disabled).returncode == 0, "without --strict doctor only reports"
    strict = run_cli("doctor", "--strict", env=disabled)
    if not layout_bug_here():  # nothing to fix, so nothing stays broken
        assert strict.returncode == 0 and last_line(strict.stdout).startswith("OK: nothing to fix: ")
        return
    assert strict.returncode == 1
    assert last_line(strict.stdout) == (
        f"PROBLEM: torch {real_torch['torch']} with transformers {real_torch['transformers']} has the FSDP2 "
        "layout bug and it will NOT be fixed: FSDP_AUTOPATCH=0 disables the patch; unset FSDP_AUTOPATCH "
        "(or set it to auto)")
    report = one_object(run_cli("doctor", "--json", env=disabled).stdout)
    assert (report["mode"], report["in_matrix"], report["would_apply"]) == ("off", True, False)


def test_doctor_warns_about_a_bad_switch_value_and_runs_in_auto_mode(installed: Path) -> None:
    result = run_cli("doctor", "--json", env=environment(FSDP_AUTOPATCH="sometimes"))
    assert result.returncode == 0
    assert result.stderr == _config.parse_mode("sometimes").problem + "\n"
    report = one_object(result.stdout)
    assert (report["mode"], report["mode_value"], report["problems"]) == ("auto", "sometimes", [])


@pytest.mark.slow
@pytest.mark.parametrize("plugins", [True, False], ids=["plugins on", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"])
def test_doctor_says_which_route_arms_an_interpreter_that_skips_the_pth(
    installed: Path, real_torch: dict[str, str], plugins: bool
) -> None:
    """-S: no site processing; the package is still importable from PYTHONPATH, as in embedded
    setups. torch's plugin entry point arms it there; with torch's switch off nothing does, and
    --strict exits 1."""
    switch = {} if plugins else {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    result = run_cli("-S", "-m", "fsdp_autopatch", "doctor", "--json", "--strict", command=[sys.executable],
                     env=environment(PYTHONPATH=str(installed), **switch))
    report = one_object(result.stdout)
    assert (report["startup_read"], report["armed_here"], report["plugin_arms"]) == (False, False, plugins)
    assert report["pth_installed"] == str(installed / "fsdp_autopatch.pth")
    if plugins:
        assert result.returncode == 0, result.stderr
        assert report["arms_by"] == "torch's plugin entry point (torch.backends), at import torch"
        assert report["would_apply"] is layout_bug_here()
        return
    assert result.returncode == 1, result.stderr
    assert report["arms_by"] is None and report["would_apply"] is False
    assert "-S" in str(report["verdict"]) and "fsdp_autopatch.apply()" in str(report["verdict"])
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns torch's plugin entry points off" in str(report["verdict"])


def test_doctor_in_an_environment_without_torch(without_torch: str) -> None:
    result = run_cli("doctor", "--json", "--strict", command=[without_torch, "-m", "fsdp_autopatch"])
    assert result.returncode == 0, result.stderr
    report = one_object(result.stdout)
    assert DOCTOR_KEYS <= set(report)
    assert (report["torch"], report["transformers"], report["wrapt"]) == (None, None, None)
    assert report["in_matrix"] is None and report["would_apply"] is False
    assert str(report["verdict"]).startswith("OK: nothing to fix: torch is not installed")


def test_doctor_strict_exits_1_when_wrapt_is_missing(without_distributed: str) -> None:
    command = [without_distributed, "-m", "fsdp_autopatch"]
    result = run_cli("doctor", "--strict", command=command)
    # What doctor answers from: the rows, for this interpreter (the throwaway venv runs it too).
    pair = _matrix.decide(_config.AUTO, "2.13.0", "4.55.2")
    if pair.in_matrix:
        assert result.returncode == 1, result.stderr
        assert "wrapt cannot be imported" in last_line(result.stdout)
        assert "pip install wrapt" in last_line(result.stdout)
        return
    # This CPython accepts the swap: nothing would stay broken, so --strict passes, and the missing
    # wrapt is still listed among the problems.
    assert result.returncode == 0, result.stdout + result.stderr
    assert last_line(result.stdout) == f"OK: nothing to fix: {pair.reason}"
    report = one_object(run_cli("doctor", "--json", command=command).stdout)
    assert (report["in_matrix"], report["would_apply"], report["wrapt"]) == (False, False, None)
    assert any("wrapt cannot be imported" in problem and "pip install wrapt" in problem
               for problem in report["problems"])  # type: ignore[attr-defined]


def test_doctor_says_when_torch_has_no_fsdp2_site_it_knows(without_distributed: str) -> None:
    # That torch 2.13.0 holds none of FSDP2's files: to doctor, a torch whose FSDP2 moved.
    result = run_cli("doctor", "--json", command=[without_distributed, "-m", "fsdp_autopatch"])
    report = one_object(result.stdout)
    assert report["layout_known"] is False and report["would_apply"] is False
    assert str(report["layout"]).startswith("torch 2.13.0's FSDP2 layout is unknown to fsdp-autopatch ")
    assert str(report["layout"]).endswith("doctor reads files only; `fsdp-autopatch verify` is the proof")
    # Listed on every Python, whatever the matrix says, among what files cannot answer; the missing
    # wrapt is what certainly stands in the way.
    assert report["layout"] in report["unknowns"]  # type: ignore[operator]
    assert report["layout"] not in report["problems"]  # type: ignore[operator]


# --------------------------------------------------------------------------------------------- verify


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
def test_verify_json_on_two_ranks_without_torch_in_the_parent(real_torch: dict[str, str]) -> None:
    def verify(**env: Optional[str]) -> dict[str, object]:
        # Only the token classifier is asked for: verify adds the causal LM, its control.
        result = run_cli("-X", "importtime", "-m", "fsdp_autopatch", "verify", "--nproc", "2", "--json",
                         "--model", "token-classification", command=[sys.executable], env=environment(**env))
        # -X importtime is not passed on to torchrun or the ranks, so stderr shows the parent's imports.
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
        (run, "sharded", "trained") for run in runs]
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
    # One second is not enough to import torch, so this stops torchrun while it starts.
    result = run_cli("verify", "--nproc", "2", "--timeout", "1", env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert last_line(result.stdout) == ("cannot verify: not finished within 1 s (0 of 8 runs done); rerun "
                                        "with a larger --timeout on a less loaded machine")
    assert processes_marked(marker) == []


@pytest.mark.slow
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
                                    status={"applied": True, "torch": torch, "transformers": "4.55.2"},
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
    assert code == 1 and verdict.startswith(
        "FAIL: 1 of 2 runs cannot be used with FSDP2 or DDP (token-classification: RuntimeError")


def test_losses_that_differ_for_the_causal_lm_too_are_torchs_and_only_warned_about() -> None:
    # torch 2.8.0 on 2 gloo ranks: the first loss matches, the update does not, for every model.
    code, verdict, warning = verdict_for(dict(losses(0.0, 0.00082), model="token-classification"),
                                         dict(losses(0.0, 0.0027), model="causal-lm"))
    assert code == 0 and verdict.startswith(
        "OK: 2 of 2 runs wrapped (FSDP2 fully_shard, composable DDP replicate) and trained"), verdict
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

    if _matrix.row_for(_matrix.TRANSFORMERS_ROWS, real_torch["transformers"]).affected is not True:  # type: ignore[union-attr]
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


def test_verify_takes_every_object_when_two_ranks_share_a_line() -> None:
    """Two ranks write to one pipe: their lines can run together ("{...}{...}"), and verify must
    take both objects, not stop with a traceback and print nothing."""
    from fsdp_autopatch._console import Console
    from fsdp_autopatch._verify_command import VerifyRun, take_line

    run = VerifyRun(nproc=2, models=["causal-lm"])
    record = {"name": "Head", "outcome": "compatible", "parent": "abc.ABC"}
    line = json.dumps({"rank": 0, "class_record": record}) + json.dumps({"rank": 1, "class_record": record})
    take_line(run, line, Console(quiet=True, out=io.StringIO(), err=io.StringIO()))
    assert {rank: ranked.classes for rank, ranked in run.ranks.items()} == {0: [record], 1: [record]}
