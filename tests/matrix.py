"""Prove the version matrix on real installs: one virtual environment per (torch, transformers) cell.

    python tests/matrix.py --reduced      # CI: torch 2.8.0 + transformers 4.55.2, torch 2.13.0 +
                                          # transformers 4.53.3, 4.54.0, 4.55.3
    python tests/matrix.py --full         # every torch in TORCH x every transformers in TRANSFORMERS
    python tests/matrix.py --cells 2.13.0:4.54.0,2.8.0:4.55.2

Standard library only. Each cell gets a fresh venv holding torch, transformers and the package's
wheel (built once from this checkout), made with uv when it is on PATH (else pip), from one
download cache shared by all cells; the venv is deleted as soon as its cell is done. In the cell:

1. a probe, unpatched, says which of ``fsdp_autopatch._verify.MODELS`` the transformers release
   can build from a Qwen2 config, and whether each class has ``abc.ABC`` in its MRO;
2. ``python -m fsdp_autopatch._verify`` runs under torchrun on two gloo CPU ranks, once with
   ``FSDP_AUTOPATCH=0`` and once in the default mode, so the installed ``.pth`` is what patches.

What was measured (does the bug reproduce unpatched, did the default mode patch, does a sharded
train step of each affected head succeed, does the causal LM get upstream's exact class) is
compared with ``fsdp_autopatch._matrix``. The results go to a JSON file and, as a markdown table,
between ``<!-- matrix:start -->`` and ``<!-- matrix:end -->`` in README.md. Any cell that
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

ROOT = Path(__file__).resolve().parent.parent
# Cells are judged by the matrix of this checkout, the same code the wheel is built from.
sys.path.insert(0, str(ROOT))
from fsdp_autopatch import _config, _matrix  # noqa: E402
from fsdp_autopatch._verify import LAYOUT_ERROR, json_lines  # noqa: E402

TORCH = ("2.4.1", "2.5.1", "2.8.0", "2.13.0", "2.15.0")
# 4.53.3: last release before the ABC heads; 4.54.0 and 4.55.2: first and last with them;
# 4.55.3: the fix; 4.57.6: newest 4.x; 5.24.0: newest 5.x when this list was written.
TRANSFORMERS = ("4.53.3", "4.54.0", "4.55.2", "4.55.3", "4.57.6", "5.24.0")
REDUCED = (("2.8.0", "4.55.2"), ("2.13.0", "4.53.3"), ("2.13.0", "4.54.0"), ("2.13.0", "4.55.3"))
# Pairs that cannot be installed together, with the reason; the full matrix lists them as pruned.
# Every pair of TORCH x TRANSFORMERS resolves (transformers does not pin torch), so none is.
PRUNED: dict[tuple[str, str], str] = {}

AFFECTED_HEADS = ("token-classification", "sequence-classification", "question-answering")
CAUSAL_LM = "causal-lm"
# Sharded and unsharded copies train on the same batches from the same weights.
LOSS_TOLERANCE = 1e-4
MARKERS = ("<!-- matrix:start -->", "<!-- matrix:end -->")
INSTALL_TIMEOUT = 1800
RUN_TIMEOUT = 900

# Run in the cell's interpreter: which models this transformers can build, and their classes.
PROBE = """
import abc, json, sys
import torch, transformers
from fsdp_autopatch import _verify
models = {}
for kind in _verify.MODELS:
    try:
        cls = type(_verify.build_model(kind))
    except Exception as error:
        models[kind] = {"available": False, "error": f"{type(error).__name__}: {error}"[:300]}
    else:
        models[kind] = {"available": True, "class": cls.__name__, "abc_in_mro": abc.ABC in cls.__mro__}
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
                  "transformers": transformers.__version__, "models": models}))
"""

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
        with self.log.open("a") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=INSTALL_TIMEOUT,
                           check=True)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["UV_CACHE_DIR" if self.uv else "PIP_CACHE_DIR"] = str(self.cache)
        return env

    def build_wheel(self, out: Path) -> Path:
        if self.uv:
            self.run([self.uv, "build", "--wheel", "--out-dir", str(out), str(ROOT)], self.environment())
        else:
            self.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(ROOT)],
                     self.environment())
        (wheel,) = out.glob("fsdp_autopatch-*.whl")
        return wheel

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
        except subprocess.CalledProcessError:
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


def cell_environment(**overrides: str) -> dict[str, str]:
    """The runner's environment without this package's switches or PYTHONPATH, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH")}
    env.pop("PYTHONPATH", None)
    env.update(overrides)
    return env


def run_in_cell(command: list[str], env: dict[str, str], cwd: Path) -> list[dict[str, Any]]:
    """Run ``command`` in the cell; its JSON lines, or RuntimeError with the end of its stderr."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd,
                            timeout=RUN_TIMEOUT, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} exited {result.returncode}: {result.stderr[-3000:]}")
    return json_lines(result.stdout)


def verify(python: Path, kinds: list[str], cwd: Path, **env: str) -> dict[str, Any]:
    """``python -m fsdp_autopatch._verify`` on two gloo ranks; its status and per-model results."""
    command = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "fsdp_autopatch._verify", *kinds]
    retried = None
    try:
        lines = run_in_cell(command, cell_environment(**env), cwd)
    except RuntimeError as error:
        # Once, a rank was SIGKILLed from outside on a busy machine; a real failure repeats.
        retried = str(error)[-1000:]
        lines = run_in_cell(command, cell_environment(**env), cwd)
    if not lines or "status" not in lines[0]:
        raise RuntimeError(f"_verify printed no status line: {lines}")
    return {"status": lines[0]["status"], "models": {line["model"]: line for line in lines[1:]},
            "first_attempt_failed": retried}


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
        (probe,) = run_in_cell([str(python), "-c", PROBE], cell_environment(FSDP_AUTOPATCH="0"), venv)
        record.update(probe)
        kinds = [kind for kind, model in probe["models"].items() if model["available"]]
        if kinds:
            record["unpatched"] = verify(python, kinds, venv, FSDP_AUTOPATCH="0")
            record["patched"] = verify(python, kinds, venv)
        else:
            # Installed together, but this transformers builds no model on this torch (5.x refuses
            # torch < 2.6): there is nothing to shard, patched or not.
            errors = [model["error"] for model in probe["models"].values()]
            record["unusable"] = next((line.strip() for line in errors[0].splitlines()[1:] if line.strip()),
                                      errors[0])
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError, ValueError) as error:
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def head_outcome(result: Optional[dict[str, Any]]) -> str:
    """One word for a model's run: trained, drifted, diverged, sharded (no train step possible),
    layout (the bug), failed, absent."""
    if result is None:
        return "absent"
    if not result.get("sharded"):
        return "layout" if LAYOUT_ERROR in result.get("error", "") else "failed"
    if not result.get("trained", "losses" in result):
        return "sharded"
    if result["max_loss_difference"] <= LOSS_TOLERANCE:
        return "trained"
    # The first loss is computed before any gradient is reduced across ranks: if it matches, the
    # sharded model computes what the unsharded one does, and only the update differs.
    first_difference = abs(result["losses"][0] - result["reference_losses"][0])
    return "drifted" if first_difference <= LOSS_TOLERANCE else "diverged"


def judge(record: dict[str, Any]) -> dict[str, Any]:
    """Compare one cell's measurements with the matrix; ``problems`` lists every disagreement."""
    if "error" in record:
        return {"problems": [f"could not be run: {record['error'].splitlines()[0][:300]}"]}
    if "unusable" in record:
        row = _matrix.row_for(_matrix.TRANSFORMERS_ROWS, record["transformers"])
        affected = bool(row and row.affected)
        return {"problems": [f"the matrix says transformers {record['transformers']} is affected, "
                             f"but it builds no model here: {record['unusable']}"] if affected else []}
    torch_version, transformers_version = record["torch"], record["transformers"]
    decision = _matrix.decide(_config.AUTO, torch_version, transformers_version)
    torch_row = _matrix.row_for(_matrix.TORCH_ROWS, torch_version)
    transformers_row = _matrix.row_for(_matrix.TRANSFORMERS_ROWS, transformers_version)
    expected_bug = bool(torch_row and torch_row.affected and transformers_row and transformers_row.affected)
    unpatched, patched = record["unpatched"], record["patched"]
    models = record["models"]
    heads = [kind for kind in AFFECTED_HEADS if models[kind]["available"]]
    problems = []

    bug = any(head_outcome(unpatched["models"].get(kind)) == "layout" for kind in heads)
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
        if models[kind]["abc_in_mro"] != bool(transformers_row and transformers_row.affected):
            problems.append(f"{kind}: abc.ABC in MRO is {models[kind]['abc_in_mro']}, the matrix row says "
                            f"{bool(transformers_row and transformers_row.affected)}")

    # The causal LM never needs the patch: it is the control for what torch can do on this machine.
    # torch 2.4 cannot train FSDP2 on CPU at all ("sharded"), and on torch 2.8 two gloo ranks
    # update differently from one process ("drifted"): whatever the control does, the patched
    # models may do too, and nothing worse.
    control = head_outcome(unpatched["models"].get(CAUSAL_LM))
    can_train = control in ("trained", "drifted")
    if control not in ("trained", "drifted", "sharded"):
        problems.append(f"causal LM unpatched: {control}")
    outcomes = {kind: head_outcome(patched["models"].get(kind)) for kind in heads}
    heads_should_work = not expected_bug or decision.apply
    good = {"trained", control} if control in ("drifted", "sharded") else {"trained"}
    if heads_should_work:
        problems += [f"{kind} patched: {outcome}" for kind, outcome in outcomes.items()
                     if outcome not in good]

    causal = patched["models"].get(CAUSAL_LM, {})
    same_class = (causal.get("sharded") and causal.get("upstream_bases") is True
                  and causal.get("wrapper") == unpatched["models"].get(CAUSAL_LM, {}).get("wrapper"))
    if not same_class:
        problems.append("causal LM patched: not upstream's exact class")
    if head_outcome(causal) not in good:
        problems.append(f"causal LM patched: {head_outcome(causal)}")
    return {
        "expected_bug": expected_bug, "expected_apply": decision.apply, "decision": decision.reason,
        "bug_unpatched": bug, "applied": applied, "heads": outcomes, "control": control,
        "train_step_possible": can_train,
        "train_error": None if can_train else unpatched["models"].get(CAUSAL_LM, {}).get("train_error"),
        "causal_lm_upstream_class": bool(same_class), "problems": problems,
    }


def yes_no(value: bool) -> str:
    return "yes" if value else "no"


def table_row(record: dict[str, Any]) -> str:
    torch_version, transformers_version = record["torch_requested"], record["transformers_requested"]
    if "pruned" in record:
        return f"| {torch_version} | {transformers_version} | pruned: {record['pruned']} | | | | |"
    verdict = record["verdict"]
    cell = f"{torch_version} | {transformers_version}"
    if "unusable" in record:
        return f"| {cell} | not usable together: {record['unusable']} | | | | n/a |"
    if "error" in record:
        return f"| {cell} | not run | | | | **NO**: {verdict['problems'][0]} |"
    heads = verdict["heads"]
    if not heads:
        head_text = "none built (" + ", ".join(
            f"{kind}: {model['error'].split(':')[0]}" for kind, model in record["models"].items()
            if not model["available"]) + ")"
    else:
        outcomes = list(heads.values())
        head_text = ", ".join(f"{outcomes.count(outcome)}/{len(heads)} {outcome}"
                              for outcome in sorted(set(outcomes)))
        if not verdict["train_step_possible"]:
            head_text += " (no train step possible on CPU: " + str(verdict["train_error"])[:60] + ")"
        elif verdict["control"] == "drifted":
            head_text += " (the unpatched causal LM drifts alike)"
    applied = yes_no(verdict["applied"])
    if verdict["applied"]:
        applied += f" ({', '.join(site.rsplit('.', 1)[-1] for site in record['patched']['status']['sites'])})"
    agrees = "yes" if not verdict["problems"] else "**NO**: " + "; ".join(verdict["problems"])
    return (f"| {torch_version} | {transformers_version} | {yes_no(verdict['bug_unpatched'])} | {applied} "
            f"| {head_text} | {yes_no(verdict['causal_lm_upstream_class'])} | {agrees} |")


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Generated by `{results['command']}` on {results['date']}: Python {results['python']}, "
        f"{results['platform']}, installed with {results['installer']}, {len(results['cells'])} cells "
        f"in {results['seconds'] / 60:.0f} min. Do not edit by hand.",
        "",
        "| torch | transformers | bug unpatched | default mode patched (site) | affected heads, patched "
        "| causal LM gets upstream's class | agrees with `_matrix` |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [table_row(record) for record in results["cells"]]
    lines += ["", "Heads: `trained` = two sharded train steps on 2 gloo ranks matched an unsharded "
              "copy's losses; `drifted` = the first loss matched, the second did not, as for the "
              "unpatched causal LM on the same torch; `sharded` = `fully_shard` succeeded but this torch "
              "cannot train FSDP2 on CPU (no model can); `layout` = the `__class__` assignment error."]
    return "\n".join(lines)


def write_readme(table: str) -> None:
    readme = ROOT / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    start, end = MARKERS
    if start not in text or end not in text or text.index(start) > text.index(end):
        print(f"README.md has no {start} ... {end} markers: table not written there", file=sys.stderr)
        return
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    readme.write_text(f"{before}{start}\n{table}\n{end}{after}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--reduced", action="store_true",
                       help="the CI cells: " + ", ".join(map(":".join, REDUCED)))
    which.add_argument("--full", action="store_true",
                       help=f"{len(TORCH)} torch x {len(TRANSFORMERS)} transformers releases")
    which.add_argument("--cells", type=parse_cells, help="TORCH:TRANSFORMERS[,...]")
    parser.add_argument("--installer", choices=("auto", "uv", "pip"), default="auto")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "fsdp-autopatch-matrix",
                        help="download cache shared by all cells, kept between runs (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, help="where venvs are made (default: a new temporary dir)")
    parser.add_argument("--results", type=Path, default=ROOT / "tests" / "matrix-results.json")
    parser.add_argument("--no-readme", action="store_true", help="do not write the table into README.md")
    parser.add_argument("--keep-venvs", action="store_true", help="keep each cell's venv (for debugging)")
    options = parser.parse_args(argv)
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
        records.append(record)
        problems = record["verdict"]["problems"]
        verdict = "agrees" if not problems else "DISAGREES: " + "; ".join(problems)
        print(f"[{number}/{len(cells)}] torch {cell[0]} + transformers {cell[1]} "
              f"({record['seconds']:.0f} s): {verdict}", flush=True)

    probe_python = next((r["python"] for r in records if "python" in r), platform.python_version())
    results = {
        # The cell selection only: local paths and installer options say nothing about the results.
        "command": "python tests/matrix.py " + selection,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": probe_python, "platform": f"{platform.system()} {platform.machine()}",
        "installer": installer.version(), "seconds": round(time.monotonic() - started, 1), "cells": records,
    }
    table = markdown(results)
    results["table"] = table
    options.results.write_text(json.dumps(results, indent=1) + "\n")
    if not options.no_readme:
        write_readme(table)
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
