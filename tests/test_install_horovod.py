"""scripts/install_horovod.py's unpacking of horovod's sdist, on the Python 3.11 releases it must run with: it runs
before anything is installed, with whatever python3 the machine or the image has (Debian bookworm's is 3.11.2,
whose tarfile has no extraction filters)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
NO_FILTER = "import sys, tarfile; sys.exit(sys.version_info[:2] != (3, 11) or hasattr(tarfile, 'data_filter'))"


def python_without_extraction_filters() -> str | None:
    """A Python 3.11 older than 3.11.4 (no ``tarfile.data_filter``) on this machine, if there is one."""
    for name in ("/usr/bin/python3.11", "/usr/bin/python3", shutil.which("python3.11"), shutil.which("python3")):
        if name and Path(name).exists() and subprocess.run([name, "-c", NO_FILTER]).returncode == 0:
            return name
    return None


OLD_PYTHON = python_without_extraction_filters()
PYTHONS = [
    pytest.param(sys.executable, id="this-python"),
    pytest.param(OLD_PYTHON, id="python-3.11-without-tarfile-filters",
                 marks=pytest.mark.skipif(OLD_PYTHON is None, reason="no Python 3.11 < 3.11.4 on this machine")),
]


def sdist(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def unpack(python: str, archive: Path, dest: Path) -> subprocess.CompletedProcess:
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import install_horovod; "
            "install_horovod.unpack_sdist(Path(sys.argv[2]), Path(sys.argv[3]))")
    return subprocess.run([python, "-c", code, str(SCRIPTS), str(archive), str(dest)], capture_output=True, text=True)


@pytest.mark.parametrize("python", PYTHONS)
def test_the_sdist_unpacks(python, tmp_path):
    archive = sdist(tmp_path / "horovod-0.28.1.tar.gz", {"horovod-0.28.1/CMakeLists.txt": b"project(horovod)\n"})
    dest = tmp_path / "work"
    dest.mkdir()
    proc = unpack(python, archive, dest)
    assert proc.returncode == 0, proc.stderr
    assert (dest / "horovod-0.28.1" / "CMakeLists.txt").read_text() == "project(horovod)\n"


@pytest.mark.parametrize("python", PYTHONS)
def test_a_member_outside_the_work_directory_is_refused(python, tmp_path):
    archive = sdist(tmp_path / "horovod-0.28.1.tar.gz", {"horovod-0.28.1/../../escaped.txt": b"no\n"})
    dest = tmp_path / "a" / "work"
    dest.mkdir(parents=True)
    proc = unpack(python, archive, dest)
    assert proc.returncode != 0
    assert "escaped.txt" in proc.stderr
    assert not (tmp_path / "escaped.txt").exists()


def test_python_headers_are_found_where_they_are(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import install_horovod
    finally:
        sys.path.remove(str(SCRIPTS))
    assert install_horovod.python_headers_missing(sys.executable) is None  # this venv's Python has them
    target = install_horovod.Target(sys.executable, "2.13.0+cpu", None, "cp311")
    install_horovod.check_python_headers(target)
