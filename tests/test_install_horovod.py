"""scripts/install_horovod.py: which Horovod it builds for the environment, when it builds again, how it installs it,
and its unpacking of the sdist on the Python 3.11 releases it must run with: it runs before anything is installed,
with whatever python3 the machine or the image has (Debian bookworm's is 3.11.2, whose tarfile has no extraction
filters)."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install_horovod.py"


@pytest.fixture
def build(monkeypatch):
    spec = importlib.util.spec_from_file_location("install_horovod", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "install_horovod", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.delenv("HOROVOD_WITHOUT_TENSORFLOW", raising=False)
    return module


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed (make setup)")
def test_an_environment_with_tensorflow_gets_one_wheel_for_both_named_by_both(build, tmp_path, monkeypatch):
    target = build.probe(sys.executable)
    assert (target.torch_version, target.tf_version) == (version("torch"), version("tensorflow"))
    variant = build.choose_variant(target)
    assert variant.env["HOROVOD_WITH_PYTORCH"] == variant.env["HOROVOD_WITH_TENSORFLOW"] == "1"
    assert "HOROVOD_WITHOUT_TENSORFLOW" not in variant.env
    torch_tag = version("torch").replace("+", "_")
    assert (
        build.cache_dir(tmp_path, target, variant).name
        == f"horovod-0.28.1-torch-{torch_tag}-tf-{version('tensorflow')}-cp311-cpu"
    )

    monkeypatch.setenv("HOROVOD_WITHOUT_TENSORFLOW", "1")  # Horovod's own switch: PyTorch only
    assert build.probe_tensorflow(sys.executable) is None
    torch_only = dataclasses.replace(target, tf_version=None)
    assert build.choose_variant(torch_only).env["HOROVOD_WITHOUT_TENSORFLOW"] == "1"
    assert (
        build.cache_dir(tmp_path, torch_only, build.choose_variant(torch_only)).name
        == f"horovod-0.28.1-torch-{torch_tag}-cp311-cpu"
    )


def test_a_gpu_build_with_tensorflow_is_refused_with_the_way_out(build, tmp_path, monkeypatch):
    (tmp_path / "nvcc").write_text("#!/bin/sh\n")
    (tmp_path / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    target = build.Target("python", "2.13.0+cu128", "12.8", "cp311", tf_version="2.21.0")
    with pytest.raises(
        build.InstallError,
        match=r"GPU \(NCCL\) build of horovod with TensorFlow is not supported.*"
        r"Set HOROVOD_WITHOUT_TENSORFLOW=1 to build it for PyTorch only",
    ):
        build.choose_variant(target)


def fake_horovod(root: Path, *, with_tensorflow: bool) -> None:
    """A horovod 0.28.1 package built for torch, and for TensorFlow if ``with_tensorflow``."""
    for package in ["horovod", "horovod/torch", *(["horovod/tensorflow"] if with_tensorflow else [])]:
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("__version__ = '0.28.1'\n" if package == "horovod" else "")


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed (make setup)")
def test_a_horovod_without_tensorflow_is_built_again_where_tensorflow_is_installed(build, tmp_path, monkeypatch):
    fake_horovod(tmp_path / "torch-only", with_tensorflow=False)
    fake_horovod(tmp_path / "both", with_tensorflow=True)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "torch-only"))
    assert not build.horovod_installed(sys.executable)
    monkeypatch.setenv("HOROVOD_WITHOUT_TENSORFLOW", "1")
    assert build.horovod_installed(sys.executable)
    monkeypatch.delenv("HOROVOD_WITHOUT_TENSORFLOW")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "both"))
    assert build.horovod_installed(sys.executable)


def wheel(folder: Path, name: str, *, requires: list[str], marker: str = "") -> Path:
    """A minimal pure-Python wheel of ``name`` 0.28.1 (a module of that name holding ``marker``)."""
    dist_info = f"{name}-0.28.1.dist-info"
    path = folder / f"{name}-0.28.1-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.28.1\n" + "".join(
        f"Requires-Dist: {requirement}\n" for requirement in requires
    )
    files = {
        f"{name}/__init__.py": f"__version__ = '0.28.1'\nMARKER = {marker!r}\n",
        f"{dist_info}/METADATA": metadata,
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist_info}/RECORD"] = "".join(f"{file},,\n" for file in [*files, f"{dist_info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
    return path


def test_the_wheel_goes_into_a_fresh_environment_with_its_dependencies_replacing_another_variant(
    build, tmp_path, monkeypatch
):
    """A fresh venv has none of horovod's dependencies (cloudpickle, psutil, ...): they are installed too; and an
    installed horovod of the same version but another variant is replaced."""
    import venv

    venv.create(tmp_path / "venv", with_pip=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    index = tmp_path / "index"
    (index / "old").mkdir(parents=True)
    wheel(index, "hvdtestdep", requires=[])
    other_variant = wheel(index / "old", "horovod", requires=[], marker="torch only")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    subprocess.run([python, "-m", "pip", "install", "--quiet", str(other_variant)], check=True)

    build.install_wheel(python, wheel(tmp_path, "horovod", requires=["hvdtestdep"], marker="torch and tensorflow"))

    installed = subprocess.run(
        [python, "-c", "import horovod, hvdtestdep; print(horovod.MARKER)"], capture_output=True, text=True
    )
    assert (installed.returncode, installed.stdout.strip()) == (0, "torch and tensorflow"), installed.stderr


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
    pytest.param(
        OLD_PYTHON,
        id="python-3.11-without-tarfile-filters",
        marks=pytest.mark.skipif(OLD_PYTHON is None, reason="no Python 3.11 < 3.11.4 on this machine"),
    ),
]


def sdist(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def unpack(python: str, archive: Path, dest: Path) -> subprocess.CompletedProcess:
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import install_horovod; "
        "install_horovod.unpack_sdist(Path(sys.argv[2]), Path(sys.argv[3]))"
    )
    return subprocess.run(
        [python, "-c", code, str(SCRIPT.parent), str(archive), str(dest)], capture_output=True, text=True
    )


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


def test_python_headers_are_found_where_they_are(build):
    assert build.python_headers_missing(sys.executable) is None  # this venv's Python has them
    build.check_python_headers(build.Target(sys.executable, "2.13.0+cpu", None, "cp311"))
