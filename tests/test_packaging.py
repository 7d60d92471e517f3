"""What the distribution holds, what installing it puts in an environment, and what it asks for."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from conftest import ROOT, environment, repository_file, run_python
from harness import make_venv, run_logged

from fsdp_autopatch import __version__

DISTRIBUTION = "fsdp-autopatch"
HOME = "https://github.com/fsdp-autopatch/fsdp-autopatch"
# What a reader of the sdist needs besides the package: the tests, the docs and the fix torch needs.
# hatch_build.py: the build hook a wheel built from the sdist needs.
SDIST_DOCS = ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "SECURITY.md", "LICENSE", "hatch_build.py",
              "benchmarks/README.md", "tests/noxfile.py", "upstream/README.md", "upstream/torch.diff",
              "upstream/test_wrapper_cls.py", "upstream/make_diff.py", "upstream/lint.py",
              "tests/conftest.py", "tests/harness.py", "benchmarks/run.py", "benchmarks/results/results.md",
              *sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md")))
# Generated dumps: their tables are in the docs, their raw data stays with whoever ran them.
RESULT_DUMPS = ("tests/matrix-results.json", "benchmarks/results/results.json")


def test_only_wrapt_is_required(installed: Path) -> None:
    """torch and transformers are what the package patches: installing it must never pull them."""
    requirements = [r for r in metadata.requires(DISTRIBUTION) or [] if "extra ==" not in r]
    # The name only: the wrapt floor is a fact of its own, tested where it is installed.
    assert [re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] for r in requirements] == ["wrapt"]
    assert metadata.metadata(DISTRIBUTION)["Requires-Python"] == ">=3.9"


def test_start_up_files_sit_at_the_root_of_site_packages(installed: Path) -> None:
    # PEP 610: pip records an editable install in direct_url.json.
    direct_url = json.loads(metadata.distribution(DISTRIBUTION).read_text("direct_url.json") or "{}")
    if direct_url.get("dir_info", {}).get("editable"):
        pytest.skip("fsdp-autopatch is an editable install here: its files list holds a path entry to "
                    "the checkout, not the package's modules; install its wheel (nox -f tests/noxfile.py "
                    "-s tests) to test what the wheel puts in site-packages")
    files = {str(path) for path in metadata.files(DISTRIBUTION) or []}
    assert {"fsdp_autopatch.pth", "fsdp_autopatch.start", "_fsdp_autopatch_plugin.py",
            "fsdp_autopatch/__init__.py"} <= files
    entry_points = metadata.distribution(DISTRIBUTION).entry_points
    scripts = {ep.name: ep.value for ep in entry_points if ep.group == "console_scripts"}
    assert scripts == {"fsdp-autopatch": "fsdp_autopatch._cli:main"}
    # torch's plugin route: one entry point, in a module of its own at the root.
    plugins = {ep.name: ep.value for ep in entry_points if ep.group == "torch.backends"}
    assert plugins == {"fsdp_autopatch": "_fsdp_autopatch_plugin:autoload"}


@pytest.mark.slow
def test_editable_install_arms_and_uninstalls_cleanly(tmp_path: Path) -> None:
    python = str(make_venv(tmp_path / "editable", with_pip=True).python)
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "install", "-e", str(ROOT)], check=True, timeout=600, env=environment())
    purelib = run_python("import sysconfig; print(sysconfig.get_paths()['purelib'])", python=python)
    site_packages = Path(purelib.stdout.strip())
    assert {"fsdp_autopatch.pth", "fsdp_autopatch.start"} <= {p.name for p in site_packages.iterdir()}
    armed = run_python("import sys; print(type(sys.meta_path[0]).__name__)", python=python)
    assert (armed.stdout, armed.stderr) == ("FirstImportWatcher\n", "")

    subprocess.run([*pip, "uninstall", "--yes", DISTRIBUTION], check=True, timeout=600, env=environment())
    assert not [p.name for p in site_packages.iterdir() if "fsdp" in p.name.lower()]
    after = run_python("import sys; print(sorted(m for m in sys.modules if 'fsdp' in m))", python=python)
    assert (after.stdout, after.stderr) == ("[]\n", "")


@pytest.fixture(scope="module")
def distributions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel, built from the checkout as a release would build them."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("the build package is not installed; the nox tests session installs it")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=600, env=environment())
    (sdist,) = out.glob("fsdp_autopatch-*.tar.gz")
    (wheel,) = out.glob("fsdp_autopatch-*.whl")
    return {"sdist": sdist, "wheel": wheel}


def sdist_files(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as archive:
        # Every member sits under "fsdp_autopatch-<version>/".
        return {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}


@pytest.mark.slow
def test_the_sdist_ships_package_tests_docs_and_license_but_no_result_dumps(
    distributions: dict[str, Path]
) -> None:
    files = sdist_files(distributions["sdist"])
    tracked = subprocess.run(["git", "ls-files", "fsdp_autopatch", "tests"], cwd=ROOT, capture_output=True,
                             text=True, check=False).stdout.split()
    expected = {*SDIST_DOCS, "fsdp_autopatch.pth", "fsdp_autopatch.start", "pyproject.toml",
                *(name for name in tracked if name.endswith(".py"))}
    assert not expected - files, f"missing from the sdist: {sorted(expected - files)}"
    assert not files & set(RESULT_DUMPS)
    assert not [name for name in files if name.endswith(".json") and "results" in name]
    assert not [name for name in files if "__pycache__" in name or "/.nox/" in f"/{name}"]
    with tarfile.open(distributions["sdist"]) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.endswith("/LICENSE") and m.name.count("/") < 2]
        shipped = archive.extractfile(member)
        assert shipped is not None and shipped.read() == (ROOT / "LICENSE").read_bytes()


@pytest.mark.slow
def test_the_wheel_carries_the_license_and_the_project_urls(distributions: dict[str, Path]) -> None:
    with zipfile.ZipFile(distributions["wheel"]) as wheel:
        names = wheel.namelist()
        (license_file,) = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
        assert wheel.read(license_file) == (ROOT / "LICENSE").read_bytes()
        (metadata_file,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        fields = Parser().parsestr(wheel.read(metadata_file).decode())
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert fields["License-Expression"] == "MIT"
    assert fields.get_all("License-File") == ["LICENSE"]
    assert sorted(fields.get_all("Project-URL") or []) == [
        f"Changelog, {HOME}/blob/main/CHANGELOG.md", f"Documentation, {HOME}/tree/main/docs",
        f"Homepage, {HOME}", f"Issues, {HOME}/issues", f"Source, {HOME}"]
    # The oldest Python named in the classifiers is the one Requires-Python admits.
    prefix = "Programming Language :: Python :: 3."
    minors = [int(c[len(prefix):]) for c in fields.get_all("Classifier") or [] if c.startswith(prefix)]
    assert minors and f">=3.{min(minors)}" == fields["Requires-Python"]


# A markdown link or image target: "](target)". Relative unless it names a scheme or is an anchor.
LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")
ABSOLUTE_OR_ANCHOR = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*:|#")


@pytest.mark.slow
def test_the_package_page_links_to_the_docs_of_the_tagged_commit(distributions: dict[str, Path]) -> None:
    """The index shows the wheel's long description; a relative link there leads nowhere."""
    with zipfile.ZipFile(distributions["wheel"]) as wheel:
        (metadata_file,) = [name for name in wheel.namelist() if name.endswith(".dist-info/METADATA")]
        fields = Parser().parsestr(wheel.read(metadata_file).decode())
    assert fields["Description-Content-Type"] == "text/markdown"
    description = fields.get_payload()
    targets = LINK_TARGET.findall(description)
    readme_targets = LINK_TARGET.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(targets) == len(readme_targets) > 0
    relative = [target for target in targets if not ABSOLUTE_OR_ANCHOR.match(target)]
    assert relative == [], f"relative links in the wheel's description: {relative}"
    # Each README link now names the same file in the repository at the release's tag.
    for target, original in zip(targets, readme_targets):
        if not ABSOLUTE_OR_ANCHOR.match(original):
            assert target == f"{HOME}/blob/v{__version__}/{original}"
            assert (ROOT / original.split("#")[0]).is_file(), f"the README links to a missing {original}"


def build_tools(where: Path, *requirements: str) -> str:
    """A venv with pip and ``requirements`` (the build tools); its Python."""
    venv = make_venv(where, with_pip=True)
    run_logged([str(venv.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                *requirements], None, env=environment())
    return str(venv.python)


def build_at_commit_time(source: Path, out: Path, python: str, *flags: str) -> dict[str, bytes]:
    """The sdist and the wheel of the clone ``source``, built as the release workflow builds them:
    ``python -m build --no-isolation`` with the tools of ``python``'s venv and
    ``SOURCE_DATE_EPOCH`` from the commit. Their bytes, by file name."""
    epoch = run_logged(["git", "-C", str(source), "log", "-1", "--format=%ct"], None).strip()
    run_logged([python, "-m", "build", "--no-isolation", *flags, "--sdist", "--wheel", "--outdir", str(out),
                str(source)], None, env=environment(SOURCE_DATE_EPOCH=epoch))
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


def wheel_metadata(wheel: bytes) -> dict[str, str]:
    with zipfile.ZipFile(io.BytesIO(wheel)) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return dict(Parser().parsestr(archive.read(name).decode()).items())


# The hatchling release before the declared floor: it builds, but writes no License-Expression.
BELOW_THE_FLOOR = "1.26.3"


def declared_floor() -> str:
    match = re.search(r'^requires = \["hatchling>=([0-9.]+)"\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert match is not None, "pyproject.toml's [build-system] requires names no hatchling>=X"
    return match.group(1)


@pytest.mark.slow
@pytest.mark.ci_tier
def test_one_commit_builds_byte_identical_distributions_and_the_declared_floor_builds(tmp_path: Path) -> None:
    """Anyone can rebuild a release from its tag and compare: with the release's own build tools
    (.ci/release-tools), two clones of the commit, at paths that differ (one with a space and
    non-ASCII characters), build the same bytes. And the oldest hatchling ``[build-system]``
    allows builds it with its license expression, which the release before it cannot write."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout: the build time comes from the commit")
    tools = subprocess.run([sys.executable, str(repository_file(".ci/release-tools"))], capture_output=True,
                           text=True, check=True, env=environment(), timeout=60).stdout.split()
    python = build_tools(tmp_path / "release-tools", *tools)
    builds, clones = [], []
    for number, name in enumerate(("first", "an other clône")):
        clone = tmp_path / name / "fsdp-autopatch"
        run_logged(["git", "clone", "--quiet", str(ROOT), str(clone)], None, env=environment())
        clones.append(clone)
        builds.append(build_at_commit_time(clone, tmp_path / f"dist-{number}", python))
    first, second = builds
    wheel_name = f"fsdp_autopatch-{__version__}-py3-none-any.whl"
    assert sorted(first) == [wheel_name, f"fsdp_autopatch-{__version__}.tar.gz"]
    assert sorted(first) == sorted(second)
    differing = [name for name in first if first[name] != second[name]]
    assert differing == [], f"two builds of one commit differ: {differing}"
    assert wheel_metadata(first[wheel_name])["License-Expression"] == "MIT"
    build = next(tool for tool in tools if tool.startswith("build=="))
    # --skip-dependency-check: below the floor, build would refuse to try.
    for hatchling, expression in ((declared_floor(), "MIT"), (BELOW_THE_FLOOR, None)):
        python = build_tools(tmp_path / f"hatchling-{hatchling}", build, f"hatchling=={hatchling}")
        built = build_at_commit_time(clones[0], tmp_path / f"dist-{hatchling}", python,
                                     "--skip-dependency-check")
        assert wheel_metadata(built[wheel_name]).get("License-Expression") == expression, hatchling
