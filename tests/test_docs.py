"""The README and the changelog, which the strict docs build (`make docs`) does not read: short, their links
alive, and the source archive carries what they point to."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(markdown: Path) -> list[str]:
    """The targets of the file's Markdown links that are neither URLs nor anchors on the same page."""
    return [t for t in _LINK.findall(markdown.read_text()) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the details into docs/"


def test_the_readme_and_changelog_link_to_files_that_exist():
    for name in ("README.md", "CHANGELOG.md"):
        missing = [t for t in relative_links(ROOT / name) if not (ROOT / t.split("#")[0]).exists()]
        assert not missing, f"{name} links to files that do not exist: {missing}"
    assert any(t.startswith("docs/") for t in relative_links(ROOT / "README.md"))


def test_the_changelog_has_an_unreleased_section_and_dated_versions():
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == "Unreleased"
    assert all(re.fullmatch(r"\d+\.\d+\.\d+ - \d{4}-\d{2}-\d{2}", h) for h in headings[1:]), headings


def test_the_source_archive_carries_the_docs_and_what_the_readme_runs(tmp_path):
    # from a clean copy: an egg-info left by an earlier build would list its files again
    source = tmp_path / "source"
    leftovers = shutil.ignore_patterns(".*", "*.egg-info", "build", "dist", "site", "airflow_home", "__pycache__")
    shutil.copytree(ROOT, source, ignore=leftovers)
    build = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path)], cwd=source, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / done.stdout.split()[-1]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = {"docs/index.md", "mkdocs.yml", "CHANGELOG.md", "constraints.txt", "scripts/install_horovod.py"}
    assert wanted <= names, f"missing from the sdist: {sorted(wanted - names)}"


def test_the_docs_build_fails_on_a_broken_link_or_reference(tmp_path):
    """mkdocs.yml itself is strict: a dead link, a missing anchor or an unresolved reference fails the build."""
    for part in ("docs", "airflow_provider_hvd", "scripts"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("mkdocs.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / part, tmp_path / part)
    build = [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(tmp_path / "site")]
    with (tmp_path / "docs" / "index.md").open("a") as page:
        page.write("\n[gone](gone.md) [no anchor](guide/runner.md#nowhere) [nothing][airflow_provider_hvd.Nothing]\n")
    broken = subprocess.run(build, cwd=tmp_path, capture_output=True, text=True)
    assert broken.returncode != 0
    for named in ("gone.md", "#nowhere", "airflow_provider_hvd.Nothing"):
        assert named in broken.stderr, broken.stderr
