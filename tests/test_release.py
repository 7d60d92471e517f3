"""The release rules: a tag is released only when it is the package's version and CHANGELOG.md
describes it (.ci/check-release, which the release workflow runs), and the workflows keep to what
docs/releasing.md promises: actions pinned to tagged commits, OIDC only where PyPI is published to,
no token, and CI running the README's test command."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, environment, repository_file
from harness import README
from test_harness import MACHINE_PATH

from fsdp_autopatch import __version__

CHECK_RELEASE = ".ci/check-release"
WORKFLOWS = ".github/workflows"
CHANGELOG = ROOT / "CHANGELOG.md"
TEST_COMMAND = "nox -f tests/noxfile.py -s tests"
# `uses: owner/repo@<40 hex>  # vX.Y.Z`: the commit of a release tag, and which tag it is.
PINNED = re.compile(r"^\s*(?:- )?uses: [\w.-]+/[\w./-]+@[0-9a-f]{40}  # v\d+(\.\d+)*$")


def check_release(tag: str, root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(repository_file(CHECK_RELEASE)), tag, "--root", str(root)],
                          capture_output=True, text=True, env=environment(), timeout=60, check=False)


def checkout_with(tmp_path: Path, version: str, changelog: str) -> Path:
    """A checkout with only what the rule reads: the package's __init__.py and CHANGELOG.md."""
    (tmp_path / "fsdp_autopatch").mkdir()
    (tmp_path / "fsdp_autopatch" / "__init__.py").write_text(f'"""doc"""\n\n__version__ = "{version}"\n')
    (tmp_path / "CHANGELOG.md").write_text(changelog)
    return tmp_path


def test_the_current_version_is_refused_while_changes_wait_under_unreleased() -> None:
    """Until the next version's entry is written, tagging the current version would publish
    unreleased changes under an entry that does not list them."""
    unreleased = CHANGELOG.read_text(encoding="utf-8").split("## Unreleased\n", 1)[1].split("\n## ", 1)[0]
    if not re.search(r"^- ", unreleased, re.M):
        pytest.skip("nothing is listed under Unreleased now; the temporary checkouts below cover the rule")
    result = check_release(f"v{__version__}")
    assert result.returncode == 1 and "CHANGELOG.md still lists changes under Unreleased" in result.stderr


@pytest.mark.parametrize("tag", ["v0.0.1", __version__, f"v{__version__}.post1", f"V{__version__}"])
def test_a_tag_other_than_the_version_is_refused(tag: str) -> None:
    result = check_release(tag)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (f"check-release: tag {tag} does not match the package version {__version__}; "
                             f"tag v{__version__}, or set __version__ in fsdp_autopatch/__init__.py and "
                             "commit before tagging\n")


@pytest.mark.parametrize(("changelog", "why"), [
    ("# Changelog\n\n## Unreleased\n\n## 1.1.0 - 2026-01-01\n\n- older\n",
     "CHANGELOG.md has no '## 1.2.0 - YYYY-MM-DD' entry"),
    ("# Changelog\n\n## 1.2.0 - soon\n\n- a change\n", "CHANGELOG.md's entry for 1.2.0 is dated 'soon'"),
    ("# Changelog\n\n## 1.2.0 - 2026-13-01\n\n- a change\n", "is dated '2026-13-01'"),
    ("# Changelog\n\n## 1.2.0 - 2026-02-01\n\nNothing yet.\n\n## 1.1.0 - 2026-01-01\n\n- older\n",
     "CHANGELOG.md's entry for 1.2.0 lists no change"),
    ("# Changelog\n\n## 1.2.0rc1 - 2026-02-01\n\n- the candidate\n", "has no '## 1.2.0 - YYYY-MM-DD' entry"),
    ("# Changelog\n\n## Unreleased\n\n- not yet\n\n## 1.2.0 - 2026-02-01\n\n- a change\n",
     "CHANGELOG.md still lists changes under Unreleased; move them under '## 1.2.0 - YYYY-MM-DD'"),
])
def test_a_version_the_changelog_does_not_describe_is_refused(
    tmp_path: Path, changelog: str, why: str
) -> None:
    result = check_release("v1.2.0", checkout_with(tmp_path, "1.2.0", changelog))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("check-release: ") and why in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_dated_entry_with_changes_is_enough(tmp_path: Path) -> None:
    changelog = "# Changelog\n\n## Unreleased\n\n## 1.2.0 - 2026-02-01\n\n- a change\n- another\n"
    result = check_release("v1.2.0", checkout_with(tmp_path, "1.2.0", changelog))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == ("check-release: v1.2.0 releases fsdp-autopatch 1.2.0, which CHANGELOG.md "
                             "describes\n")


def test_the_changelog_dates_every_version_and_describes_the_current_one() -> None:
    headings = re.findall(r"^## (.+)$", CHANGELOG.read_text(encoding="utf-8"), re.M)
    assert headings[0] == "Unreleased"
    versions = [heading.split(" - ")[0] for heading in headings[1:]]
    assert all(re.fullmatch(r"\d+\.\d+\.\d+ - \d{4}-\d{2}-\d{2}", heading) for heading in headings[1:])
    assert __version__ in versions and versions[-1] == "0.1.0"
    # Newest first.
    assert versions == sorted(versions, key=lambda v: tuple(map(int, v.split("."))), reverse=True)


@pytest.mark.parametrize("name", ["CHANGELOG.md", ".github/workflows/ci.yml",
                                  ".github/workflows/release.yml"])
def test_the_release_files_name_no_machine_path(name: str) -> None:
    path = ROOT / name if name == "CHANGELOG.md" else repository_file(name)
    assert MACHINE_PATH.findall(path.read_text(encoding="utf-8")) == []


def workflow_text(workflow: str) -> str:
    return repository_file(f"{WORKFLOWS}/{workflow}").read_text(encoding="utf-8")


def jobs(workflow: str) -> dict[str, str]:
    """The text of each job of a workflow, by its id (the workflows are indented by two spaces)."""
    text = workflow_text(workflow)
    body = text.split("\njobs:\n", 1)[1]
    return dict(re.findall(r"^  ([\w-]+):\n((?:(?:    .*)?\n)*)", body, re.M))


@pytest.mark.parametrize("workflow", ["ci.yml", "release.yml"])
def test_every_action_is_pinned_to_a_tagged_commit(workflow: str) -> None:
    uses = [line for line in workflow_text(workflow).splitlines()
            if re.match(r"^\s*(- )?uses:", line)]
    assert uses and [line for line in uses if not PINNED.match(line)] == []


def test_docs_releasing_lists_every_pinned_action_as_the_workflows_pin_it() -> None:
    pins = {
        match.groups()
        for workflow in ("ci.yml", "release.yml")
        for match in re.finditer(r"uses: ([\w.-]+/[\w./-]+)@([0-9a-f]{40})  # (v[\d.]+)$",
                                 workflow_text(workflow), re.M)
    }
    table = set(re.findall(r"^\| `([\w.-]+/[\w./-]+)` \| (v[\d.]+) \| `([0-9a-f]{40})` \|$",
                           (ROOT / "docs" / "releasing.md").read_text(encoding="utf-8"), re.M))
    assert pins and table == {(action, tag, sha) for action, sha, tag in pins}


@pytest.mark.parametrize("workflow", ["ci.yml", "release.yml"])
def test_no_job_gets_more_than_it_needs(workflow: str) -> None:
    text = workflow_text(workflow)
    assert "\npermissions: {}\n" in text
    for name, job in jobs(workflow).items():
        assert "\n    permissions:" in f"\n{job}", f"{workflow}'s job {name} does not say its permissions"
        assert job.count("persist-credentials: false") == job.count("actions/checkout@"), name
    assert "secrets." not in text and "password:" not in text


def test_only_the_publishing_job_may_ask_for_an_oidc_token() -> None:
    release = jobs("release.yml")
    assert [name for name, job in release.items() if "id-token: write" in job] == ["publish"]
    publish = release["publish"]
    assert "environment:\n      name: pypi\n" in publish and "pypa/gh-action-pypi-publish@" in publish
    assert "actions/checkout@" not in publish
    assert "id-token" not in workflow_text("ci.yml")


def test_the_release_publishes_the_files_it_built_and_tested() -> None:
    text = workflow_text("release.yml")
    assert re.search(r'^on:\n  push:\n    tags: \["v\*"\]\n', text, re.M)
    release = jobs("release.yml")
    assert 'python .ci/check-release "$TAG"' in release["check"]
    assert "needs: check" in release["build"] and "python -m build" in release["build"]
    assert "needs: build" in release["test"] and "needs: [build, test]" in release["publish"]
    # One build: the other jobs take its artifact and never build.
    for name in ("test", "publish"):
        assert "actions/download-artifact@" in release[name] and "python -m build" not in release[name]
    assert "fsdp-autopatch verify" in release["test"]
    assert "FSDP_AUTOPATCH=0 venv/bin/fsdp-autopatch verify" in release["test"]


def test_ci_runs_the_readmes_test_command_word_for_word() -> None:
    readme_lines = [line for line in README.read_text(encoding="utf-8").splitlines() if TEST_COMMAND in line]
    ci = [line.strip() for line in workflow_text("ci.yml").splitlines()]
    assert readme_lines and all(line in ci for line in readme_lines)


def release_tools() -> list[str]:
    result = subprocess.run([sys.executable, str(repository_file(".ci/release-tools"))], capture_output=True,
                            text=True, env=environment(), timeout=60, check=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return result.stdout.split()


def test_the_publisher_reads_what_the_build_writes_and_ci_checks_with_its_twine() -> None:
    """The pinned publisher bundles a twine that reads Metadata-Version 2.5 (v1.14.2 or later,
    twine 7): CI builds with the release's very tools and runs that twine's check, so a
    publisher that cannot read the build fails CI, not the tag."""
    tools = release_tools()
    assert [tool.split("==")[0] for tool in tools] == ["build", "hatchling", "twine"]
    twine = tools[2].split("==")[1]
    assert tuple(map(int, twine.split("."))) >= (7, 0, 0)
    publish = jobs("release.yml")["publish"]
    pin = re.search(r"pypa/gh-action-pypi-publish@[0-9a-f]{40}  # v(\d+)\.(\d+)\.(\d+)", publish)
    assert pin is not None and tuple(map(int, pin.groups())) >= (1, 14, 2)
    assert f"bundles twine=={twine}" in publish and "attestations: true" in publish
    install = 'read -ra tools < <(python .ci/release-tools)'
    for where in (jobs("release.yml")["build"], workflow_text("ci.yml")):
        assert install in where and "python -m build --no-isolation" in where
        assert "twine check --strict" in where
    ci_run = repository_file(".ci/run").read_text(encoding="utf-8")
    assert "read -ra release_tools < <(python3 .ci/release-tools)" in ci_run
    assert "python -m build --no-isolation" in ci_run and 'twine check --strict "$dist"/*' in ci_run


def test_docs_releasing_records_the_release_tools() -> None:
    releasing = (ROOT / "docs" / "releasing.md").read_text(encoding="utf-8")
    for tool in release_tools():
        assert f"`{tool}`" in releasing, f"docs/releasing.md does not record {tool}"


def test_release_tools_say_in_one_line_when_release_yml_names_no_twine(tmp_path: Path) -> None:
    ci = tmp_path / ".ci"
    ci.mkdir()
    shutil.copy(repository_file(".ci/release-tools"), ci / "release-tools")
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    (tmp_path / ".github" / "workflows" / "release.yml").write_text("jobs: {}\n")
    result = subprocess.run([sys.executable, str(ci / "release-tools")], capture_output=True, text=True,
                            env=environment(), timeout=60, check=False)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("release-tools: release.yml names no twine")
