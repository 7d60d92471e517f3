"""Prove the version matrix on real installs: one virtual environment per (torch, transformers) cell.

    python tests/matrix.py --reduced      # CI: torch 2.8.0 + the pinned transformers, the pinned
                                          # torch + transformers 4.53.3, 4.54.0, 4.55.3
    python tests/matrix.py --full --update-docs     # every cell; docs/versions.md's table is the record
    python tests/matrix.py --cells 2.13.0:4.54.0,2.8.0:4.55.2
    python tests/matrix.py --capture-cli .venv/bin/python --update-docs  # docs/cli.md, README's status

Standard library only. Each cell gets a fresh venv holding torch, transformers and the package's
wheel (built once from this checkout), made with uv when it is on PATH (else pip), from one
download cache shared by all cells; the venv is deleted as soon as its cell is done. In the cell:

1. a probe, unpatched, says which of ``fsdp_autopatch._verify.MODELS`` the transformers release
   can build from a Qwen2 config, and whether each class has ``abc.ABC`` in its MRO;
2. ``fsdp-autopatch verify --nproc 2 --json`` (the command users run, which starts its ranks with
   torchrun) runs once with ``FSDP_AUTOPATCH=0`` and once in the default mode, so the installed
   ``.pth`` is what patches.

What was measured (does the bug reproduce unpatched, did the default mode patch, how did each
model train, graded by the rule ``verify`` itself uses, ``_verify.grade``; does the causal LM get
upstream's exact class; did ``verify`` exit 0 patched and 1 unpatched where the bug is, 0 both
ways where it is not) is compared with ``fsdp_autopatch._matrix``. A small JSON file (versions,
verdicts, timings per cell) goes to a temporary file unless ``--results`` names one; the markdown
table goes between ``<!-- matrix:start -->`` and ``<!-- matrix:end -->`` in docs/versions.md only
with ``--update-docs`` (``--update-readme`` is its older name). ``--capture-cli`` runs ``doctor`` and
``verify`` (into docs/cli.md) and prints ``fsdp_autopatch.status().to_dict()`` after sharding a tiny
model (into README.md's API section), in an environment with the package installed from its wheel.
Paths in anything generated are rewritten as ``.venv/...``. Any cell that
disagrees with the matrix, or could not be run, is one ``MATRIX FAILURE`` line on stderr and makes
the exit status 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from harness import (
    AFFECTED,
    DOCS,
    ROOT,
    TORCH_PIN,
    TRANSFORMERS_PIN,
    build_wheel,
    json_lines,
    portable_text,
    replace_section,
    run_logged,
    scrubbed_environment,
)

# Cells are judged by the matrix of this checkout, the same code the wheel is built from.
sys.path.insert(0, str(ROOT))
from fsdp_autopatch import _config, _matrix, _verify

TORCH = ("2.4.1", "2.5.1", "2.8.0", "2.13.0", "2.15.0")
# 4.53.3: last release before the ABC heads; 4.54.0 and 4.55.2: first and last with them;
# 4.55.3: the fix; 4.57.6: newest 4.x; 5.24.0: newest 5.x when this list was written.
TRANSFORMERS = ("4.53.3", "4.54.0", "4.55.2", "4.55.3", "4.57.6", "5.24.0")
# CI's cells: the pinned transformers (harness.py) on an older torch, and the pinned torch with the
# last release before the ABC heads, the first with them and the fix; the pinned pair itself is
# the nox tests session's.
REDUCED = (("2.8.0", TRANSFORMERS_PIN), (TORCH_PIN, "4.53.3"), (TORCH_PIN, "4.54.0"), (TORCH_PIN, "4.55.3"))
# Pairs that cannot be installed together, with the reason; the full matrix lists them as pruned.
# Every pair of TORCH x TRANSFORMERS resolves (transformers does not pin torch), so none is.
PRUNED: dict[tuple[str, str], str] = {}

MARKERS = ("<!-- matrix:start -->", "<!-- matrix:end -->")
CLI_MARKERS = ("<!-- cli:start -->", "<!-- cli:end -->")
API_MARKERS = ("<!-- api:start -->", "<!-- api:end -->")
# Where each generated section goes.
VERSIONS_DOC = DOCS / "versions.md"
CLI_DOC = DOCS / "cli.md"
INSTALL_TIMEOUT = 1800
RUN_TIMEOUT = 900

CELL_PROBE = Path(__file__).parent / "programs" / "cell_probe.py"

Cell = tuple[str, str]


def parse_cells(text: str) -> list[Cell]:
    cells = []
    for item in text.split(","):
        torch_version, separator, transformers_version = item.strip().partition(":")
        if not separator or not torch_version or not transformers_version:
            raise argparse.ArgumentTypeError(f"{item!r} is not TORCH:TRANSFORMERS, e.g. 2.13.0:4.54.0")
        cells.append((torch_version, transformers_version))
    return cells


class Installer:
    """Makes venvs and installs into them, with uv when available (faster) or pip."""

    def __init__(self, kind: str, cache: Path, log: Path) -> None:
        self.uv = find_uv() if kind in ("auto", "uv") else None
        if kind == "uv" and self.uv is None:
            raise SystemExit("--installer uv: uv is not on PATH (pip install uv)")
        self.name = "uv" if self.uv else "pip"
        self.cache = cache / self.name
        self.cache.mkdir(parents=True, exist_ok=True)
        self.log = log
        # uv reads no pip configuration; a find-links directory in it may hold a local torch
        # wheel (e.g. a CPU build), which pip would prefer over a registry download.
        self.find_links = pip_find_links() if self.uv else []

    def version(self) -> str:
        command = [self.uv, "--version"] if self.uv else [sys.executable, "-m", "pip", "--version"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        return result.stdout.split(" from ")[0].strip()

    def run(self, command: list[str], env: dict[str, str]) -> None:
        run_logged(command, self.log, env=env, timeout=INSTALL_TIMEOUT)

    def environment(self) -> dict[str, str]:
        return scrubbed_environment(**{"UV_CACHE_DIR" if self.uv else "PIP_CACHE_DIR": str(self.cache)})

    def build_wheel(self, out: Path) -> Path:
        return build_wheel(out, uv=self.uv, log=self.log)

    def create(self, venv: Path, requirements: list[str]) -> Path:
        python = venv / "bin" / "python"
        env = self.environment()
        if self.uv:
            self.run([self.uv, "venv", "--quiet", "--python", sys.executable, str(venv)], env)
            links = [option for link in self.find_links for option in ("--find-links", link)]
            self.run([self.uv, "pip", "install", "--python", str(python), *links, *requirements], env)
            return python
        self.run([sys.executable, "-m", "venv", str(venv)], env)
        install = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *requirements]
        try:
            self.run(install, env)
        except RuntimeError:
            # A machine-wide pip configuration may cap torch (a constraints file); retry without it.
            self.run(install, {**env, "PIP_CONFIG_FILE": os.devnull})
        return python


def find_uv() -> Optional[str]:
    """uv on PATH, or beside this interpreter (``pip install uv`` into the runner's venv)."""
    beside = Path(sys.executable).parent / "uv"
    return shutil.which("uv") or (str(beside) if beside.is_file() else None)


def pip_find_links() -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, check=False)
    links: list[str] = []
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            links += [link for link in value.strip().strip("'\"").split() if link not in links]
    return links


def run_in_cell(command: list[str], env: dict[str, str], cwd: Path,
                codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in the cell; RuntimeError with the end of its stderr on another exit code."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd,
                            timeout=RUN_TIMEOUT, check=False)
    if result.returncode not in codes:
        raise RuntimeError(f"{' '.join(command[1:])} exited {result.returncode}: {result.stderr[-3000:]}")
    return result


def verify(python: Path, kinds: list[str], cwd: Path, **env: str) -> dict[str, Any]:
    """``fsdp-autopatch verify --nproc 2 --json`` in the cell: its JSON document."""
    command = [str(python), "-m", "fsdp_autopatch", "verify", "--nproc", "2", "--json",
               "--timeout", str(RUN_TIMEOUT - 60), *(word for kind in kinds for word in ("--model", kind))]

    def attempt() -> dict[str, Any]:
        # 1: a model failed, which is what the unpatched run is for; 2: it could not run.
        result = run_in_cell(command, scrubbed_environment(**env), cwd, codes=(0, 1))
        documents = json_lines(result.stdout)
        if len(documents) != 1 or documents[0].get("exit_code") != result.returncode:
            raise RuntimeError(f"verify printed no JSON document for exit code {result.returncode}: "
                               f"{result.stdout[-1000:]} {result.stderr[-2000:]}")
        return documents[0]

    try:
        document = attempt()
        document["first_attempt_failed"] = None
    except RuntimeError as error:
        # Once, a rank was SIGKILLed from outside on a busy machine; a real failure repeats.
        document = attempt()
        document["first_attempt_failed"] = str(error)[-1000:]
    if not document.get("status"):
        raise RuntimeError(f"verify ran no model: {document.get('verdict')}")
    return document


def run_cell(cell: Cell, installer: Installer, wheel: Path, work: Path, keep: bool) -> dict[str, Any]:
    torch_version, transformers_version = cell
    started = time.monotonic()
    venv = work / f"venv-torch{torch_version}-transformers{transformers_version}"
    record: dict[str, Any] = {"torch_requested": torch_version,
                              "transformers_requested": transformers_version}
    try:
        python = installer.create(venv, [f"torch=={torch_version}", f"transformers=={transformers_version}",
                                         str(wheel)])
        record["install_seconds"] = round(time.monotonic() - started, 1)
        # Away from the checkout, so that the installed package is the one imported.
        probe = run_in_cell([str(python), str(CELL_PROBE)], scrubbed_environment(FSDP_AUTOPATCH="0"), venv)
        (found,) = json_lines(probe.stdout)
        record.update(found)
        kinds = [kind for kind, model in found["models"].items() if model["available"]]
        if kinds:
            record["unpatched"] = verify(python, kinds, venv, FSDP_AUTOPATCH="0")
            record["patched"] = verify(python, kinds, venv)
        else:
            # Installed together, but this transformers builds no model on this torch (5.x refuses
            # torch < 2.6): there is nothing to shard, patched or not.
            errors = [model["error"] for model in found["models"].values()]
            record["unusable"] = next((line.strip() for line in errors[0].splitlines()[1:] if line.strip()),
                                      errors[0])
    except (subprocess.TimeoutExpired, RuntimeError, ValueError) as error:
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def by_model(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {result["model"]: result for result in document["models"]}


def judge(record: dict[str, Any]) -> dict[str, Any]:
    """Compare one cell's measurements with the matrix; ``problems`` lists every disagreement."""
    if "error" in record:
        return {"problems": [f"could not be run: {record['error'].splitlines()[0][:300]}"]}
    if "unusable" in record:
        row = _matrix.row_for(_matrix.TRANSFORMERS_ROWS, record["transformers"])
        affected = bool(row and row.abc_heads)
        return {"problems": [f"the matrix says transformers {record['transformers']} is affected, "
                             f"but it builds no model here: {record['unusable']}"] if affected else []}
    torch_version, transformers_version = record["torch"], record["transformers"]
    decision = _matrix.decide(_config.AUTO, torch_version, transformers_version, python=record["python"])
    transformers_row = _matrix.row_for(_matrix.TRANSFORMERS_ROWS, transformers_version)
    expected_bug = decision.in_matrix is True
    unpatched, patched = record["unpatched"], record["patched"]
    unpatched_models, patched_models = by_model(unpatched), by_model(patched)
    models = record["models"]
    heads = [kind for kind in AFFECTED if models[kind]["available"]]
    # Each head sharded with fully_shard and replicated with composable DDP: the same bug, or none.
    head_runs = _verify.runs(heads)
    problems = []

    bug = any(_verify.outcome(unpatched_models.get(run)) == _verify.LAYOUT for run in head_runs)
    if bug != expected_bug:
        problems.append(f"bug unpatched: measured {bug}, matrix says {expected_bug}")
    applied = bool(patched["status"]["applied"])
    if applied != decision.apply:
        problems.append(f"default mode patched: measured {applied}, matrix says {decision.apply} "
                        f"(status: {patched['status']['reason']})")
    if patched["status"].get("in_matrix") != decision.in_matrix:
        problems.append(f"status.in_matrix {patched['status'].get('in_matrix')}, matrix {decision.in_matrix}")
    if expected_bug and not heads:
        problems.append("the matrix says the heads are affected, but this transformers builds none of them")
    for kind in heads:
        if models[kind]["abc_in_mro"] != bool(transformers_row and transformers_row.abc_heads):
            problems.append(f"{kind}: abc.ABC in MRO is {models[kind]['abc_in_mro']}, the matrix row says "
                            f"{bool(transformers_row and transformers_row.abc_heads)}")

    # The one rule verify uses: every model is graded against the causal LM of the same run,
    # which the patch never touches (torch 2.4/2.5 cannot train FSDP2 on a CPU, torch 2.8 drifts
    # on two gloo ranks: so does torch's own class, and nothing worse is accepted).
    grade = _verify.grade(patched_models)
    controls = _verify.runs([_verify.CONTROL])
    for control in controls:
        control_unpatched = _verify.outcome(unpatched_models.get(control))
        if control_unpatched not in _verify.SHARDED_OUTCOMES:
            problems.append(f"{control} unpatched: {control_unpatched}")
    outcomes = {run: grade.outcomes.get(run, _verify.ABSENT) for run in head_runs}
    if not expected_bug or decision.apply:
        problems += [f"{run} patched: {outcome}" for run, outcome in outcomes.items()
                     if not grade.ok.get(run)]
    same_class = True
    for control in controls:
        causal = patched_models.get(control, {})
        if not (causal.get("sharded") and causal.get("upstream_bases") is True
                and causal.get("wrapper") == unpatched_models.get(control, {}).get("wrapper")):
            same_class = False
            problems.append(f"{control} patched: not upstream's exact class")
    causal = patched_models.get(_verify.CONTROL, {})

    # verify's own exit codes: 1 means the layout bug is here and not fixed, and nothing else.
    exit_codes = {"patched": patched["exit_code"], "unpatched": unpatched["exit_code"]}
    expected_codes = {"patched": 0, "unpatched": 1 if bug else 0}
    if exit_codes != expected_codes:
        problems.append(f"verify exit codes (patched, unpatched): {exit_codes['patched']}, "
                        f"{exit_codes['unpatched']}; expected {expected_codes['patched']}, "
                        f"{expected_codes['unpatched']}: {patched['verdict']} / {unpatched['verdict']}")
    return {
        "expected_bug": expected_bug, "expected_apply": decision.apply, "decision": decision.reason,
        "bug_unpatched": bug, "applied": applied, "decided_by": patched["status"].get("decided_by"),
        "sites": list(patched["status"].get("sites") or ()), "heads": outcomes, "control": grade.control,
        "train_error": causal.get("train_error") if grade.control == _verify.UNTRAINED else None,
        "torch_warning": patched.get("warning"), "verify_exit_codes": exit_codes,
        "causal_lm_upstream_class": same_class, "problems": problems,
    }


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """What the results file keeps of a cell: versions, verdicts, timings."""
    kept = {key: record[key] for key in ("torch_requested", "transformers_requested", "python", "torch",
                                          "transformers", "install_seconds", "seconds", "pruned", "unusable",
                                          "error", "verdict") if key in record}
    for run in ("unpatched", "patched"):
        if run in record:
            kept[f"{run}_retried"] = record[run]["first_attempt_failed"] is not None
    return json.loads(portable_text(json.dumps(kept)))


def yes_no(value: bool) -> str:
    return "yes" if value else "no"


def table_row(record: dict[str, Any]) -> str:
    torch_version, transformers_version = record["torch_requested"], record["transformers_requested"]
    if "pruned" in record:
        return f"| {torch_version} | {transformers_version} | pruned: {record['pruned']} | | | | | |"
    verdict = record["verdict"]
    cell = f"{torch_version} | {transformers_version}"
    if "unusable" in record:
        return f"| {cell} | not usable together: {record['unusable']} | | | | | n/a |"
    if "error" in record:
        return f"| {cell} | not run | | | | | **NO**: {verdict['problems'][0]} |"
    heads = verdict["heads"]
    if not heads:
        head_text = "none built"
    else:
        outcomes = list(heads.values())
        head_text = ", ".join(f"{outcomes.count(outcome)}/{len(heads)} {outcome}"
                              for outcome in sorted(set(outcomes)))
        if verdict["control"] == _verify.UNTRAINED:
            head_text += " (no train step possible on CPU: " + str(verdict["train_error"])[:60] + ")"
        elif verdict["control"] in (_verify.DRIFTED, _verify.DIVERGED):
            head_text += f" (the causal LM {verdict['control']} alike)"
    applied = yes_no(verdict["applied"])
    if verdict["applied"]:
        # The sites by module and function: _fully_shard.fully_shard, replicate.replicate, ...
        applied += f" ({', '.join('.'.join(site.split('.')[-2:]) for site in verdict['sites'])})"
    codes = verdict["verify_exit_codes"]
    agrees = "yes" if not verdict["problems"] else "**NO**: " + "; ".join(verdict["problems"])
    return (f"| {torch_version} | {transformers_version} | {yes_no(verdict['bug_unpatched'])} | {applied} "
            f"| {head_text} | {yes_no(verdict['causal_lm_upstream_class'])} "
            f"| {codes['patched']} / {codes['unpatched']} | {agrees} |")


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Generated by `{results['command']}` on {results['date']}: Python {results['python']}, "
        f"{results['platform']}, installed with {results['installer']}, {len(results['cells'])} cells "
        f"in {results['seconds'] / 60:.0f} min. Do not edit by hand.",
        "",
        "| torch | transformers | bug unpatched | default mode patched (sites) | affected heads, patched "
        "| causal LM gets upstream's class | `verify` exit, patched / unpatched | agrees with `_matrix` |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [table_row(record) for record in results["cells"]]
    lines += ["", "Heads, each sharded with FSDP2 and replicated with composable DDP, graded as "
              "`fsdp-autopatch verify` grades them on 2 gloo ranks, against the causal LM of the same "
              "run and wrapper: `trained` = two wrapped train steps matched an unwrapped copy's "
              "losses; `drifted` = the first loss matched, the second did not; `untrained` = "
              "`fully_shard` succeeded but this torch cannot train FSDP2 on CPU; `layout` = the "
              "`__class__` assignment error. A head passes when it does as well as the causal LM, "
              "which the patch never touches."]
    return portable_text("\n".join(lines))


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def capture_cli(python: str) -> str:
    """``fsdp-autopatch doctor``, ``verify`` and ``FSDP_AUTOPATCH=0 verify`` run with ``python``,
    as the README shows them: the command, its output as a terminal shows it (progress and
    warnings on stderr, the classes and the verdict on stdout), the exit code, every path portable."""
    shown = []
    for prefix, command, env in (("", "doctor", {}), ("", "verify", {}),
                                 ("FSDP_AUTOPATCH=0 ", "verify", {"FSDP_AUTOPATCH": "0"})):
        # One pipe for both streams: the console flushes every line, so they keep their order.
        result = subprocess.run([python, "-m", "fsdp_autopatch", command], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=Path(python).parent,
                                env=scrubbed_environment(NO_COLOR="1", **env), timeout=RUN_TIMEOUT,
                                check=False)
        shown.append(f"$ {prefix}fsdp-autopatch {command}\n{result.stdout}[exit {result.returncode}]\n")
    return portable_text(f"Captured on {now()}.\n\n```text\n" + "\n".join(shown) + "```")


README_STATUS = Path(__file__).parent / "programs" / "readme_status.py"


def capture_status(python: str) -> str:
    """``fsdp_autopatch.status().to_dict()`` after ``fully_shard`` of a tiny
    ``AutoModelForSequenceClassification`` (its decoder layers, then the root) on gloo with world
    size 1, run with ``python`` (an
    environment with the package installed from its wheel), as the README shows it."""
    result = subprocess.run([python, str(README_STATUS)], capture_output=True, text=True,
                            cwd=Path(python).parent, env=scrubbed_environment(NO_COLOR="1"),
                            timeout=RUN_TIMEOUT, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the status capture exited {result.returncode}:\n{result.stderr[-3000:]}")
    return portable_text(f"Captured on {now()}:\n\n```json\n{result.stdout.strip()}\n```")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--reduced", action="store_true",
                       help="the CI cells: " + ", ".join(map(":".join, REDUCED)))
    which.add_argument("--full", action="store_true",
                       help=f"{len(TORCH)} torch x {len(TRANSFORMERS)} transformers releases")
    which.add_argument("--cells", type=parse_cells, help="TORCH:TRANSFORMERS[,...]")
    which.add_argument("--capture-cli", metavar="PYTHON",
                       help="run doctor, verify and FSDP_AUTOPATCH=0 verify with this Python (an environment "
                            "with the package installed) and print them as the README shows them")
    parser.add_argument("--installer", choices=("auto", "uv", "pip"), default="auto")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "fsdp-autopatch-matrix",
                        help="download cache shared by all cells, kept between runs (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, help="where venvs are made (default: a new temporary dir)")
    parser.add_argument("--results", type=Path,
                        help="write the per-cell results (JSON) here (default: a new temporary file)")
    parser.add_argument("--update-docs", "--update-readme", dest="update_docs", action="store_true",
                        help=f"write the table into {VERSIONS_DOC.relative_to(ROOT)} (or the --capture-cli "
                             f"output into {CLI_DOC.relative_to(ROOT)} and README.md), between their markers")
    # The default now; accepted so that older CI scripts keep working.
    parser.add_argument("--no-readme", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keep-venvs", action="store_true", help="keep each cell's venv (for debugging)")
    options = parser.parse_args(argv)
    if options.capture_cli:
        captured = capture_cli(options.capture_cli)
        api = capture_status(options.capture_cli)
        if options.update_docs:
            replace_section(*CLI_MARKERS, captured, CLI_DOC)
            replace_section(*API_MARKERS, api, CLI_DOC)
        print(captured)
        print(api)
        return 0
    if options.full:
        cells = [(t, x) for t in TORCH for x in TRANSFORMERS]
    elif options.reduced:
        cells = list(REDUCED)
    else:
        cells = options.cells
    selection = "--full" if options.full else "--reduced" if options.reduced else (
        "--cells " + ",".join(map(":".join, cells)))

    started = time.monotonic()
    work = options.work_dir or Path(tempfile.mkdtemp(prefix="fsdp-autopatch-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "install.log"
    installer = Installer(options.installer, options.cache_dir, log)
    print(f"matrix: {len(cells)} cells with {installer.name}, cache {installer.cache}, work dir {work}",
          flush=True)
    wheel = installer.build_wheel(work / "dist")
    records = []
    for number, cell in enumerate(cells, 1):
        if cell in PRUNED:
            records.append({"torch_requested": cell[0], "transformers_requested": cell[1],
                            "pruned": PRUNED[cell]})
            continue
        record = run_cell(cell, installer, wheel, work, options.keep_venvs)
        record["verdict"] = judge(record)
        records.append(summary(record))
        problems = record["verdict"]["problems"]
        verdict = "agrees" if not problems else "DISAGREES: " + "; ".join(problems)
        print(f"[{number}/{len(cells)}] torch {cell[0]} + transformers {cell[1]} "
              f"({record['seconds']:.0f} s): {verdict}", flush=True)

    probe_python = next((r["python"] for r in records if "python" in r), platform.python_version())
    results = {
        # The cell selection only: local paths and installer options say nothing about the results.
        "command": "python tests/matrix.py " + selection,
        "date": now(),
        "python": probe_python, "platform": f"{platform.system()} {platform.machine()}",
        "installer": installer.version(), "seconds": round(time.monotonic() - started, 1), "cells": records,
    }
    table = markdown(results)
    if options.results is None:
        handle, name = tempfile.mkstemp(prefix="fsdp-autopatch-matrix-", suffix=".json")
        os.close(handle)
        options.results = Path(name)
    options.results.write_text(json.dumps(results, indent=1) + "\n")
    if options.update_docs and not options.no_readme:
        replace_section(*MARKERS, table, VERSIONS_DOC)
    print(table)
    failures = [r for r in records if r.get("verdict", {}).get("problems")]
    for record in failures:
        problems = "; ".join(record["verdict"]["problems"])
        print(f"MATRIX FAILURE: torch {record['torch_requested']} + transformers "
              f"{record['transformers_requested']}: {problems}", file=sys.stderr)
    if failures:
        print(f"install and build log: {log}", file=sys.stderr)
    elif not options.keep_venvs and options.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(f"results: {options.results}; {len(failures)} of {len(records)} cells fail "
          f"({results['seconds'] / 60:.1f} min)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
