"""What ``fsdp-autopatch verify`` prints, read and checked for the tests: tests/test_readme.py
runs the README's two verify commands (patched, and with FSDP_AUTOPATCH=0) and checks them here;
tests/test_cli.py reads its other runs with the same helpers.
"""

from __future__ import annotations

import re
import subprocess

from harness import AFFECTED

from fsdp_autopatch import _verify

ALL_TRAINED = "OK: 8 of 8 runs wrapped and trained"
# verify's verdict where the start-up file armed the ranks and the patch fixed the bug: the README
# quotes it (tests/test_readme.py).
FIXED_VERDICT = f"{ALL_TRAINED}; fixed by the patch, armed by fsdp_autopatch.pth at interpreter start"
# The classes _verify's tiny Qwen2 models are made of, per head.
HEAD_CLASSES = {"token-classification": "Qwen2ForTokenClassification",
                "sequence-classification": "Qwen2ForSequenceClassification",
                "question-answering": "Qwen2ForQuestionAnswering"}
CLASSES_HEADER = "classes the patch built, per rank:"


def results_shown(stderr: str) -> dict[str, str]:
    """Per run, the result word of verify's progress line for it (``[3/8] question-answering:
    wrapped (0.1 s)``)."""
    found = {}
    for line in stderr.splitlines():
        match = re.match(r"^\[\d+/\d+\] (.+): (.+) \(\d+\.\d s\)$", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def classes_shown(stdout: str) -> list[str]:
    """The per-rank class lines verify prints before its verdict."""
    rows = stdout.splitlines()
    start = rows.index(CLASSES_HEADER)
    return [row.strip() for row in rows[start + 1 : -1]]


def assert_verify_shows_the_fix(
    fixed: subprocess.CompletedProcess[str], broken: subprocess.CompletedProcess[str], bug: bool
) -> None:
    """``verify`` patched wraps and trains every model; with FSDP_AUTOPATCH=0 the heads fail with
    the layout error where this torch and Python have the bug (``bug``), and nothing breaks where
    they do not."""
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    runs = _verify.runs((*AFFECTED, "causal-lm"))  # each with fully_shard, then with composable DDP
    assert results_shown(fixed.stderr) == {run: "wrapped" for run in runs}, fixed.stderr
    verdict = fixed.stdout.splitlines()[-1]
    # The patch is not installed at all: no class goes through a patched site.
    assert classes_shown(broken.stdout) == [
        "rank 0: no class went through a patched site (the patch was not applied)"]
    if not bug:
        # CPython accepts torch's classes: the patch stands aside, and nothing breaks without it.
        assert verdict.startswith(f"{ALL_TRAINED}; no patch was needed: ")
        assert "patch not applied: " in fixed.stderr
        assert broken.returncode == 0, broken.stdout + broken.stderr
        return
    assert verdict == FIXED_VERDICT
    assert "patch applied: " in fixed.stderr
    # Each head got a class built on abc.ABC at each site; the decoder layer and the causal LM
    # kept torch's.
    assert classes_shown(fixed.stdout) == [
        *(f"rank 0: {name} -> {prefix}{name} on abc.ABC" for prefix in ("FSDP", "DDP")
          for name in HEAD_CLASSES.values()),
        "rank 0: torch's own class kept for 3: FSDPQwen2DecoderLayer, FSDPQwen2ForCausalLM, "
        "DDPQwen2ForCausalLM"]

    assert broken.returncode == 1, broken.stdout + broken.stderr
    expected = (["layout error"] * 3 + ["wrapped"]) * 2
    assert list(results_shown(broken.stderr).values()) == expected, broken.stderr
    assert broken.stdout.splitlines()[-1] == (
        "FAIL: 6 of 8 runs hit the layout error; the patch was not applied: disabled by FSDP_AUTOPATCH=0; "
        "unset FSDP_AUTOPATCH to let the patch run")
